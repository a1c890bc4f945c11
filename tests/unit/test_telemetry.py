"""OpenTelemetry traces (observability.telemetry), engine-free: the whole service on the fake backend traced into an
in-memory exporter: the tree of one ``POST /execute`` with two tool calls, an incoming ``traceparent`` as its
parent, the ``traceparent`` an http tool endpoint and a callback receive, the trace id in the job view (kept once
saved) and in the JSON logs, a malformed ``traceparent`` ignored, nothing of arguments or results in a span, and
which ``OTEL_*`` variables switch tracing on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.api import create_app
from service.observability import logs, telemetry
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.tenancy import hash_token
from tests.toolserver import ToolServer

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
INCOMING_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
INCOMING = f"00-{INCOMING_TRACE}-00f067aa0ba902b7-01"
SECRET_ARG = "s3cr3t-argument-7f1c"
SCRIPT = (
    "import tools\n"
    f"print(tools.triangle_area(base=2, height=3, note={SECRET_ARG!r}))\n"
    "print(tools.circumference(radius=1))\n"
)


def http_tools(server: ToolServer) -> list[dict[str, Any]]:
    """The two http tools of ``SCRIPT`` on the tool server."""
    anything = {"type": "object", "additionalProperties": True}
    return [
        {"name": name, "parameters": anything, "endpoint": {"kind": "http", "url": server.url(name)}}
        for name in ("triangle_area", "circumference")
    ]


@pytest.fixture
def tool_server() -> Iterator[ToolServer]:
    server = ToolServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into an in-memory exporter, for the apps built in the test; off again after it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    try:
        yield exporter
    finally:
        telemetry.install(None)
        provider.shutdown()


@contextlib.asynccontextmanager
async def service(work_dir: Path | None = None, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The service on a ``FakeBackend``, the key alice its one key (the client sends it); on ``work_dir`` (kept)
    or a new one (removed after)."""
    keep = work_dir is not None
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="ptco", dir="/tmp"))
    overrides.setdefault("api_keys", f"alice:{hash_token(ALICE)}")
    settings = Settings(
        work_dir=work_dir,
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
        **overrides,
    )
    app = create_app(settings, FakeBackend())
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://fake", timeout=60, headers={"authorization": f"Bearer {ALICE}"}
            ) as client:
                yield client
    finally:
        if not keep:
            shutil.rmtree(work_dir, ignore_errors=True)


def by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def traceparent_ids(header: str) -> tuple[str, int]:
    """(trace id, parent span id) of a W3C ``traceparent``."""
    version, trace_id, parent, flags = header.split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return trace_id, int(parent, 16)


async def test_one_execute_with_two_tool_calls_makes_the_expected_tree(
    spans: InMemorySpanExporter, tool_server: ToolServer
) -> None:
    async with service() as client:
        view = (await client.post("/execute", json={"script": SCRIPT, "tools": http_tools(tool_server)})).json()
    assert view["status"] == "succeeded", view
    assert [c["status"] for c in view["calls"]] == ["ok", "ok"]
    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.name == "POST /execute"]
    (job,) = by_name(finished, "job")
    (queue,) = by_name(finished, "queue wait")
    (start,) = by_name(finished, "sandbox start")
    calls = sorted(by_name(finished, "tool call"), key=lambda s: int(str((s.attributes or {})["ptc.tool.seq"])))
    assert request.parent is None  # no traceparent came: a new trace
    assert parent_id(job) == span_id(request)
    assert parent_id(queue) == parent_id(start) == span_id(job)
    assert [parent_id(call) for call in calls] == [span_id(job)] * 2
    assert len({hex_trace(s) for s in finished}) == 1
    assert view["trace_id"] == hex_trace(job)
    assert dict(job.attributes or {}) == {
        "ptc.job.id": view["job_id"],
        "ptc.image": "default",
        "ptc.job.status": "succeeded",
    }
    assert (start.attributes or {})["ptc.sandbox.start"] == "cold"
    for call, record in zip(calls, view["calls"], strict=True):
        attributes = dict(call.attributes or {})
        assert attributes["ptc.tool.duration_ms"] == record["duration_ms"]
        del attributes["ptc.tool.duration_ms"]
        assert attributes == {
            "ptc.tool.name": record["tool"],
            "ptc.tool.call_id": record["call_id"],
            "ptc.tool.seq": record["seq"],
            "ptc.tool.status": "ok",
        }
    # Each http request the endpoint received names its tool call's span, or the httpx span made under it.
    children = {parent_id(s): s for s in finished if s.name == "POST" and parent_id(s) in {span_id(c) for c in calls}}
    for call, headers in zip(calls, tool_server.headers, strict=True):
        received = {k.lower(): v for k, v in headers.items()}["traceparent"]
        trace_id, parent = traceparent_ids(received)
        assert trace_id == hex_trace(call)
        assert parent == span_id(call) or parent == span_id(children[span_id(call)])
    # Never an argument or a result in any span: no text holds one (the results are 3.0 and 6.283...), and the only
    # numbers are counts, sizes, ports, statuses and durations (a duration may well read 3.0 or 6.28).
    assert SECRET_ARG not in "".join(s.to_json() for s in finished)
    for s in finished:
        for name, value in (s.attributes or {}).items():
            if isinstance(value, str):
                assert "3.0" not in value and "6.28" not in value, (s.name, name, value)
            elif isinstance(value, float):
                assert name == "ptc.tool.duration_ms", (s.name, name, value)


async def test_a_sessions_scripts_are_jobs_of_their_requests_traces(spans: InMemorySpanExporter) -> None:
    async with service() as client:
        created = await client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        views = [
            (await client.post("/execute", json={"script": f"print({i})", "session_id": session_id})).json()
            for i in range(2)
        ]
    finished = spans.get_finished_spans()
    requests = [s for s in finished if s.name == "POST /execute"]
    jobs = by_name(finished, "job")
    assert [view["status"] for view in views] == ["succeeded"] * 2
    assert [view["trace_id"] for view in views] == [hex_trace(job) for job in jobs]
    assert len(set(hex_trace(job) for job in jobs)) == 2  # one trace per request
    assert [parent_id(job) for job in jobs] == [span_id(request) for request in requests]
    for job in jobs:
        assert (job.attributes or {})["ptc.session.id"] == session_id
    assert [(s.attributes or {})["ptc.sandbox.start"] for s in by_name(finished, "sandbox start")] == ["session"] * 2


async def test_a_traceparent_of_another_tenants_trace_shows_nothing_of_its_job(spans: InMemorySpanExporter) -> None:
    async with service(api_keys=f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)}") as client:
        alice = (await client.post("/execute", json={"script": "print(1)"})).json()
        header = f"00-{alice['trace_id']}-00f067aa0ba902b7-01"
        as_bob = {"authorization": f"Bearer {BOB}", "traceparent": header}
        bob = (await client.post("/execute", json={"script": "print(2)"}, headers=as_bob)).json()
        assert bob["trace_id"] == alice["trace_id"]  # bob's own job joins that trace, no more
        assert (await client.get(f"/jobs/{alice['job_id']}", headers=as_bob)).status_code == 404
        listed = (await client.get("/jobs", headers=as_bob)).json()
        assert [job["job_id"] for job in listed["jobs"]] == [bob["job_id"]]


async def test_no_query_of_an_endpoints_url_is_in_a_span(spans: InMemorySpanExporter, tool_server: ToolServer) -> None:
    tools = [
        {"name": "t", "parameters": {}, "endpoint": {"kind": "http", "url": tool_server.url("echo") + "?k=qsecret"}}
    ]
    async with service() as client:
        view = (await client.post("/execute", json={"script": "import tools\ntools.t()", "tools": tools})).json()
    assert len(view["calls"]) == 1, view
    (post,) = [s for s in spans.get_finished_spans() if s.name == "POST"]
    assert (post.attributes or {})["http.url"] == tool_server.url("echo")
    assert "qsecret" not in "".join(s.to_json() for s in spans.get_finished_spans())


async def test_an_incoming_traceparent_is_the_parent(spans: InMemorySpanExporter, tool_server: ToolServer) -> None:
    body = {"script": SCRIPT, "tools": http_tools(tool_server)}
    work_dir = Path(tempfile.mkdtemp(prefix="ptco", dir="/tmp"))
    try:
        async with service(work_dir) as client:
            view = (await client.post("/execute", json=body, headers={"traceparent": INCOMING})).json()
        async with service(work_dir) as client:  # saved with the job: the store's view, after a restart
            stored = (await client.get(f"/jobs/{view['job_id']}", params={"fields": "trace_id"})).json()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    assert stored["trace_id"] == INCOMING_TRACE
    assert view["trace_id"] == INCOMING_TRACE
    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.name == "POST /execute"]
    assert parent_id(request) == 0x00F067AA0BA902B7
    assert {hex_trace(s) for s in finished if not s.name.startswith("GET")} == {INCOMING_TRACE}
    for headers in tool_server.headers:
        received = {k.lower(): v for k, v in headers.items()}["traceparent"]
        assert traceparent_ids(received)[0] == INCOMING_TRACE


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id: invalid
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent: invalid
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff: forbidden
        "00-" + "g" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "x" * 5000,
    ],
)
async def test_a_malformed_traceparent_is_ignored(spans: InMemorySpanExporter, header: str) -> None:
    async with service() as client:
        answer = await client.post("/execute", json={"script": "print(1)"}, headers={"traceparent": header})
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert view["status"] == "succeeded"
    (request,) = [s for s in spans.get_finished_spans() if s.name == "POST /execute"]
    assert request.parent is None  # a new trace of its own
    assert view["trace_id"] == hex_trace(request) != INCOMING_TRACE


async def test_a_callback_carries_the_jobs_traceparent(
    spans: InMemorySpanExporter, tool_server: ToolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    async with service(callback_secret=secret, callback_backoff_s=0.01) as client:
        body = {"script": "print(1)", "callback_url": tool_server.url("echo"), "wait_s": 0}
        job_id = (await client.post("/execute", json=body)).json()["job_id"]
        view = (await client.post(f"/jobs/{job_id}/wait", params={"timeout_s": 10})).json()
        assert view["status"] == "succeeded", view
        for _ in range(200):
            if (await client.get(f"/jobs/{job_id}")).json()["callback"]["state"] == "delivered":
                break
            await asyncio.sleep(0.05)
    (job,) = by_name(spans.get_finished_spans(), "job")
    received = {k.lower(): v for k, v in tool_server.headers[-1].items()}["traceparent"]
    assert traceparent_ids(received) == (view["trace_id"], span_id(job))


async def test_the_trace_id_is_in_the_json_logs_of_a_traced_job(
    spans: InMemorySpanExporter, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("info", "json")
    try:
        async with service() as client:
            answer = await client.post("/execute", json={"script": "print(1)"}, headers={"traceparent": INCOMING})
            view = answer.json()
    finally:
        logging.getLogger().handlers.clear()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    job_events = [line for line in lines if line["event"] == "job" and line["job_id"] == view["job_id"]]
    assert job_events and {line["trace_id"] for line in job_events} == {INCOMING_TRACE}
    (request,) = [line for line in lines if line["event"] == "request" and line["route"] == "/execute"]
    assert request["trace_id"] == INCOMING_TRACE


async def test_tracing_off_makes_no_spans_and_no_trace_id() -> None:
    assert not telemetry.enabled()
    async with service() as client:
        view = (await client.post("/execute", json={"script": "print(1)"}, headers={"traceparent": INCOMING})).json()
    assert view["status"] == "succeeded"
    assert view["trace_id"] is None


@pytest.mark.parametrize(
    ("environ", "names"),
    [
        ({}, []),
        ({"OTEL_SERVICE_NAME": "x"}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "OTLP, console"}, ["otlp", "console"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, []),
    ],
)
def test_which_variables_switch_tracing_on(environ: dict[str, str], names: list[str]) -> None:
    assert telemetry.exporter_names(environ) == names


def test_the_default_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert telemetry.resource().attributes["service.name"] == "ptc-sandbox"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sandboxes-eu")
    assert telemetry.resource().attributes["service.name"] == "sandboxes-eu"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes")
    assert telemetry.resource().attributes["service.name"] == "from-attributes"


def test_configure_from_env_installs_the_named_exporters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry.configure_from_env() is False and not telemetry.enabled()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")  # not shipped: logged, nothing installed
    assert telemetry.configure_from_env() is False and not telemetry.enabled()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    try:
        assert telemetry.configure_from_env() is True and telemetry.enabled()
        provider = telemetry._provider
        assert telemetry.configure_from_env() is True and telemetry._provider is provider  # once per process
    finally:
        if telemetry._provider is not None:
            telemetry._provider.shutdown()
        telemetry.install(None)


def test_the_flush_at_shutdown_is_bounded_with_a_hung_collector() -> None:
    """A collector that accepts and never answers cannot hold up the service's stop: ``flush`` returns (False) after
    its timeout, though the SDK's ``force_flush`` ignores its own and waits for the exporter."""
    release = threading.Event()

    class Hung(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            release.wait()
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Hung(), schedule_delay_millis=60_000))
    telemetry.install(provider)
    flushed: list[bool] = []
    try:
        tracer = provider.get_tracer("test")
        for _ in range(10):
            tracer.start_span("s").end()
        flushing = threading.Thread(target=lambda: flushed.append(telemetry.flush(0.2)), daemon=True)
        flushing.start()
        flushing.join(30)  # far longer than the 0.2 s asked for: only a flush that never returns fails
        assert not flushing.is_alive()
        assert flushed == [False]
    finally:
        release.set()
        telemetry.install(None)
        provider.shutdown()


async def test_captured_headers_of_a_tool_request_are_redacted(
    spans: InMemorySpanExporter, tool_server: ToolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator who captures client headers (the instrumentation's own variables) gets their names, never their
    values: a manifest's endpoint headers are the tenant's and any of them may be a credential, and so may a header
    the endpoint answers with."""
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_REQUEST", ".*")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_RESPONSE", ".*")
    headers = {"Authorization": "Bearer hsecret-1", "X-Vendor-Token": "hsecret-2"}
    endpoint = {"kind": "http", "url": tool_server.url("echo"), "headers": headers}
    tools = [{"name": "t", "parameters": {}, "endpoint": endpoint}]
    async with service() as client:
        view = (await client.post("/execute", json={"script": "import tools\ntools.t()", "tools": tools})).json()
    assert len(view["calls"]) == 1, view
    (post,) = [s for s in spans.get_finished_spans() if s.name == "POST"]
    captured = {k: v for k, v in (post.attributes or {}).items() if ".header." in k}
    assert captured["http.request.header.x_vendor_token"] == ("[REDACTED]",)
    assert captured["http.response.header.content_type"] == ("[REDACTED]",)
    assert "hsecret" not in "".join(s.to_json() for s in spans.get_finished_spans())


async def test_only_the_probes_and_scrapes_go_untraced(spans: InMemorySpanExporter) -> None:
    """``/healthz``, ``/readyz`` and ``/metrics`` make no span, and nothing else does not: the instrumentation matches
    its exclusions anywhere in ``scheme://<Host header><path>``, so a caller's ``Host`` header, or a file named
    ``metrics``, would take a request out of the operator's traces."""
    async with service(metrics_auth="open") as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        answer = await client.post("/execute", json={"script": "print(1)"}, headers={"host": "fake/healthz"})
        assert answer.status_code == 200, answer.text
        session = (await client.post("/sessions", json={})).json()["session_id"]
        assert (await client.put(f"/sessions/{session}/files/metrics", content=b"x")).status_code == 200
        await client.delete(f"/sessions/{session}")
    names = {s.name for s in spans.get_finished_spans()}
    assert {"POST /execute", "PUT /sessions/{session_id}/files/{path:path}"} <= names
    assert not any(name.startswith(("GET /healthz", "GET /metrics")) for name in names)
