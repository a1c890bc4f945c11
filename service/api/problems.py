"""The one place errors become HTTP answers: RFC 9457 ``application/problem+json``.

``RULES`` is the table: each error class a route may raise (``service.errors``' hierarchy, and FastAPI's
``RequestValidationError``) maps to a ``ProblemType`` (``type`` URI, HTTP status, title) and to a function
that gives the answer's ``detail``, its extension members and headers. ``handle`` is the one exception
handler; it finds an error's rule by the error's class, most specific first (``EngineUnavailable`` before
``SandboxError``). An error with no rule (a bug, or a ``PtcError`` that never reaches HTTP, e.g.
``EgressDenied``) is logged with its traceback and answered 500 without its text.

Problem type URIs are tag URIs (RFC 4151), ``tag:ptc-sandbox.dev,2026:problems/<name>``: identifiers a client
compares as strings (RFC 9457 section 3.1.1: the ``type`` is the problem's primary identifier), stable across
releases, and promising no web page to fetch (an ``https`` URI would promise documentation at that address,
which the service does not serve). No answer is ``about:blank``: every type in ``TYPES`` has its section in
docs/problems.md, whose anchor is the type's name (``tests/unit/api/test_problems.py`` checks it).
Starlette's own HTTP errors (an unknown path's 404, a wrong method's 405 with ``Allow``, an unreadable body's
400) get their types from ``HTTP_LAYER``; any other status it might raise is ``http-error``.

Answers that are not errors of a route (the 401 of ``auth.BearerAuth``, the 413 of ``bodies.BodyLimit``, the
403 of ``/metrics``, the 503 of ``/readyz``) use the same problem types through ``ProblemType.response``; the
connection caps below the app (``service.api.connections``) answer with ``connection_refusal``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.openapi import PROBLEM
from service.errors import (
    CallNotPending,
    Draining,
    EngineUnavailable,
    FileRefused,
    HostCapacityExceeded,
    IdempotencyKeyInFlight,
    IdempotencyKeyReused,
    InvalidField,
    JobNotFound,
    ManifestError,
    NoSuchFile,
    OwnerElsewhere,
    OwnerUnavailable,
    PayloadTooLarge,
    PtcError,
    QueueFull,
    QuotaExceeded,
    RequestLimitError,
    SandboxError,
    SessionClosed,
    SessionNotFound,
    StoreUnavailable,
    TooManySessions,
    UnknownImage,
)
from service.observability.metrics import Metrics

log = logging.getLogger(__name__)

TYPE_PREFIX = "tag:ptc-sandbox.dev,2026:problems/"


def problem(status: int, title: str, detail: str, type_: str, **extra: Any) -> JSONResponse:
    """An RFC 9457 problem+json response: members ``type``, ``title``, ``status``, ``detail``, then ``extra``."""
    body = {"type": type_, "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(jsonable_encoder(body), status_code=status, media_type=PROBLEM)


@dataclass(frozen=True)
class ProblemType:
    """One kind of problem: ``name`` (the last part of its ``type`` URI), HTTP ``status`` and ``title``."""

    name: str
    status: int
    title: str

    @property
    def uri(self) -> str:
        """The ``type`` member: ``tag:ptc-sandbox.dev,2026:problems/<name>``."""
        return TYPE_PREFIX + self.name

    def response(self, detail: str, **extra: Any) -> JSONResponse:
        """The problem+json answer of this type: ``detail`` and the extension members ``extra``, in order."""
        return problem(self.status, self.title, detail, self.uri, **extra)


INVALID_REQUEST = ProblemType("invalid-request", 422, "Invalid request")
LIMIT_EXCEEDED = ProblemType("limit-exceeded", 422, "Limit exceeds the server maximum")
UNKNOWN_IMAGE = ProblemType("unknown-image", 422, "Unknown image")
INVALID_MANIFEST = ProblemType("invalid-manifest", 422, "Invalid tool manifest")
PAYLOAD_TOO_LARGE = ProblemType("payload-too-large", 413, "Request body too large")
UNAUTHORIZED = ProblemType("unauthorized", 401, "Unauthorized")
FORBIDDEN = ProblemType("forbidden", 403, "Forbidden")
JOB_NOT_FOUND = ProblemType("job-not-found", 404, "Job not found")
SESSION_NOT_FOUND = ProblemType("session-not-found", 404, "Session not found")
FILE_NOT_FOUND = ProblemType("file-not-found", 404, "File not found")
FILE_REFUSED = ProblemType("file-refused", 422, "File refused")
CALL_NOT_PENDING = ProblemType("call-not-pending", 409, "Call not waiting")
SESSION_ENDED = ProblemType("session-ended", 409, "Session ended")
IDEMPOTENCY_KEY_REUSED = ProblemType("idempotency-key-reused", 422, "Idempotency key reused")
IDEMPOTENCY_KEY_IN_FLIGHT = ProblemType("idempotency-key-in-flight", 409, "Idempotency key in flight")
QUEUE_FULL = ProblemType("queue-full", 429, "Too many jobs")
QUOTA_EXCEEDED = ProblemType("quota-exceeded", 429, "Quota exceeded")
HOST_CAPACITY_EXCEEDED = ProblemType("host-capacity-exceeded", 429, "Host capacity exceeded")
TOO_MANY_SESSIONS = ProblemType("too-many-sessions", 429, "Too many sessions")
ENGINE_UNAVAILABLE = ProblemType("engine-unavailable", 503, "Container engine unavailable")
STORE_UNAVAILABLE = ProblemType("store-unavailable", 503, "Job store unavailable")
OWNER_UNAVAILABLE = ProblemType("owner-unavailable", 503, "Job owner unavailable")
SANDBOX_FAILURE = ProblemType("sandbox-failure", 503, "Sandbox failure")
NOT_READY = ProblemType("not-ready", 503, "Not ready")
DRAINING = ProblemType("draining", 503, "Draining")
INTERNAL_ERROR = ProblemType("internal-error", 500, "Internal error")
BAD_REQUEST = ProblemType("bad-request", 400, "Bad request")
ROUTE_NOT_FOUND = ProblemType("route-not-found", 404, "Route not found")
METHOD_NOT_ALLOWED = ProblemType("method-not-allowed", 405, "Method not allowed")
HTTP_ERROR = ProblemType("http-error", 400, "HTTP error")  # answered with the HTTP layer's own status
TOO_MANY_CONNECTIONS = ProblemType("too-many-connections", 503, "Too many connections")
TOO_MANY_CONNECTIONS_FROM_ADDRESS = ProblemType(
    "too-many-connections-from-address", 429, "Too many connections from this address"
)
REQUEST_TIMEOUT = ProblemType("request-timeout", 408, "Request not received in time")

TYPES: tuple[ProblemType, ...] = (
    INVALID_REQUEST,
    LIMIT_EXCEEDED,
    UNKNOWN_IMAGE,
    INVALID_MANIFEST,
    PAYLOAD_TOO_LARGE,
    UNAUTHORIZED,
    FORBIDDEN,
    JOB_NOT_FOUND,
    SESSION_NOT_FOUND,
    FILE_NOT_FOUND,
    FILE_REFUSED,
    CALL_NOT_PENDING,
    SESSION_ENDED,
    IDEMPOTENCY_KEY_REUSED,
    IDEMPOTENCY_KEY_IN_FLIGHT,
    QUEUE_FULL,
    QUOTA_EXCEEDED,
    HOST_CAPACITY_EXCEEDED,
    TOO_MANY_SESSIONS,
    ENGINE_UNAVAILABLE,
    STORE_UNAVAILABLE,
    OWNER_UNAVAILABLE,
    SANDBOX_FAILURE,
    NOT_READY,
    DRAINING,
    INTERNAL_ERROR,
    BAD_REQUEST,
    ROUTE_NOT_FOUND,
    METHOD_NOT_ALLOWED,
    HTTP_ERROR,
    TOO_MANY_CONNECTIONS,
    TOO_MANY_CONNECTIONS_FROM_ADDRESS,
    REQUEST_TIMEOUT,
)

HTTP_LAYER: dict[int, ProblemType] = {400: BAD_REQUEST, 404: ROUTE_NOT_FOUND, 405: METHOD_NOT_ALLOWED}
"""Starlette's and FastAPI's own ``HTTPException`` statuses -> their types: 400 a body FastAPI could not read
(e.g. the client went away), 404 no route has the path, 405 a route has the path but not the method. Any other
status is ``HTTP_ERROR`` (none is raised by the routes and middleware this app has)."""


@dataclass(frozen=True)
class Answer:
    """What an error says beyond its type: ``detail``, extension members, headers, and the ``reason`` to count
    in ``ptc_rejections_total`` (a 429), if any."""

    detail: str
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    rejection: str | None = None


@dataclass(frozen=True)
class Rule:
    """How one error class is answered: its problem type, and its ``Answer`` made from the error."""

    type: ProblemType
    answer: Callable[[Any], Answer]


E = TypeVar("E", bound=Exception)


def _rule(cls: type[E], type_: ProblemType, answer: Callable[[E], Answer]) -> tuple[type[Exception], Rule]:
    """One row of ``RULES`` (typed: ``answer`` takes an instance of ``cls``)."""
    return cls, Rule(type_, answer)


def _fields(loc: tuple[str | int, ...], message: str, skip: tuple[str, ...], empty: str, kind: str) -> Answer:
    """A field's error: ``detail`` is ``"<field>: <message>"`` (``loc`` without the ``skip`` parts, or ``empty``)
    and ``errors`` lists it once, with ``kind`` as its ``type``."""
    where = ".".join(str(part) for part in loc if part not in skip) or empty
    return Answer(f"{where}: {message}", {"errors": [{"loc": list(loc), "msg": message, "type": kind}]})


def _invalid_request(exc: RequestValidationError) -> Answer:
    """FastAPI's validation errors: every wrong field in ``errors``; ``detail`` names the first."""
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request", "type": ""}
    if first["type"] == "json_invalid":
        position = first["loc"][-1] if first["loc"] else "?"
        detail = f"body: not valid JSON (at character {position}): {first['msg']}"
    else:
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        detail = f"{where}: {first['msg']}"
    return Answer(detail, {"errors": errors})


def _manifest(exc: ManifestError) -> Answer:
    return _fields(exc.loc, str(exc), ("body",), "", "manifest")


def _invalid(exc: InvalidField) -> Answer:
    return _fields(exc.loc, str(exc), ("body",), "request", "invalid")  # as FastAPI's: query.x, header.X


def _limit(exc: RequestLimitError) -> Answer:
    return _fields(exc.loc, str(exc), ("body",), "request", "limit")


def _unknown_image(exc: UnknownImage) -> Answer:
    answer = _fields(exc.loc, str(exc), ("body",), "request", "unknown_image")
    return Answer(answer.detail, {**answer.extra, "allowed_images": exc.allowed})


def _too_large(exc: PayloadTooLarge) -> Answer:
    return _fields(exc.loc, str(exc), ("body",), "", "too_large")


def _file_refused(exc: FileRefused) -> Answer:
    loc = ["body", "files", exc.index] if exc.index is not None else None
    return Answer(str(exc), {"code": exc.code, "loc": loc})


def _not_pending(exc: CallNotPending) -> Answer:
    return Answer(
        f"call {exc} is not waiting for this answer or decision (unknown, answered or decided, timed out, "
        "awaiting the other kind, or its job has ended)"
    )


def _session_ended(exc: SessionClosed) -> Answer:
    return Answer(str(exc), {"session_id": exc.session_id, "session_status": exc.status})


def _busy(exc: QueueFull | TooManySessions) -> Answer:
    """A 429 with ``reason`` and ``Retry-After``, counted."""
    return Answer(str(exc), {"reason": exc.reason}, {"Retry-After": str(exc.retry_after_s)}, exc.reason)


def _over_quota(exc: QuotaExceeded) -> Answer:
    """A 429 with ``reason``, ``limit`` (in the quota's unit) and ``Retry-After``, counted."""
    return Answer(
        str(exc), {"reason": exc.reason, "limit": exc.limit}, {"Retry-After": str(exc.retry_after_s)}, exc.reason
    )


def _message(exc: Exception) -> Answer:
    return Answer(str(exc))


RULES: dict[type[Exception], Rule] = dict(
    [
        _rule(RequestValidationError, INVALID_REQUEST, _invalid_request),
        _rule(ManifestError, INVALID_MANIFEST, _manifest),
        _rule(InvalidField, INVALID_REQUEST, _invalid),
        _rule(RequestLimitError, LIMIT_EXCEEDED, _limit),
        _rule(UnknownImage, UNKNOWN_IMAGE, _unknown_image),
        _rule(PayloadTooLarge, PAYLOAD_TOO_LARGE, _too_large),
        _rule(JobNotFound, JOB_NOT_FOUND, lambda exc: Answer(f"no job with id {exc}")),
        _rule(SessionNotFound, SESSION_NOT_FOUND, lambda exc: Answer(f"no session with id {exc}")),
        _rule(NoSuchFile, FILE_NOT_FOUND, _message),
        _rule(FileRefused, FILE_REFUSED, _file_refused),
        _rule(CallNotPending, CALL_NOT_PENDING, _not_pending),
        _rule(SessionClosed, SESSION_ENDED, _session_ended),
        _rule(IdempotencyKeyReused, IDEMPOTENCY_KEY_REUSED, _message),
        _rule(
            IdempotencyKeyInFlight,
            IDEMPOTENCY_KEY_IN_FLIGHT,
            lambda exc: Answer(str(exc), headers={"Retry-After": str(exc.retry_after_s)}),
        ),
        _rule(QueueFull, QUEUE_FULL, _busy),
        _rule(TooManySessions, TOO_MANY_SESSIONS, _busy),
        _rule(QuotaExceeded, QUOTA_EXCEEDED, _over_quota),
        _rule(HostCapacityExceeded, HOST_CAPACITY_EXCEEDED, _over_quota),
        _rule(EngineUnavailable, ENGINE_UNAVAILABLE, _message),
        _rule(StoreUnavailable, STORE_UNAVAILABLE, lambda exc: Answer(str(exc), headers={"Retry-After": "5"})),
        _rule(
            OwnerUnavailable,
            OWNER_UNAVAILABLE,
            lambda exc: Answer(str(exc), headers={"Retry-After": str(exc.retry_after_s)}),
        ),
        _rule(
            OwnerElsewhere,
            OWNER_UNAVAILABLE,
            lambda exc: Answer(str(exc), headers={"Retry-After": str(exc.retry_after_s)}),
        ),
        _rule(SandboxError, SANDBOX_FAILURE, _message),
        _rule(Draining, DRAINING, lambda exc: Answer(str(exc), headers={"Retry-After": str(exc.retry_after_s)})),
    ]
)
"""Each error class a route may raise -> its problem type (``type`` URI, status, title) and its answer."""


def rule_for(cls: type[BaseException]) -> Rule | None:
    """The rule of an error class: that of the class itself or of its nearest base in ``RULES``; None if none."""
    for base in cls.__mro__:
        rule = RULES.get(base)
        if rule is not None:
            return rule
    return None


async def handle(request: Request, exc: Exception) -> Response:
    """The exception handler of every error: its rule's problem+json, Starlette's own HTTP errors by
    ``HTTP_LAYER``, and anything else logged with its traceback and answered 500 (never its text)."""
    if isinstance(exc, StarletteHTTPException):
        return http_layer(exc)
    rule = rule_for(type(exc))
    if rule is None:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return INTERNAL_ERROR.response("the service failed; the error is in its log")
    answer = rule.answer(exc)
    if answer.rejection is not None:
        metrics: Metrics = request.app.state.metrics
        metrics.rejection(answer.rejection)
    response = rule.type.response(answer.detail, **answer.extra)
    response.headers.update(answer.headers)
    return response


def http_layer(exc: StarletteHTTPException) -> JSONResponse:
    """The answer to one of Starlette's or FastAPI's own HTTP errors: its ``HTTP_LAYER`` type (else
    ``http-error`` with the error's status and the status phrase as title), its ``detail`` (the status phrase
    unless it says more) and its headers (e.g. ``Allow`` of a 405)."""
    type_ = HTTP_LAYER.get(exc.status_code)
    detail = str(exc.detail)
    if type_ is not None:
        response = type_.response(_HTTP_DETAILS.get(exc.status_code, detail) if detail == _phrase(exc) else detail)
    else:
        response = problem(exc.status_code, _phrase(exc), detail, HTTP_ERROR.uri)
    response.headers.update(exc.headers or {})
    return response


_HTTP_DETAILS = {
    404: "no route has this path (paths are exact: no trailing slash; the routes are in GET /openapi.json)",
    405: "this path has no such method (Allow lists those it has)",
}


def _phrase(exc: StarletteHTTPException) -> str:
    """The status phrase Starlette puts as an HTTP error's ``detail`` when none was given."""
    try:
        return HTTPStatus(exc.status_code).phrase
    except ValueError:
        return "HTTP error"


def raw_answer(type_: ProblemType, detail: str, retry_after_s: int | None = None) -> bytes:
    """A complete HTTP/1.1 problem+json response of ``type_``, as bytes, with ``Connection: close`` (and
    ``Retry-After``, in seconds, if given): for what answers below the ASGI app (``service.api.connections``), where
    no response object exists."""
    body = orjson.dumps({"type": type_.uri, "title": type_.title, "status": type_.status, "detail": detail})
    head = [f"HTTP/1.1 {type_.status} {HTTPStatus(type_.status).phrase}", f"content-type: {PROBLEM}"]
    head.append("connection: close")
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def install(app: FastAPI) -> None:
    """Make ``handle`` the app's handler of the service's errors, FastAPI's validation errors, Starlette's HTTP
    errors, and (through Starlette's server-error middleware) any other exception."""
    for cls in (PtcError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(cls, handle)
