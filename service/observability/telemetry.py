"""OpenTelemetry traces of the service: off by default, switched on by the standard ``OTEL_*`` variables.

This module owns the tracer (``configure_from_env`` for the service, ``install`` for tests) and the span helpers
the rest of the service calls. Every helper is a no-op that makes no object when tracing is off (``enabled()``
false): the request path then costs one ``None`` check per helper.

The trace of one ``POST /execute`` (docs/telemetry.md)::

    POST /execute                       (FastAPI instrumentation; its parent: the request's W3C traceparent)
    └── job                             ptc.job.id, ptc.session.id, ptc.image, ptc.job.status
        ├── queue wait                  admission until the job has its sandbox (or slot, or session turn)
        ├── sandbox start               ptc.sandbox.start: warm | cold | session
        └── tool call (one per call)    ptc.tool.name, ptc.tool.call_id, ptc.tool.seq, ptc.tool.status,
            └── POST (http endpoints)       ptc.tool.duration_ms, ptc.tool.error_type (never args or results)

An ``http`` endpoint receives a ``traceparent`` naming the tool call's ``POST`` span (httpx instrumentation, a
child of the tool call span); a completion callback one naming the job span. Spans are exported by a
``BatchSpanProcessor``: a slow or unreachable collector never delays a job (spans are dropped when its queue is
full).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_SDK_DISABLED,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, Status, StatusCode

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "ptc-sandbox"
TRACER_NAME = "ptc-sandbox"
# Not traced: probes and scrapes, a span each every few seconds. The instrumentation searches these regular expressions
# in ``scheme://<Host header><path>``: anchored, so that neither a caller's Host header nor a path that merely
# contains one (a session file named ``metrics``) takes a request out of the traces.
QUIET_URLS = ",".join(f"^[a-z]+://[^/]*/{name}$" for name in ("healthz", "readyz", "metrics"))
# Redacted should an operator capture request headers (OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST).
SECRET_HEADERS = ["authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key"]
REDACTED = "[REDACTED]"
FLUSH_S = 5.0  # at shutdown, the longest wait for the spans still queued to be exported
ERROR_STATUSES = frozenset({"failed", "timed_out", "lost", "oom_killed"})


def _otlp() -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: its own OTEL_EXPORTER_OTLP_* reading


def _console() -> SpanExporter:
    return ConsoleSpanExporter(out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + os.linesep)


# OTEL_TRACES_EXPORTER's names (the SDK's entry-point names for the exporters this service ships).
EXPORTERS: dict[str, Callable[[], SpanExporter]] = {"otlp": _otlp, "otlp_proto_http": _otlp, "console": _console}

_NOTHING = contextlib.nullcontext()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def exporter_names(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters ``environ`` asks for: none unless ``OTEL_TRACES_EXPORTER`` names some (``none`` is none), or
    an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set (then
    ``otlp``); ``OTEL_SDK_DISABLED=true`` wins over both. Names are lower-cased, in their order."""
    if environ.get(OTEL_SDK_DISABLED, "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in environ.get(OTEL_TRACES_EXPORTER, "").split(",") if name.strip()]
    if not names and (environ.get(OTEL_EXPORTER_OTLP_ENDPOINT) or environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)):
        names = ["otlp"]
    return [] if "none" in names else names


def resource() -> Resource:
    """The service's resource: ``Resource.create`` (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``), with
    ``service.name`` ``ptc-sandbox`` when neither names the service."""
    detected = Resource.create()
    name = detected.attributes.get(SERVICE_NAME)
    if not isinstance(name, str) or name.startswith("unknown_service"):
        return detected.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return detected


def configure_from_env() -> bool:
    """Install a tracer provider as the ``OTEL_*`` variables say (``exporter_names``), once per process; returns
    whether tracing is on. The provider's sampler comes from ``OTEL_TRACES_SAMPLER``, its batching from
    ``OTEL_BSP_*``; it is flushed and shut down at exit. An exporter name this service does not ship is logged and
    skipped."""
    if _provider is not None:
        return True
    exporters: list[SpanExporter] = []
    for name in exporter_names():
        make = EXPORTERS.get(name)
        if make is None:
            log.error("OTEL_TRACES_EXPORTER: unknown exporter %r ignored (known: %s)", name, ", ".join(EXPORTERS))
            continue
        exporters.append(make())
    if not exporters:
        return False
    provider = TracerProvider(resource=resource())
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("OpenTelemetry traces on: exporter(s) %s", ", ".join(exporter_names()))
    return True


def install(provider: TracerProvider | None) -> None:
    """Trace into ``provider`` (tests: one with an in-memory exporter); None: tracing off. Apps built after this
    call are instrumented (``instrument_app``); the global propagator (W3C trace context) is the API's own."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None


def flush(timeout_s: float = FLUSH_S) -> bool:
    """Export the spans still queued, waiting at most ``timeout_s`` (blocking: call it off the event loop); whether
    they were exported in that time. The service calls it when it stops: uvicorn ends the process by re-raising
    SIGTERM, so the SDK's exit hook does not run.

    The SDK's ``force_flush`` ignores its timeout (it exports every queued batch in the calling thread, each
    bounded only by the exporter's own timeout, 10 s for OTLP, after the batch under way): it runs in a daemon
    thread of its own, left behind when ``timeout_s`` passes, so a hung collector cannot hold up the stop."""
    if _provider is None:
        return True
    provider = _provider
    done = threading.Event()

    def export() -> None:
        try:
            provider.force_flush(int(timeout_s * 1000))
        finally:
            done.set()

    threading.Thread(target=export, name="otel-flush", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("traces: the spans still queued were not exported within %g s (collector slow or down)", timeout_s)
        return False
    return True


def enabled() -> bool:
    """Whether tracing is on."""
    return _tracer is not None


def instrument_app(app: Any) -> None:
    """A span per HTTP request of ``app`` (a FastAPI app), its parent the request's ``traceparent``; not for
    ``QUIET_URLS``; no spans per ASGI message; bodies are never recorded. No-op when tracing is off."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=_provider,
        excluded_urls=QUIET_URLS,
        exclude_spans=["receive", "send"],
        http_capture_headers_sanitize_fields=SECRET_HEADERS,
    )


def instrument_client(client: Any) -> None:
    """A span per request of ``client`` (an ``httpx.AsyncClient``) that sends its own ``traceparent``, a child of
    the current span; its URL attribute without the query (a tool's query may hold a key). No-op when tracing is
    off."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    HTTPXClientInstrumentor.instrument_client(
        client, tracer_provider=_provider, request_hook=_url_without_query, response_hook=_response_headers_redacted
    )


def _redact_headers(span: Span, prefix: str) -> None:
    """Replace the value of each captured header attribute (``prefix`` + name) by ``[REDACTED]``: should an operator
    capture client headers (``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_*``), a tool request's headers are
    its manifest's (the tenant's, any of them a credential) and its answer's may be too; the names stay."""
    attributes = getattr(span, "attributes", None) or {}  # an SDK span's
    for name in [name for name in attributes if name.startswith(prefix)]:
        span.set_attribute(name, [REDACTED])


async def _url_without_query(span: Span, request: Any) -> None:
    """httpx instrumentation's request hook: the span's URL attributes lose their query and fragment; captured
    request headers are redacted."""
    attributes = getattr(span, "attributes", None) or {}  # an SDK span's
    url = request.url
    plain = f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}{url.path}"
    for name in ("http.url", "url.full"):
        if name in attributes:
            span.set_attribute(name, plain)
    _redact_headers(span, "http.request.header.")


async def _response_headers_redacted(span: Span, request: Any, response: Any) -> None:
    """httpx instrumentation's response hook: captured response headers are redacted."""
    _redact_headers(span, "http.response.header.")


def _ns(at: datetime | None) -> int | None:
    return int(at.timestamp() * 1e9) if at is not None else None


def start_job(job_id: str, created_at: datetime, session_id: str | None, image: str) -> Span | None:
    """The span of a job from its admission (``created_at``), a child of the current span (the request's that
    submitted it); None when tracing is off. The caller keeps it on the job and ends it (``end_job``)."""
    if _tracer is None:
        return None
    attributes: dict[str, str] = {"ptc.job.id": job_id, "ptc.image": image}
    if session_id is not None:
        attributes["ptc.session.id"] = session_id
    return _tracer.start_span("job", start_time=_ns(created_at), attributes=attributes)


def end_job(span: Span | None, status: str, error_type: str | None) -> None:
    """End a job's span with its final ``status`` (an error status for failed, timed-out, lost and OOM-killed
    jobs, described by ``error_type`` only, never its message)."""
    if span is None:
        return
    span.set_attribute("ptc.job.status", status)
    if error_type is not None:
        span.set_attribute("ptc.job.error_type", error_type)
    if status in ERROR_STATUSES:
        span.set_status(Status(StatusCode.ERROR, error_type or status))
    span.end()


def interval(parent: Span | None, name: str, start: datetime, end: datetime, **attributes: str) -> None:
    """A finished child span of ``parent`` from ``start`` to ``end`` (``queue wait``, ``sandbox start``)."""
    if _tracer is None or parent is None:
        return
    context = trace.set_span_in_context(parent)
    span = _tracer.start_span(name, context=context, start_time=_ns(start), attributes=attributes)
    span.end(end_time=_ns(end))


def start_call(parent: Span | None, record: Mapping[str, Any]) -> Span | None:
    """The span of one tool call (a child of its job's span): its tool, call id and seq from ``record``; None
    when tracing is off or the job has no span."""
    if _tracer is None or parent is None:
        return None
    attributes = {"ptc.tool.name": str(record["tool"]), "ptc.tool.call_id": str(record["call_id"])}
    return _tracer.start_span(
        "tool call", context=trace.set_span_in_context(parent), attributes={**attributes, "ptc.tool.seq": record["seq"]}
    )


def end_call(span: Span | None, record: Mapping[str, Any]) -> None:
    """End a tool call's span with its record's ``status``, ``duration_ms``, error ``type`` (never arguments,
    results or error messages) and ``call_id`` again (a durable job's is set once the call has its place in the
    job's call log, after the span began)."""
    if span is None:
        return
    span.set_attribute("ptc.tool.call_id", str(record["call_id"]))
    status = str(record.get("status"))
    span.set_attribute("ptc.tool.status", status)
    if record.get("duration_ms") is not None:
        span.set_attribute("ptc.tool.duration_ms", float(record["duration_ms"]))
    error = record.get("error")
    if isinstance(error, dict) and isinstance(error.get("type"), str):
        span.set_attribute("ptc.tool.error_type", error["type"])
    if status != "ok":
        span.set_status(Status(StatusCode.ERROR, status))
    span.end()


def current(span: Span | None) -> contextlib.AbstractContextManager[Any]:
    """Make ``span`` the current span inside the block (so outgoing requests name it); nothing for None."""
    if span is None:
        return _NOTHING
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def inject(headers: dict[str, str], span: Span | None = None) -> None:
    """Add the W3C ``traceparent`` of ``span`` (default: the current span) to ``headers`` (global propagator);
    nothing when tracing is off or there is no valid span."""
    if _tracer is None:
        return
    context = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    for name in [name for name in headers if name.lower() in carrier]:  # a configured one of another case too
        del headers[name]
    headers.update(carrier)


def trace_id(span: Span | None = None) -> str | None:
    """The trace id (32 hex digits) of ``span`` (default: the current span); None when tracing is off or the span
    is not valid."""
    if _tracer is None:
        return None
    ctx = (span if span is not None else trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
