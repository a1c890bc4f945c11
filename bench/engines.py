"""The Monty engine beside the container engine, in one run (not a test).

    deploy/local.sh bench --engines [--runs 200] [--sustain-s 20]
    (= .venv/bin/python -m bench.engines ...)

Starts its own service (a warm pool of 2, sessions allowed, a high per-key rate) and measures, each figure for
each engine in the same run, rounds interleaved so that the machine's drift falls on both (times in ms, HTTP round
trip of ``POST /execute``, median and p90):

- ``print(1)``: Monty one-shot (``engine: "monty"``), beside the container engine in a session (its fastest path)
  and from its warm pool (each round after an untimed 0.5 s in which the pool refills: a container starting takes
  the CPUs of this machine);
- a script of 3 sequential echo tool calls, the same three ways;
- a fan-out of 1,000 concurrent echo calls (``tools.aio`` + ``asyncio.gather``), HTTP round trip of the job;
- sustained runs per second of ``print(1)`` with 8 concurrent clients for ``--sustain-s`` seconds: Monty one-shot
  beside the container engine in sessions (one per client), with error counts;
- memory: the resident set of one idle Monty worker (``/proc/<pid>/status`` VmRSS of the key's ``monty``
  processes), beside an idle container session (the engine's stats, usage minus page cache); and what a parked
  Monty job keeps (its run spec with the interpreter's state, bytes in the job store; it holds no worker), for a
  script that made 100 calls and keeps a 1,000-item list when it parks on a client-executed call.

Prints one table; ``docs/performance.md`` quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import docker
import httpx

from bench.__main__ import stats
from tests.conftest import start_service

ECHO = [{"name": "echo", "parameters": {"properties": {"i": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]
ASK = {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}}
PARKS = """import tools
kept = [tools.echo(i=i) for i in range(100)] + list(range(900))
print(len(kept), tools.ask(q="go"))
"""
PRINT = "print(1)"
THREE_CALLS = "import tools\nfor i in range(3):\n    tools.echo(i=i)\nprint(1)"
FAN_OUT = """import asyncio, tools
async def main():
    return await asyncio.gather(*[tools.aio.echo(i=i) for i in range(1000)])
print(1 if len(asyncio.run(main())) == 1000 else 0)
"""
WAYS = ("monty", "container session", "container warm pool")


def timed(api: httpx.Client, body: dict[str, Any]) -> float:
    """One ``POST /execute``; its round trip (ms). Raises RuntimeError unless it printed 1."""
    began = time.perf_counter()
    view = api.post("/execute", json=body).json()
    elapsed = (time.perf_counter() - began) * 1000
    if view.get("stdout") != "1\n":
        raise RuntimeError(f"{body.get('engine')}: {view}")
    return elapsed


def sustained(url: str, headers: dict[str, str], bodies: list[dict[str, Any]], seconds: float) -> tuple[float, int]:
    """Runs per second and errors of one client per body, each posting its body in a loop for ``seconds``."""
    done, errors = [0], [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(body: dict[str, Any]) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as api:
            while time.monotonic() < stop:
                try:
                    ok = api.post("/execute", json=body).json().get("stdout") == "1\n"
                except httpx.HTTPError:
                    ok = False
                with lock:
                    done[0] += ok
                    errors[0] += not ok

    threads = [threading.Thread(target=client, args=(body,)) for body in bodies]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done[0] / (time.monotonic() - began), errors[0]


def worker_rss_kb(service_pid: int) -> list[int]:
    """VmRSS (KiB) of each ``monty`` worker process under the service's process."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if cmdline and cmdline[0] == b"/monty" and _descends(int(pid), service_pid):
            found += [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")]
    return found


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def session_memory_mib(session: dict[str, Any]) -> float:
    """An idle session's container memory (usage minus page cache, MiB), from the engine's stats."""
    container = docker.from_env().containers.get(session["sandbox_id"])
    stats_now: dict[str, Any] = container.stats(stream=False)  # type: ignore[assignment]
    memory = stats_now["memory_stats"]
    cache = memory.get("stats", {}).get("inactive_file", memory.get("stats", {}).get("cache", 0))
    return float(memory["usage"] - cache) / 2**20


def parked_state_bytes(api: httpx.Client, work_dir: Path) -> tuple[int, int]:
    """(run spec bytes, its state's share) of a parked Monty job (``PARKS``), read from the service's store."""
    job_id = api.post("/execute", json={"script": PARKS, "tools": [*ECHO, ASK], "engine": "monty", "wait_s": 0}).json()[
        "job_id"
    ]
    deadline = time.monotonic() + 30
    while api.get(f"/jobs/{job_id}").json().get("parked_at") is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the job was not parked")
        time.sleep(0.2)
    with sqlite3.connect(work_dir / "jobs.sqlite3") as db:
        (spec,) = db.execute("SELECT spec FROM job_runs WHERE job_id = ?", (job_id,)).fetchone()
    state = json.loads(spec).get("state") or [""]
    api.post(f"/jobs/{job_id}/stop")
    return len(spec), len(state[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per figure and way (default 200)")
    parser.add_argument("--fan-out-runs", type=int, default=10, help="timed 1,000-call fan-outs per engine")
    parser.add_argument("--sustain-s", type=float, default=20.0, help="seconds of each sustained run (default 20)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptce", dir="/tmp"))
    service = start_service(
        f"engines-{secrets.token_hex(4)}",
        scratch / "svc",
        PTC_LOG_LEVEL="warning",
        PTC_WARM_POOL_SIZE="2",
        PTC_QUOTA_JOBS_PER_MINUTE="1000000",
        PTC_MONTY_WORKERS_PER_KEY="8",
        PTC_PARK_AFTER_S="1",
    )
    figures: dict[str, dict[str, list[float]]] = {key: {way: [] for way in WAYS} for key in ("print", "calls")}
    fan_out: dict[str, list[float]] = {"monty": [], "container": []}
    try:
        with service.client(timeout=120) as api:
            session = api.post("/sessions", json={"tools": ECHO}).json()
            ways = {
                "monty": {"engine": "monty"},
                "container session": {"session_id": session["session_id"]},
                "container warm pool": {},
            }
            for extra in ways.values():  # warm up: the key's Monty pool, the session's first run
                timed(api, {"script": PRINT, "tools": ECHO, **extra})
            for key, script in (("print", PRINT), ("calls", THREE_CALLS)):
                for _ in range(args.runs):
                    for way, extra in ways.items():
                        figures[key][way].append(timed(api, {"script": script, "tools": ECHO, **extra}))
                    time.sleep(0.5)  # the warm pool refills (a container started) before the next round is timed
            for _ in range(args.fan_out_runs):
                for engine in fan_out:
                    body = {"script": FAN_OUT, "tools": ECHO, "engine": engine, "timeout_s": 120}
                    fan_out[engine].append(timed(api, body))
            rss = worker_rss_kb(service.process.pid)
            spec_bytes, state_bytes = parked_state_bytes(api, service.work_dir)
            idle_session = session_memory_mib(session)
            sessions = [api.post("/sessions", json={}).json()["session_id"] for _ in range(8)]
            headers = service.headers
            container_rate = sustained(
                service.url, headers, [{"script": PRINT, "session_id": s} for s in sessions], args.sustain_s
            )
            monty_rate = sustained(service.url, headers, [{"script": PRINT, "engine": "monty"}] * 8, args.sustain_s)
            for sid in [*sessions, session["session_id"]]:
                api.delete(f"/sessions/{sid}")
    finally:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'figure (ms), median (p90)':44} " + "  ".join(f"{way:>22}" for way in WAYS))
    for key, label in (("print", "print(1)"), ("calls", "3 sequential echo calls")):
        cells = []
        for way in WAYS:
            st = stats(figures[key][way])
            cells.append(f"{st['median']:7.2f} (p90 {st['p90']:7.2f})")
        print(f"{label:44} " + "  ".join(f"{c:>22}" for c in cells))
    monty_fan, container_fan = stats(fan_out["monty"]), stats(fan_out["container"])
    print(
        f"{'1,000-call fan-out (gather)':44} {monty_fan['median']:7.1f} (p90 {monty_fan['p90']:7.1f})"
        f"  {'':>22}  {container_fan['median']:7.1f} (p90 {container_fan['p90']:7.1f}) [one-shot]"
    )
    ratio = monty_rate[0] / container_rate[0] if container_rate[0] else float("inf")
    print(
        f"{'runs/s, 8 clients, ' + str(args.sustain_s) + ' s':44} {monty_rate[0]:10.1f} ({monty_rate[1]} errors)"
        f"  {container_rate[0]:10.1f} ({container_rate[1]} errors) [sessions]  ratio {ratio:.1f}x"
    )
    workers = f"{min(rss) / 1024:.1f}-{max(rss) / 1024:.1f} MiB ({len(rss)} workers)" if rss else "none found"
    print(f"{'memory: an idle Monty worker (RSS)':44} {workers}   an idle container session: {idle_session:.1f} MiB")
    print(
        f"{'a parked Monty job (100 calls made)':44} {spec_bytes / 1024:.1f} KiB of run spec in the store, of which "
        f"{state_bytes / 1024:.1f} KiB the interpreter's state (base64); no worker"
    )


if __name__ == "__main__":
    main()
