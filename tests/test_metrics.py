"""Metrics: the helpers of ``service.metrics`` alone, and ``GET /metrics`` of a real service after a fixed mix."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import docker
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import Metrics, buckets_up_to, callback_outcome
from service.settings import Settings
from tests.conftest import Service, execute, start_service, wait_until
from tests.toolserver import ToolServer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
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


def parse(text: str) -> Samples:
    """Every sample of a scrape: ``(name, labels) -> value``."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(api: httpx.Client) -> Samples:
    response = api.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


# -- the helpers, without a service ---------------------------------------------------------------


def settings(**overrides: Any) -> Settings:
    return Settings(work_dir=Path("/nonexistent"), **overrides)


def test_tool_labels_are_capped_and_unknown_tools_count_as_other() -> None:
    metrics = Metrics(settings(metrics_max_tools=2))
    for tool in ("a", "b", "c", "a", "d"):
        metrics.tool_call({"tool": tool, "status": "ok", "duration_ms": 1.0})
    metrics.tool_call({"tool": "made_up", "status": "rejected", "error": {"type": "unknown_tool", "message": ""}})
    samples = parse(metrics.exposition().decode())
    assert value(samples, "ptc_tool_calls_total", tool="a", status="ok") == 2
    assert value(samples, "ptc_tool_calls_total", tool="b", status="ok") == 1
    assert value(samples, "ptc_tool_calls_total", tool="other", status="ok") == 2  # c and d, past the cap
    assert value(samples, "ptc_tool_calls_total", tool="other", status="rejected") == 1
    assert value(samples, "ptc_tool_call_duration_seconds_count", tool="other") == 3
    tools = {dict(labels).get("tool") for name, labels in samples if name == "ptc_tool_calls_total"}
    assert tools == {"a", "b", "other"}


def test_job_histograms_reach_the_maximum_timeout() -> None:
    samples = parse(Metrics(settings(max_timeout_s=120, default_timeout_s=60)).exposition().decode())
    for name in ("ptc_execution_duration_seconds_bucket", "ptc_queue_wait_seconds_bucket"):
        bounds = [dict(labels)["le"] for n, labels in samples if n == name]
        assert bounds[-2:] == ["120.0", "+Inf"]
    assert buckets_up_to(7, (1, 5, 10)) == (1, 5, 7.0)


def test_callback_outcomes() -> None:
    assert callback_outcome({"status_code": 204, "error": None}) == "delivered"
    assert callback_outcome({"status_code": 500, "error": "HTTP 500"}) == "http_error"
    assert callback_outcome({"status_code": None, "error": "no answer within 10 s"}) == "timeout"
    assert callback_outcome({"status_code": None, "error": "ConnectError"}) == "unreachable"


def test_ended_jobs_count_oom_kills_timeouts_truncations_and_callbacks() -> None:
    metrics = Metrics(settings())
    created = datetime(2026, 1, 1, tzinfo=UTC)

    def ended(status: str, stdout_bytes: int, started: bool = True) -> Any:
        streams = {
            name: SimpleNamespace(inline=SimpleNamespace(total_bytes=n))
            for name, n in (("stdout", stdout_bytes), ("stderr", 0))
        }
        return SimpleNamespace(
            status=status,
            created_at=created,
            started_at=created + timedelta(seconds=1) if started else None,
            ended_at=created + timedelta(seconds=3),
            limits=SimpleNamespace(output_bytes=1024),
            **streams,
        )

    metrics.job_ended(ended("oom_killed", 10))
    metrics.job_ended(ended("timed_out", 5000))
    metrics.job_ended(ended("stopped", 0, started=False))  # stopped while queued: waited 3 s, ran 0 s
    metrics.job_lost()
    metrics.callback_attempt({"status_code": 503, "error": "HTTP 503"})
    metrics.callback_attempt({"status_code": 200, "error": None})
    metrics.callback_done(True)
    samples = parse(metrics.exposition().decode())
    assert value(samples, "ptc_oom_kills_total") == 1 and value(samples, "ptc_timeouts_total") == 1
    assert value(samples, "ptc_output_truncated_total", stream="stdout") == 1
    assert value(samples, "ptc_output_truncated_total", stream="stderr") == 0
    assert value(samples, "ptc_executions_total", status="lost") == 1
    assert value(samples, "ptc_execution_duration_seconds_count") == 3
    assert value(samples, "ptc_execution_duration_seconds_sum") == 4  # 2 + 2 + 0
    assert value(samples, "ptc_queue_wait_seconds_sum") == 5  # 1 + 1 + 3
    assert value(samples, "ptc_callback_deliveries_total", outcome="http_error") == 1
    assert value(samples, "ptc_callback_deliveries_total", outcome="delivered") == 1
    assert value(samples, "ptc_callbacks_total", state="delivered") == 1


def test_job_gauge_counts_live_jobs_by_status_and_sessions_are_set() -> None:
    @dataclass
    class FakeJob:
        status: str

    metrics = Metrics(settings())
    metrics.track_jobs({"1": FakeJob("queued"), "2": FakeJob("queued"), "3": FakeJob("running")})
    metrics.track_pools(lambda: {"default": 3})
    metrics.set_sessions(5)
    samples = parse(metrics.exposition().decode())
    assert value(samples, "ptc_jobs", status="queued") == 2
    assert value(samples, "ptc_jobs", status="running") == 1
    assert ("ptc_jobs", frozenset({("status", "waiting")})) in samples  # zero, but present
    assert value(samples, "ptc_sandbox_pool_size", profile="default") == 3
    assert value(samples, "ptc_sessions") == 5


# -- a real service -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metered(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service of its own (its counters are this test's alone), with one warm pool (the default profile's) of one."""
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}", scratch / "metrics", PTC_WARM_POOL_SIZE="1", PTC_WARM_POOL_MAX_PROFILES="1"
    )
    yield svc
    svc.stop()


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
        if name.endswith("_total") and after[name, labels] != before.get((name, labels), 0.0)
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
