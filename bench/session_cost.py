"""What one ``print(1)`` in a session costs, in CPU, and how its latency depends on the pause before it.

    .venv/bin/python -m bench.session_cost [--runs 300]

Starts its own service (no warm pool), opens one session and runs ``print(1)`` in it ``--runs`` times back to
back, then reports the CPU time per run (ms) of the service process (``/proc/<pid>/stat`` utime + stime), of the
session's sandbox (the engine's ``cpu_stats.cpu_usage.total_usage``, every process of the container) and of this
client (``time.process_time``): their sum bounds the runs per second the machine's cores can give, whatever the
latency. Then it runs ``print(1)`` after untimed pauses of 0, 5, 20 and 100 ms (latency median, p90 and p99, ms):
on a virtual machine an idle core takes time to wake. Not a test: figures for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import docker
import httpx
from docker.models.containers import Container

from bench.__main__ import stats
from service.sandbox.labels import LABEL_INSTANCE
from tests.conftest import start_service

PAUSES_S = (0.0, 0.005, 0.02, 0.1)
TICKS = os.sysconf("SC_CLK_TCK")


def service_cpu_ms(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICKS


def sandbox_cpu_ms(container: Container) -> float:
    """CPU time of every process of ``container`` so far, ms (the engine's stats)."""
    stats: Any = container.stats(stream=False)
    return float(stats["cpu_stats"]["cpu_usage"]["total_usage"]) / 1e6


def run(api: httpx.Client, sid: str) -> float:
    """One ``print(1)`` in session ``sid``; its round trip, ms."""
    started = time.perf_counter()
    view = api.post("/execute", json={"script": "print(1)", "session_id": sid, "tools": []}).json()
    elapsed = (time.perf_counter() - started) * 1000
    if view.get("stdout") != "1\n":
        raise RuntimeError(f"print(1): {view}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300, help="runs for the CPU figures (default 300)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptcc", dir="/tmp"))
    instance = f"cost-{secrets.token_hex(4)}"
    service = start_service(
        instance, scratch / "svc", PTC_LOG_LEVEL="warning", PTC_WARM_POOL_SIZE="0", PTC_QUOTA_JOBS_PER_MINUTE="100000"
    )
    engine = docker.from_env()
    try:
        with service.client(timeout=60) as api:
            sid = api.post("/sessions", json={}).json()["session_id"]
            (container,) = engine.containers.list(filters={"label": f"{LABEL_INSTANCE}={instance}"})
            for _ in range(20):
                run(api, sid)
            before = service_cpu_ms(service.process.pid), sandbox_cpu_ms(container), time.process_time()
            latencies = [run(api, sid) for _ in range(args.runs)]
            after = service_cpu_ms(service.process.pid), sandbox_cpu_ms(container), time.process_time()
            service_ms, sandbox_ms = (after[0] - before[0]) / args.runs, (after[1] - before[1]) / args.runs
            client_ms = (after[2] - before[2]) * 1000 / args.runs
            total = service_ms + sandbox_ms + client_ms
            print(f"{args.runs} runs back to back: median {statistics.median(latencies):.1f} ms")
            print(f"CPU per run, ms: service {service_ms:.1f}, sandbox {sandbox_ms:.1f}, client {client_ms:.1f}")
            print(
                f"  total {total:.1f} ms: at most {os.cpu_count() or 1} cores / {total:.1f} ms = "
                f"{(os.cpu_count() or 1) * 1000 / total:.0f} runs/s"
            )
            for pause in PAUSES_S:
                samples = []
                for _ in range(100):
                    time.sleep(pause)
                    samples.append(run(api, sid))
                st = stats(samples)
                print(
                    f"after {pause * 1000:3.0f} ms idle: median {st['median']:.1f}, "
                    f"p90 {st['p90']:.1f}, p99 {st['p99']:.1f} ms"
                )
            api.delete(f"/sessions/{sid}")
    finally:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
