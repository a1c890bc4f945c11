"""What durability costs (docs/durability.md): the same one-shot jobs with ``durable`` true and false, interleaved.

    .venv/bin/python -m bench.durability [--runs 30] [--calls 300] [--fanout 1000] [--rounds 5]

Starts its own service (SQLite store, a warm pool of 2) and measures, alternating durable and not so that the
machine's drift falls on both alike:

- ``print(1)`` as a one-shot job from the warm pool, round trip (ms): a durable job's run spec is written before
  its script starts;
- one echo call's round trip inside a script (ms, each of ``--calls`` sequential calls timed in the script): a
  durable call's intent and outcome are written before it goes on and before the script sees it;
- the wall time of ``--fanout`` concurrent echo calls (``asyncio.gather``; ms, ``--rounds`` per job): their
  intents and outcomes written in batches, one per turn of the event loop;
- a client-executed call answered after the job has waited 1.5 s, from the answer's POST to the job's end (ms,
  ``--parks`` jobs per mode): a durable job is parked after 1 s (``PTC_PARK_AFTER_S``) and resumed by replay in a
  new sandbox; one that is not durable waits in its sandbox.

A session's scripts are never durable: ``print(1)`` in a session is measured once, in the same run, as the yardstick
(the same code path either way).
Not a test: figures for the closing note and docs/durability.md.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.__main__ import ECHO, FANOUT_SCRIPT, SEQUENTIAL_SCRIPT, stats
from tests.conftest import pool_ready, start_service, wait_until


def one_shot(api: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One job as a one-shot ``/execute``; (round trip ms, view)."""
    started = time.perf_counter()
    view: dict[str, Any] = api.post("/execute", json={**body, "timeout_s": 600, "wait_s": 300}).json()
    elapsed = (time.perf_counter() - started) * 1000
    if view.get("status") != "succeeded":
        raise RuntimeError(f"{body['script'][:40]!r}: {view.get('status')} {view.get('error')}")
    return elapsed, view


ASK = [{"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}}]


def answered(api: httpx.Client, durable: bool) -> float:
    """A job that waits 1.5 s for a client-executed call (parked after 1 s when ``durable``), then gets its answer:
    ms from the answer's POST to the job's end."""
    body = {"script": "import tools\nprint(tools.ask(q='x'))", "tools": ASK, "durable": durable, "wait_s": 0}
    job_id = api.post("/execute", json=body).json()["job_id"]
    wait_until(lambda: api.get(f"/jobs/{job_id}").json()["status"] == "waiting", 60)
    time.sleep(1.5)
    [pending] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
    if durable and api.get(f"/jobs/{job_id}").json()["parked_at"] is None:
        raise RuntimeError("a durable job waiting for 1.5 s was not parked")
    started = time.perf_counter()
    api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "y"}).raise_for_status()
    while (view := api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60}).json())["ended_at"] is None:
        pass
    if view["status"] != "succeeded" or view["stdout"] != "y\n":
        raise RuntimeError(f"an answered job: {view['status']} {view['error']}")
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="print(1) jobs per mode (default 30)")
    parser.add_argument("--calls", type=int, default=300, help="sequential echo calls per job (default 300)")
    parser.add_argument("--fanout", type=int, default=1000, help="concurrent echo calls (default 1000)")
    parser.add_argument("--rounds", type=int, default=5, help="fan-outs per job (default 5)")
    parser.add_argument("--parks", type=int, default=10, help="answered client calls per mode (default 10)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptcd", dir="/tmp"))
    service = start_service(
        f"durability-{secrets.token_hex(4)}",
        scratch / "svc",
        PTC_LOG_LEVEL="warning",
        PTC_WARM_POOL_SIZE="2",
        PTC_QUOTA_JOBS_PER_MINUTE="100000",
        PTC_PARK_AFTER_S="1",
    )
    modes = {"durable": True, "not durable": False}
    print1: dict[str, list[float]] = {mode: [] for mode in modes}
    round_trips: dict[str, list[float]] = {mode: [] for mode in modes}
    fanouts: dict[str, list[float]] = {mode: [] for mode in modes}
    answers: dict[str, list[float]] = {mode: [] for mode in modes}
    in_session: list[float] = []
    try:
        with service.client(timeout=900) as api:
            for _ in range(args.runs):
                for mode, durable in modes.items():
                    wait_until(lambda: pool_ready(api, "default") >= 1, 60)
                    print1[mode].append(one_shot(api, {"script": "print(1)", "durable": durable})[0])
            for mode, durable in modes.items():
                script = SEQUENTIAL_SCRIPT.format(n=args.calls)
                round_trips[mode] = json.loads(
                    one_shot(api, {"script": script, "tools": ECHO, "durable": durable})[1]["stdout"]
                )
            for _ in range(2):
                for mode, durable in modes.items():
                    script = FANOUT_SCRIPT.format(n=args.fanout, rounds=args.rounds)
                    view = one_shot(api, {"script": script, "tools": ECHO, "durable": durable})[1]
                    fanouts[mode] += json.loads(view["stdout"])
            session_id = api.post("/sessions", json={}).raise_for_status().json()["session_id"]
            for _ in range(args.runs):
                in_session.append(one_shot(api, {"script": "print(1)", "session_id": session_id})[0])
            api.delete(f"/sessions/{session_id}")
            for _ in range(args.parks):
                for mode, durable in modes.items():
                    answers[mode].append(answered(api, durable))
    finally:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`python -m bench.durability`).\n")
    print("| ms | durable: median | p90 | not durable: median | p90 | n |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, figures in (
        ("one-shot `print(1)` from the warm pool, round trip", print1),
        ("one echo call's round trip in a script", round_trips),
        (f"{args.fanout} concurrent echo calls, wall", fanouts),
        ("a client call answered after 1.5 s (durable: parked), answer to end", answers),
    ):
        on, off = stats(figures["durable"]), stats(figures["not durable"])
        print(f"| {name} | {on['median']:.2f} | {on['p90']:.2f} | {off['median']:.2f} | {off['p90']:.2f} | {on['n']} |")
    session = stats(in_session)
    row = f"{session['median']:.2f} | {session['p90']:.2f} | {session['n']}"
    print(f"| `print(1)` in a session (never durable) | | | {row} |")


if __name__ == "__main__":
    main()
