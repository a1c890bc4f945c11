"""Metrics: the helpers of ``observability.metrics`` alone, and ``GET /metrics`` of a real service after a fixed mix."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest

from tests.conftest import Service, execute, start_service, wait_until
from tests.toolserver import ToolServer
from tests.unit.test_metrics import Samples, parse, value

COLD = {"memory_mb": 200}  # not the warm pool's profile: a cold start


CALLS_SCRIPT = """\
import tools
from ptc_runtime.client import client
for i in range(3):
    tools.lookup(q=str(i))
for bad in (lambda: tools.lookup(q=5), lambda: tools.broken(x=1),
            lambda: client().request({"tool": "no_such_tool", "args": {}})):
    try:
        bad()
    except tools.ToolError as e:
        print(e.type)
"""


def scrape(api: httpx.Client) -> Samples:
    response = api.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


@pytest.fixture(scope="module")
def metered(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service of its own (its counters are this test's alone), with one warm pool (the default profile's) of one."""
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}", scratch / "metrics", PTC_WARM_POOL_SIZE="1", PTC_WARM_POOL_MAX_PROFILES="1"
    )
    yield svc
    svc.stop()


CLOCK_COUNTERS = {"ptc_lease_renewals_total"}
"""Counters that tick with time, not with requests: the replica's heartbeat renews its lease every
``PTC_REPLICA_HEARTBEAT_S``."""


def test_a_fixed_mix_of_jobs_gives_exactly_the_expected_increments(metered: Service, tool_server: ToolServer) -> None:
    tools = [
        {"name": "lookup", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
        {
            "name": "broken",
            "parameters": {"properties": {"x": {}}},
            "endpoint": {"kind": "http", "url": tool_server.url("fail")},
        },
    ]
    with metered.client() as api:
        wait_until(lambda: value(scrape(api), "ptc_sandbox_pool_size", profile="default") == 1, 30)
        before = scrape(api)
        views = [
            execute(api, "print('warm')"),  # the pooled sandbox
            execute(api, CALLS_SCRIPT, tools, limits=COLD),
            execute(api, "raise SystemExit(3)", limits=COLD),
            execute(api, "import time\ntime.sleep(60)", limits=COLD, timeout_s=1),
            execute(api, "print('x' * 5000)", limits={**COLD, "output_bytes": 1024}),
        ]
        session = api.post("/sessions", json={})
        assert session.status_code == 201, session.text
        sid = session.json()["session_id"]
        views.append(execute(api, "print('in a session')", session_id=sid))
        sessions_open = value(scrape(api), "ptc_sessions")
        assert api.delete(f"/sessions/{sid}").status_code == 200
        assert api.post("/execute", json={"script": 5}).status_code == 422
        assert api.get("/jobs/job_nope").status_code == 404
        too_big = b"x" * (9 * 1024 * 1024)  # refused before any route runs: still counted under its route
        assert api.post("/execute", content=too_big, headers={"content-type": "application/json"}).status_code == 413
        after = scrape(api)

    assert [v["status"] for v in views] == ["succeeded", "succeeded", "failed", "timed_out", "succeeded", "succeeded"]
    assert [v["sandbox_start"] for v in views] == ["warm", "cold", "cold", "cold", "cold", "session"]
    assert sessions_open == 1 and value(after, "ptc_sessions") == 0
    assert views[1]["stdout"] == "invalid_arguments\nhttp_error\nunknown_tool\n", views[1]
    assert views[4]["stdout_truncated"]

    counters = {
        (name, labels): after[name, labels] - before.get((name, labels), 0.0)
        for name, labels in after
        if name.endswith("_total")
        and name not in CLOCK_COUNTERS
        and after[name, labels] != before.get((name, labels), 0.0)
    }
    expected = {
        ("ptc_executions_total", (("status", "succeeded"),)): 4,
        ("ptc_executions_total", (("status", "failed"),)): 1,
        ("ptc_executions_total", (("status", "timed_out"),)): 1,
        ("ptc_timeouts_total", ()): 1,
        ("ptc_output_truncated_total", (("stream", "stdout"),)): 1,
        ("ptc_tool_calls_total", (("status", "ok"), ("tool", "lookup"))): 3,
        ("ptc_tool_calls_total", (("status", "rejected"), ("tool", "lookup"))): 1,
        ("ptc_tool_calls_total", (("status", "error"), ("tool", "broken"))): 1,
        ("ptc_tool_calls_total", (("status", "rejected"), ("tool", "other"))): 1,
        ("ptc_http_requests_total", (("method", "POST"), ("route", "/execute"), ("status", "200"))): 6,
        ("ptc_http_requests_total", (("method", "POST"), ("route", "/sessions"), ("status", "201"))): 1,
        ("ptc_http_requests_total", (("method", "DELETE"), ("route", "/sessions/{session_id}"), ("status", "200"))): 1,
        ("ptc_http_requests_total", (("method", "POST"), ("route", "/execute"), ("status", "422"))): 1,
        ("ptc_http_requests_total", (("method", "GET"), ("route", "/jobs/{job_id}"), ("status", "404"))): 1,
        ("ptc_http_requests_total", (("method", "POST"), ("route", "/execute"), ("status", "413"))): 1,
        ("ptc_http_requests_total", (("method", "GET"), ("route", "/metrics"), ("status", "200"))): 2,  # `before`, mid
    }
    assert {(name, tuple(sorted(labels))): delta for (name, labels), delta in counters.items()} == expected

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("ptc_execution_duration_seconds_count") == 6  # every job, in both histograms
    assert grew("ptc_queue_wait_seconds_count") == 6
    assert grew("ptc_execution_duration_seconds_sum") >= 1.0  # the timed-out job alone ran 1 s
    assert grew("ptc_sandbox_start_seconds_count", mode="warm") == 1
    assert grew("ptc_sandbox_start_seconds_count", mode="cold") == 4
    assert grew("ptc_sandbox_start_seconds_count", mode="session") == 1
    assert grew("ptc_tool_call_duration_seconds_count", tool="lookup") == 4
    assert grew("ptc_tool_call_duration_seconds_count", tool="broken") == 1
    assert grew("ptc_tool_call_duration_seconds_count", tool="other") == 1
    for status in ("queued", "running", "waiting"):
        assert value(after, "ptc_jobs", status=status) == 0
    assert value(after, "ptc_oom_kills_total") == 0

    job_ids = {v["job_id"] for v in views}
    call_ids = {c["call_id"] for v in views for c in v["calls"]}
    label_values = {v for _, labels in after for _, v in labels}
    assert not label_values & (job_ids | call_ids | {sid})
    assert not [v for v in label_values if v.startswith(("job_", "call_", "ses_"))]
