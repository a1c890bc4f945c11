"""Benchmark (not a test): the job store's own operations, no service, no engine.

    .venv/bin/python -m tests.benchmarks.store_ops [--jobs 20000] [--n 2000] [--url postgresql://…]

Opens a fresh store (SQLite in a temporary folder, or PostgreSQL at ``--url``: its tables must be empty or
absent), puts ``--jobs`` jobs of a ~4 KiB view one after another, then times ``--n`` sequential ``get`` of random
jobs, ``--n`` sequential ``put`` (replace) and 200 first pages of ``GET /jobs`` (50 jobs, one owner). Prints the
time to open (migrations included) and, per operation, the median and p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from service.store import JobQuery, JobStore, StoredJob
from service.store.sqlite import SQLiteJobStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
VIEW = b'{"status": "succeeded", "stdout": "' + b"x" * 4000 + b'"}'


def row(i: int) -> StoredJob:
    created = T0 + timedelta(milliseconds=i)
    return StoredJob(f"job_{i:08d}", "succeeded", "bench", created, created, VIEW, b'{"s": 1}', False, f"k{i % 4}")


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> str:
    samples = []
    for i in range(n):
        started = time.perf_counter()
        await op(i)
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return f"median {statistics.median(samples):.3f} ms, p99 {samples[int(0.99 * (len(samples) - 1))]:.3f} ms"


async def run(store: JobStore, jobs: int, n: int) -> None:
    started = time.perf_counter()
    await store.open()
    print(f"open (migrations): {(time.perf_counter() - started) * 1000:.1f} ms")
    try:
        started = time.perf_counter()
        for i in range(jobs):
            await store.jobs.put(row(i))
        print(f"fill {jobs} jobs: {(time.perf_counter() - started) / jobs * 1000:.3f} ms per put")
        print("get:", await timed(n, lambda _: store.jobs.get(f"job_{random.randrange(jobs):08d}")))
        print("put (replace):", await timed(n, lambda _: store.jobs.put(row(random.randrange(jobs)))))
        print("page (50, one owner):", await timed(200, lambda _: store.jobs.page(JobQuery(limit=50, owner="k1"))))
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--url", help="a PostgreSQL database (default: SQLite in a temporary folder)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    try:
        if args.url:
            from service.store.pg import PostgresJobStore

            store: JobStore = PostgresJobStore(args.url)
        else:
            store = SQLiteJobStore(scratch / "jobs.sqlite3")
        print(f"store: {store.describe()}")
        asyncio.run(run(store, args.jobs, args.n))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
