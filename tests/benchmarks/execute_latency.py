"""Benchmark (not a test): time of ``POST /execute`` for ``print(1)`` beside ``docker run --rm`` of the same image.

    .venv/bin/python -m tests.benchmarks.execute_latency [--n 20] [--url http://127.0.0.1:8080]

Without ``--url`` it starts its own service (instance ``bench-*``, scratch work
dir); with it, the API key is the token in ``PTC_TOKEN``. Prints median, p90
and min in milliseconds for, in one run on the same machine: the HTTP round
trip of ``/execute`` from the warm pool (each request after an untimed 0.4 s
pause that lets the pool refill) and cold (non-default limits, so no pooled
sandbox fits), ``docker run --rm --network none`` of the sandbox image running
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

from tests.conftest import IMAGE, auth_headers, start_service


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
        with httpx.Client(base_url=url, timeout=60, headers=auth_headers(service)) as api:
            starts: dict[str, list[str]] = {"warm": [], "cold": []}

            def execute(kind: str, body: dict[str, object], n: int) -> list[float]:
                """``n`` timed requests after 2 untimed; a warm one first lets the pool refill (untimed)."""
                samples = []
                for i in range(n + 2):
                    if kind == "warm":
                        time.sleep(0.4)
                    started = time.perf_counter()
                    view = api.post("/execute", json={"script": "print(1)", **body}).json()
                    elapsed = (time.perf_counter() - started) * 1000
                    assert view["stdout"] == "1\n", view
                    if i >= 2:
                        samples.append(elapsed)
                        starts[kind].append(view["sandbox_start"])
                return samples

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
            print(row("POST /execute, warm pool (HTTP round trip)", execute("warm", {}, args.n)))
            cold = execute("cold", {"limits": {"memory_mb": 255}}, args.n)
            print(row("POST /execute, cold sandbox (non-default limits)", cold))
            print(row(f"docker run --rm --network none {IMAGE}", timed(docker_run, args.n)))
            print(row("/usr/bin/python3 -c 'print(1)'", timed(bare, args.n)))
            for kind, seen in starts.items():
                print(f"{kind} requests ran in: {', '.join(f'{s} x{seen.count(s)}' for s in sorted(set(seen)))}")
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
