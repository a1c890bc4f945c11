"""Metrics: the helpers of ``observability.metrics`` alone, and ``GET /metrics`` of a real service after a fixed mix."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from service.jobs.model import JobStatus
from service.observability.metrics import Metrics, buckets_up_to, callback_outcome
from service.settings import Settings

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape: ``(name, labels) -> value``."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


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

    def ended(status: str, stdout_bytes: int, started: bool = True, resumed: str | None = None) -> Any:
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
            resumes=[{"reason": resumed}] if resumed else [],
            diverged=object() if status == "failed" and resumed else None,
            **streams,
        )

    metrics.job_ended(ended("oom_killed", 10))
    metrics.job_ended(ended("timed_out", 5000))
    metrics.job_ended(ended("stopped", 0, started=False))  # stopped while queued: waited 3 s, ran 0 s
    metrics.job_ended(ended("succeeded", 0, resumed="drained"))
    metrics.job_ended(ended("failed", 0, resumed="service_restarted"))  # its replay diverged
    metrics.ended_from_store(JobStatus.LOST)
    metrics.ended_from_store(JobStatus.STOPPED)  # a parked job stopped
    metrics.callback_attempt({"status_code": 503, "error": "HTTP 503"})
    metrics.callback_attempt({"status_code": 200, "error": None})
    metrics.callback_done(True)
    samples = parse(metrics.exposition().decode())
    assert value(samples, "ptc_oom_kills_total") == 1 and value(samples, "ptc_timeouts_total") == 1
    assert value(samples, "ptc_output_truncated_total", stream="stdout") == 1
    assert value(samples, "ptc_output_truncated_total", stream="stderr") == 0
    assert value(samples, "ptc_executions_total", status="lost") == 1
    assert value(samples, "ptc_executions_total", status="stopped") == 2  # one while queued, one parked
    assert value(samples, "ptc_execution_duration_seconds_count") == 5
    assert value(samples, "ptc_execution_duration_seconds_sum") == 8  # 2 + 2 + 0 + 2 + 2
    assert value(samples, "ptc_queue_wait_seconds_sum") == 7  # 1 + 1 + 3 + 1 + 1
    assert value(samples, "ptc_job_resumes_total", reason="drained", outcome="succeeded") == 1
    assert value(samples, "ptc_job_resumes_total", reason="service_restarted", outcome="replay_diverged") == 1
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
