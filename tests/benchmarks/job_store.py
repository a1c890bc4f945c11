"""Benchmark (not a test): ``GET /jobs/{id}`` latency with a large job store.

    .venv/bin/python -m tests.benchmarks.job_store [--jobs 100000] [--n 2000]

Runs one real job on a fresh service, stops it, copies that job's stored view
into ``--jobs`` rows of the same SQLite store (distinct ids and times), starts
the service again on it and times ``--n`` sequential ``GET /jobs/{id}`` of
random ended jobs over HTTP (one keep-alive connection). Prints the store size
and the median, p90 and p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import httpx
import orjson

from service.jobs.live import stored_job
from service.store import StoredJob
from service.store.sqlite import SQLiteJobStore
from tests.conftest import execute, start_service


async def fill(path: Path, template: StoredJob, count: int) -> list[str]:
    store = SQLiteJobStore(path)
    await store.open()
    view = orjson.loads(template.view)
    ids = []
    for i in range(count):
        job_id = "job_" + secrets.token_hex(12)
        created = template.created_at - timedelta(milliseconds=count - i)
        body = orjson.dumps({**view, "job_id": job_id, "created_at": created})
        row = stored_job(
            {**view, "job_id": job_id, "created_at": created}, len(view["calls"]), body, template.instance_id
        )
        await store.jobs.put(row)
        ids.append(job_id)
    total = await store.jobs.count()
    await store.close()
    print(f"store: {total} jobs in {path}")
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    instance = f"bench-{secrets.token_hex(4)}"
    try:
        svc = start_service(instance, scratch / "svc")
        tools = [{"name": "t", "endpoint": {"kind": "echo"}}]
        with svc.client() as api:
            view = execute(api, "import tools\nprint(tools.t(), flush=True)", tools)
        svc.stop()

        async def template() -> StoredJob:
            store = SQLiteJobStore(svc.work_dir / "jobs.sqlite3")
            await store.open()
            row = await store.jobs.get(view["job_id"])
            await store.close()
            assert row is not None
            return row

        ids = asyncio.run(fill(svc.work_dir / "jobs.sqlite3", asyncio.run(template()), args.jobs))
        svc = start_service(instance, scratch / "svc")
        try:
            with httpx.Client(base_url=svc.url, timeout=10, headers=svc.headers) as api:
                for job_id in ids[:50]:
                    api.get(f"/jobs/{job_id}")
                samples = []
                for job_id in random.sample(ids, min(args.n, len(ids))):
                    started = time.perf_counter()
                    response = api.get(f"/jobs/{job_id}")
                    samples.append((time.perf_counter() - started) * 1000)
                    assert response.status_code == 200
            samples.sort()
            p90 = samples[int(0.9 * (len(samples) - 1))]
            p99 = samples[int(0.99 * (len(samples) - 1))]
            print(
                f"GET /jobs/{{id}} of an ended job, n={len(samples)}: median {statistics.median(samples):.2f} ms, "
                f"p90 {p90:.2f} ms, p99 {p99:.2f} ms"
            )
        finally:
            svc.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
