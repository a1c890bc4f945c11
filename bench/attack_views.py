"""Attack (not a test): one job with large call records, then parallel reads of its view (issue 11, items 9-10).

    .venv/bin/python bench/attack_views.py [--root DIR] [--calls 62] [--item-count 40000] [--readers 10]

Starts a service from the code in ``--root`` (default: this checkout; its ``.venv/bin/python`` runs it),
with a scratch work dir and one API key, and then:

1. runs a job whose script makes ``--calls`` echo tool calls, each with an argument of
   ``--item-count`` small objects (``{"k": i}``, about 12 bytes of JSON each: ~0.5 MB per call, and the
   echo result repeats it), then sleeps so the job stays running;
2. live phase: ``--readers`` parallel ``GET /jobs/{id}`` of the running job, while ``/healthz`` is
   probed every 50 ms;
3. ended phase: the job is stopped; ``--readers`` parallel ``GET /jobs/{id}`` and as many
   ``POST /jobs/{id}/wait`` of the ended job, with the same probe.

The probe runs in this process: nothing here parses a view while it runs (a 58 MB ``json.loads`` would hold
this process's GIL for seconds and show up as the service's latency).

Prints (and with ``--out FILE`` writes as JSON): the service's RSS before the job, after the calls,
after each phase and its peak (``VmHWM`` of ``/proc/<pid>/status``), the ``/healthz`` latencies during
each phase (max and median, ms), how long the reads took, and the size of one view.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from service.tenancy import hash_token
from tests.probe import HealthProbe

HERE = Path(__file__).resolve().parent.parent
IMAGE = os.environ.get("PTC_SANDBOX_IMAGE", "ptc-sandbox-runtime:latest")
TOOLS = [
    {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"items": {"type": "array"}}},
        "endpoint": {"kind": "echo"},
    }
]
SCRIPT = """
import time, tools
items = [{{"k": i}} for i in range({items})]
for _ in range({calls}):
    tools.echo(items=items)
print("calls done", flush=True)
time.sleep({sleep})
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def parallel(readers: int, fn: Any) -> tuple[float, list[Any]]:
    begin = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        results = list(pool.map(lambda _: fn(), range(readers)))
    return round(time.perf_counter() - begin, 2), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=HERE, help="checkout whose service code runs")
    parser.add_argument("--calls", type=int, default=62)
    parser.add_argument("--item-count", type=int, default=40_000)
    parser.add_argument("--readers", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the service (repeatable)")
    args = parser.parse_args()

    root = args.root.resolve()
    scratch = Path(tempfile.mkdtemp(prefix="ptcatk", dir="/tmp"))
    token = secrets.token_urlsafe(32)
    port = free_port()
    env = {
        **os.environ,
        "PTC_PORT": str(port),
        "PTC_INSTANCE_ID": f"attack-{secrets.token_hex(4)}",
        "PTC_WORK_DIR": str(scratch / "svc"),
        "PTC_SANDBOX_IMAGE": IMAGE,
        "PTC_AUTH": "required",
        "PTC_API_KEYS": f"attack:{hash_token(token)}",
        "PTC_WARM_POOL_SIZE": "0",
        "PTC_LOG_LEVEL": "warning",
        **dict(item.split("=", 1) for item in args.env),
    }
    log = open(scratch / "service.log", "wb")
    process = subprocess.Popen(
        [str(root / ".venv/bin/python"), "-m", "service", "serve"], cwd=root, env=env, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    figures: dict[str, Any] = {"root": str(root), "calls": args.calls, "item_count": args.item_count}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (scratch / "service.log").read_text()
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "service not ready"
            time.sleep(0.2)
        figures["rss_start_mb"] = status_kb(process.pid)["VmRSS"] // 1024
        headers = {"Authorization": f"Bearer {token}"}
        api = httpx.Client(base_url=url, headers=headers, timeout=600)
        script = SCRIPT.format(items=args.item_count, calls=args.calls, sleep=600)
        job = api.post("/execute", json={"script": script, "tools": TOOLS, "wait_s": 0, "timeout_s": 900}).json()
        job_id = job["job_id"]
        begin = time.monotonic()
        while "calls done" not in api.get(f"/jobs/{job_id}/output/stdout").text:
            assert time.monotonic() - begin < 600, "the calls did not finish"
            time.sleep(1)
        figures["calls_s"] = round(time.monotonic() - begin, 1)
        figures["rss_after_calls_mb"] = status_kb(process.pid)["VmRSS"] // 1024

        def get() -> int:
            with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
                return len(client.get(f"/jobs/{job_id}").content)

        def wait() -> int:
            with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
                return len(client.post(f"/jobs/{job_id}/wait", params={"timeout_s": 0}).content)

        with HealthProbe(url) as probe:
            seconds, sizes = parallel(args.readers, get)
        figures["live"] = {"gets_s": seconds, "view_bytes": sizes[0], **probe.summary_ms()}
        figures["live"]["rss_mb"] = status_kb(process.pid)["VmRSS"] // 1024

        stopped = api.post(f"/jobs/{job_id}/stop")
        figures["stop_s"] = round(stopped.elapsed.total_seconds(), 2)
        with HealthProbe(url) as probe:
            seconds, sizes = parallel(args.readers, get)
            wait_seconds, _ = parallel(args.readers, wait)
        figures["ended"] = {"gets_s": seconds, "waits_s": wait_seconds, "view_bytes": sizes[0], **probe.summary_ms()}
        final = api.get(f"/jobs/{job_id}").json()  # parsed after the probe stopped: it holds this process's GIL
        figures["ended"] |= {
            "status": final["status"],
            "calls_kept": len(final["calls"]),
            "calls_with_args_dropped": sum(1 for c in final["calls"] if c.get("args_dropped_bytes")),
        }
        status = status_kb(process.pid)
        figures["ended"]["rss_mb"] = status["VmRSS"] // 1024
        figures["rss_peak_mb"] = status["VmHWM"] // 1024
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
