"""OpenTelemetry traces of the real service (a ``ptc-sandbox serve`` process, a real sandbox, a real HTTP tool
server), exported over OTLP/HTTP to a tiny collector in this test that decodes the protobuf: the tree of one
``POST /execute`` with two tool calls under an incoming ``traceparent``, the ``traceparent`` the tool endpoint
received, and a job that still answers normally once the collector is gone."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import docker
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import execute, start_service, stop_clean, wait_until
from tests.toolserver import ToolServer

INCOMING_TRACE = "0af7651916cd43dd8448eb211c80319c"
INCOMING_PARENT = "b7ad6b7169203331"
SCRIPT = "import tools\nprint(tools.triangle_area(base=2, height=3))\nprint(tools.circumference(radius=1))\n"


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1 (``POST /v1/traces``, protobuf): ``spans`` keeps every span
    received as a dict (name, trace id, span id, parent span id, attributes, resource's service.name)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            collector.spans.append(
                                {
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "span_id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(),
                                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                                    "service": service.get("service.name"),
                                }
                            )
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop receiving (idempotent): the port then refuses connections."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


@pytest.fixture
def collector() -> Iterator[Collector]:
    receiver = Collector()
    yield receiver
    receiver.stop()


def test_a_real_jobs_trace_reaches_an_otlp_collector_and_the_endpoint_gets_the_calls_traceparent(
    engine: docker.DockerClient, scratch: Path, tool_server: ToolServer, collector: Collector
) -> None:
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / "otel",
        PTC_WARM_POOL_SIZE="0",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=collector.url,
        OTEL_EXPORTER_OTLP_TIMEOUT="2",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    try:
        anything = {"type": "object", "additionalProperties": True}
        tools = [
            {"name": name, "parameters": anything, "endpoint": {"kind": "http", "url": tool_server.url(name)}}
            for name in ("triangle_area", "circumference")
        ]
        with svc.client() as api:
            api.headers["traceparent"] = f"00-{INCOMING_TRACE}-{INCOMING_PARENT}-01"
            seen = len(tool_server.headers)
            view = execute(api, SCRIPT, tools)
            assert view["status"] == "succeeded", view
            assert view["trace_id"] == INCOMING_TRACE
            wait_until(lambda: sum(s["name"] == "job" for s in collector.spans) == 1, 20)
            wait_until(lambda: any(s["name"] == "POST /execute" for s in collector.spans), 20)
            spans = [s for s in collector.spans if s["trace_id"] == INCOMING_TRACE]
            by_id = {s["span_id"]: s for s in spans}
            (request,) = [s for s in spans if s["name"] == "POST /execute"]
            (job,) = [s for s in spans if s["name"] == "job"]
            calls = [s for s in spans if s["name"] == "tool call"]
            calls.sort(key=lambda s: int(s["attributes"]["ptc.tool.seq"]))
            assert request["parent"] == INCOMING_PARENT
            assert request["service"] == "ptc-sandbox"
            assert job["parent"] == request["span_id"]
            assert job["attributes"]["ptc.job.id"] == view["job_id"]
            assert job["attributes"]["ptc.job.status"] == "succeeded"
            children = sorted(s["name"] for s in spans if s["parent"] == job["span_id"])
            assert children == ["queue wait", "sandbox start", "tool call", "tool call"]
            (start,) = [s for s in spans if s["name"] == "sandbox start"]
            assert start["attributes"]["ptc.sandbox.start"] == "cold"
            assert [(c["attributes"]["ptc.tool.name"], c["attributes"]["ptc.tool.status"]) for c in calls] == [
                ("triangle_area", "ok"),
                ("circumference", "ok"),
            ]
            # The endpoint's traceparent names the call's span, or the httpx span made under it.
            for call, headers in zip(calls, tool_server.headers[seen:], strict=True):
                received = {k.lower(): v for k, v in headers.items()}["traceparent"]
                _, trace_id, parent, _ = received.split("-")
                assert trace_id == INCOMING_TRACE
                assert parent == call["span_id"] or by_id[parent]["parent"] == call["span_id"]
            for span in spans:  # no argument or result in any attribute
                assert not {"3.0", "6.283185307179586"} & {str(v) for v in span["attributes"].values()}

            # The collector gone: jobs answer as before (spans are dropped, never waited for).
            collector.stop()
            del api.headers["traceparent"]
            again = execute(api, SCRIPT, tools)
            assert again["status"] == "succeeded", again
            assert again["stdout"] == view["stdout"]
            assert len(again["trace_id"]) == 32 and again["trace_id"] != INCOMING_TRACE
    finally:
        stop_clean(engine, svc)


def test_the_spans_still_queued_are_exported_when_the_service_stops(
    engine: docker.DockerClient, scratch: Path, collector: Collector
) -> None:
    # The batch processor's default delay is 5 s; the service stops well before it (uvicorn ends the process by
    # re-raising SIGTERM, so the SDK's exit hook never runs: the lifespan flushes).
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / "otel-stop",
        PTC_WARM_POOL_SIZE="0",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=collector.url,
        OTEL_BSP_SCHEDULE_DELAY="60000",
    )
    try:
        with svc.client() as api:
            view = execute(api, "print(1)")
        assert not collector.spans
    finally:
        stop_clean(engine, svc)
    names = sorted(s["name"] for s in collector.spans if s["trace_id"] == view["trace_id"])
    assert names == ["POST /execute", "job", "queue wait", "sandbox start"]
