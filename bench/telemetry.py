"""Benchmark (not a test): what OpenTelemetry traces cost, off (the default) and on (OTLP/HTTP to a collector).

    .venv/bin/python -m bench.telemetry [--n 200] [--calls 1000]

Starts the real service twice on this machine (scratch work dir, no warm pool, one API key): once with no
``OTEL_*`` variable (tracing off), once with ``OTEL_TRACES_EXPORTER=otlp`` sending to a collector in this
process (``tests/integration/test_telemetry.py``'s, which decodes every batch). On each it measures, in ms:

- ``POST /execute`` of ``print(1)`` in a session, HTTP round trip (``--n`` times after 5 untimed): a request
  span, a job span and its two children when on;
- one echo tool call round trip inside a script (``--calls`` sequential calls timed in the sandbox): a tool call
  span each when on.

Also times, in this process with tracing off, the telemetry helpers one tool call goes through (``start_call``,
``current``, ``end_call``: what tracing costs a call when off), in ns.

Prints one JSON object: the figures, off and on, and how many spans the collector received.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import tempfile
import timeit
from pathlib import Path
from typing import Any

import docker

from bench.__main__ import ECHO, SEQUENTIAL_SCRIPT, Bench, stats, timed
from service.observability import telemetry
from tests.conftest import start_service, stop_clean
from tests.integration.test_telemetry import Collector


def measure(bench: Bench, n: int, calls: int) -> dict[str, Any]:
    """Session ``print(1)`` latency and the in-sandbox round trip of ``calls`` sequential echo calls."""
    sid = bench.session(tools=ECHO)
    try:
        latency = timed(lambda: bench.execute({"script": "print(1)", "session_id": sid}), n, 5)
        view = bench.execute({"script": SEQUENTIAL_SCRIPT.format(n=calls), "session_id": sid, "timeout_s": 600})
        round_trips = json.loads(view["stdout"])
    finally:
        bench.api.delete(f"/sessions/{sid}")
    return {"session_print1_ms": stats(latency), "echo_call_round_trip_ms": stats(round_trips)}


def helpers_off_ns(loops: int = 1_000_000) -> float:
    """ns per tool call spent in the telemetry helpers with tracing off (best of 5 runs of ``loops``)."""
    assert not telemetry.enabled()
    record = {"tool": "t", "call_id": "c", "seq": 1, "status": "ok", "duration_ms": 1.0}

    def one_call() -> None:
        span = telemetry.start_call(None, record)
        with telemetry.current(span):
            pass
        telemetry.end_call(span, record)

    return min(timeit.repeat(one_call, number=loops, repeat=5)) / loops * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    engine = docker.from_env()
    scratch = Path(tempfile.mkdtemp(prefix="ptcb", dir="/tmp"))
    collector = Collector()
    results: dict[str, Any] = {"tool_call_helpers_off_ns": round(helpers_off_ns(), 1)}
    try:
        for mode, env in (
            ("off", {}),
            ("on", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url}),
        ):
            instance = f"bench-otel-{mode}-{secrets.token_hex(3)}"
            svc = start_service(instance, scratch / mode, PTC_WARM_POOL_SIZE="0", **env)
            try:
                with svc.client(timeout=600) as api:
                    results[mode] = measure(Bench(api, engine, instance, svc.process.pid), args.n, args.calls)
            finally:
                stop_clean(engine, svc)
        results["spans_received_when_on"] = len(collector.spans)
    finally:
        collector.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
