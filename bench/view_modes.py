"""Benchmark (not a test): ``GET /jobs/{id}`` of a 1,000-call job with ``calls=full``, ``summary`` and ``none``.

    .venv/bin/python bench/view_modes.py [--calls 1000] [--arg-bytes 8192] [--reads 20]

Runs the service in this process on the fake backend (no engine needed), with one job whose script makes
``--calls`` echo tool calls, each with an argument of ``--arg-bytes`` (the echo result repeats it, so a record
holds about twice that), then sleeps. It reads the view ``--reads`` times per mode while the job runs (live:
rendered from the records in memory), then stops the job and reads it again ended (the encoded view kept in the
view cache) and read back from the store (the cache emptied before each read). Prints, per phase and mode, the
response size and the median and max time of one read (ms), through httpx's in-process ASGI transport.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from service.api import create_app
from service.composition.job_manager import JobManager
from service.sandbox.fake import FakeBackend
from service.settings import Settings

TOOLS = [{"name": "echo", "parameters": {"properties": {"text": {"type": "string"}}}, "endpoint": {"kind": "echo"}}]
SCRIPT = """
import time, tools
text = "x" * {arg_bytes}
for i in range({calls}):
    tools.echo(text=text)
print("calls done", flush=True)
time.sleep(600)
"""
MODES = ("full", "summary", "none")


async def timed_reads(
    client: httpx.AsyncClient, job_id: str, mode: str, reads: int, before: object = None
) -> tuple[int, list[float]]:
    times, size = [], 0
    for _ in range(reads):
        if callable(before):
            before()
        started = time.perf_counter()
        answer = await client.get(f"/jobs/{job_id}", params={"calls": mode})
        times.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 200, answer.text
        size = len(answer.content)
    return size, times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--arg-bytes", type=int, default=8192)
    parser.add_argument("--reads", type=int, default=20)
    options = parser.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        auth="disabled",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        max_record_bytes=1 << 30,
        max_record_bytes_total=1 << 30,
        view_cache_bytes=1 << 30,
    )
    app = create_app(settings, FakeBackend())
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
                script = SCRIPT.format(calls=options.calls, arg_bytes=options.arg_bytes)
                job_id = (await client.post("/execute", json={"script": script, "tools": TOOLS, "wait_s": 0})).json()[
                    "job_id"
                ]
                for _ in range(3000):  # the calls are made (10 minutes at most)
                    view = (await client.get(f"/jobs/{job_id}", params={"calls": "none"})).json()
                    if "calls done" in view["stdout"]:
                        break
                    await asyncio.sleep(0.2)
                jobs: JobManager = app.state.jobs
                print(f"{options.calls} calls, arguments of {options.arg_bytes} bytes; {options.reads} reads each")
                print(f"{'phase':8} {'calls=':8} {'bytes':>12} {'median ms':>10} {'max ms':>8}")
                for phase in ("live", "ended", "stored"):
                    if phase == "ended":
                        await client.post(f"/jobs/{job_id}/stop")
                    for mode in MODES:
                        forget = (lambda: jobs.views._views.drop(job_id)) if phase == "stored" else None
                        size, times = await timed_reads(client, job_id, mode, options.reads, forget)
                        print(f"{phase:8} {mode:8} {size:>12,} {statistics.median(times):>10.2f} {max(times):>8.2f}")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
