"""Benchmark (not a test): time of ``POST /execute`` for ``print(1)`` beside ``docker run --rm`` of the same image.

    .venv/bin/python -m tests.benchmarks.execute_latency [--n 20] [--url http://127.0.0.1:8080]

Without ``--url`` it starts its own service (instance ``bench-*``, scratch work
dir). Prints median, p90 and min in milliseconds for, in one run on the same
machine: the HTTP round trip of ``/execute`` (a fresh sandbox per request),
``docker run --rm --network none`` of the sandbox image running
``python3 -c 'print(1)'``, and bare ``/usr/bin/python3 -c 'print(1)'`` as the floor.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.conftest import IMAGE, start_service


def timed(fn: Callable[[], None], n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def row(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return f"{name:<58} {statistics.median(ordered):8.1f} {p90:8.1f} {ordered[0]:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20, help="samples per measurement (default 20)")
    parser.add_argument("--url", help="an already running service; default: start one")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptcb", dir="/tmp"))
    service = None if args.url else start_service(f"bench-{secrets.token_hex(4)}", scratch / "svc")
    url = args.url or (service.url if service else "")
    try:
        with httpx.Client(base_url=url, timeout=60) as api:

            def execute() -> None:
                view = api.post("/execute", json={"script": "print(1)"}).json()
                assert view["stdout"] == "1\n", view

            def docker_run() -> None:
                out = subprocess.run(
                    ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", IMAGE, "-c", "print(1)"],
                    check=True,
                    capture_output=True,
                )
                assert out.stdout == b"1\n"

            def bare() -> None:
                subprocess.run(["/usr/bin/python3", "-c", "print(1)"], check=True, capture_output=True)

            print(f"{'print(1), n=' + str(args.n):<58} {'median':>8} {'p90':>8} {'min':>8}  (ms)")
            print(row("POST /execute (cold sandbox, HTTP round trip)", timed(execute, args.n)))
            print(row(f"docker run --rm --network none {IMAGE}", timed(docker_run, args.n)))
            print(row("/usr/bin/python3 -c 'print(1)'", timed(bare, args.n)))
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
