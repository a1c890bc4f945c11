"""Request bodies: the size limit (``BodyLimit``, before anything is read past it), and parsing and validating
JSON bodies on worker threads (``ParsedOffLoop``, ``parse_body``), not on the event loop but for small ones."""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import exactjson
from service.api.problems import PAYLOAD_TOO_LARGE
from service.collector import gc_paused
from service.idempotency import KEY_HEADER, canonical_digest
from service.toolkit.validation import CheckScheduler

DRAIN_BYTES = 64 * 1024 * 1024
MAX_BODY_DEPTH = 254  # JSON nesting levels (arrays and objects) of a request body: what orjson writes; deeper: 422
BODY_THREADS = 2  # threads that parse and validate request bodies, shared by all keys, round-robin between them
INLINE_BODY_BYTES = 4096  # a body this small, with at most INLINE_BODY_CONTAINERS "[" and "{" (strings' included),
INLINE_BODY_CONTAINERS = 128  # is parsed and validated on the loop: 0.15 ms at most (4 KiB of 400 metadata keys, or
# a 4,000-digit integer, measured on the 2-core machine), less than a thread's hand-off costs a small body


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413 before reading them all."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._drain(receive)
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._drain(receive)
            await self._refuse(scope, receive, send)

    async def _drain(self, receive: Receive) -> None:
        """Read (and drop) the rest of the body, up to DRAIN_BYTES, so the client sees the 413, not a reset."""
        drained = 0
        while drained < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = PAYLOAD_TOO_LARGE.response(f"the body exceeds {self.limit} bytes (PTC_MAX_BODY_BYTES)")
        await response(scope, receive, send)


def _json_content(content_type: str | None) -> bool:
    """Whether FastAPI would read a body of this ``Content-Type`` as JSON (``application/json`` or ``*+json``)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


_TOO_DEEP = {"type": "too_deep", "loc": ("body",), "msg": f"nested deeper than {MAX_BODY_DEPTH} levels"}


def parse_body(raw: bytes, validate: Callable[[Any], tuple[Any, list[Any]]], digest: list[bytes] | None = None) -> Any:
    """A request body parsed (orjson; the stdlib for what only it reads exactly: integers past 64 bits, lone
    surrogates) and validated.

    Runs on a worker thread: parsing and validating 8 MiB of nested JSON takes seconds of CPU.

    Args:
        raw: the body's bytes (at most ``PTC_MAX_BODY_BYTES``, ``BodyLimit``).
        validate: the route's body field's ``validate(value) -> (value, errors)``.
        digest: when given (a request with an ``Idempotency-Key``), the SHA-256 of the valid body's canonical
            JSON is appended to it (``idempotency.canonical_digest``, for the request's fingerprint).

    Returns:
        The validated body (for a model, its instance: FastAPI's own validation then keeps it as it is).

    Raises:
        RequestValidationError: not JSON, nested deeper than ``MAX_BODY_DEPTH``, or invalid; each error has
            ``type``, ``loc`` and ``msg`` only (never the offending ``input``, which may be megabytes).
    """
    try:
        if exactjson.has_long_digits(raw):  # orjson would read an integer past 64 bits as a float
            raise orjson.JSONDecodeError("an integer may be past 64 bits", "", 0)
        with gc_paused():
            value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            with gc_paused():
                value = json.loads(raw)
        except json.JSONDecodeError as exc:
            error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": f"JSON decode error: {exc.msg}"}
            raise RequestValidationError([error]) from None
        except UnicodeDecodeError as exc:
            error = {"type": "json_invalid", "loc": ("body", exc.start), "msg": f"not UTF-8 text: {exc.reason}"}
            raise RequestValidationError([error]) from None
        except RecursionError:  # the stdlib's recursion limit; orjson's parser stops at 1,024 levels
            raise RequestValidationError([_TOO_DEEP]) from None
        except ValueError:  # int() past sys.get_int_max_str_digits() (4,300 digits): no JSONDecodeError
            error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error: too many digits"}
            raise RequestValidationError([error]) from None
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH and _deeper_than(value):
        raise RequestValidationError([_TOO_DEEP])
    validated, errors = validate(value)
    if errors:
        refusal = RequestValidationError(
            [{"type": e.get("type", ""), "loc": tuple(e.get("loc", ())), "msg": e.get("msg", "")} for e in errors]
        )
        # The traceback keeps this frame: drop the parsed body (and the errors' "input") here, on this thread,
        # not on the event loop when the exception is handled there.
        del value, validated, errors
        raise refusal
    if digest is not None:
        digest.append(canonical_digest(value))
    return validated


def _deeper_than(value: Any) -> bool:
    """Whether ``value`` nests deeper than ``MAX_BODY_DEPTH`` levels: orjson refuses to write it (checked in C)."""
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return True
    return False


class ParsedOffLoop(APIRoute):
    """A route whose JSON body is parsed and validated on a worker thread (``parse_body``), not on the loop, unless
    it is at most ``INLINE_BODY_BYTES`` (bounded work, cheaper than the hand-off).

    The threads are ``app.state.bodies`` (a ``CheckScheduler``): one body per request at a time, taken
    round-robin between API keys, so one key's stream of large bodies delays another key's by at most one.
    FastAPI then finds the parsed value cached on the request (``request._json``, Starlette's cache) and its
    own validation of a model instance returns it unchanged.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler

        def validate(value: Any) -> tuple[Any, list[Any]]:
            return field.validate(value, {}, loc=("body",))

        async def parse_first(request: Request) -> Response:
            if _json_content(request.headers.get("content-type")):
                try:
                    raw = await request.body()
                except ClientDisconnect:  # FastAPI's own reading answers 400 too (no error logged, no 500)
                    raise HTTPException(400, "the client disconnected before sending the whole body") from None
                request.state.raw_body = raw  # relayed as it came if the job or session is elsewhere (api.forward)
                if raw:
                    digest: list[bytes] | None = [] if KEY_HEADER in request.headers else None
                    if inline_body(raw):  # bounded work: a thread's hand-off would cost more
                        request._json = parse_body(raw, validate, digest)
                    else:
                        bodies: CheckScheduler = request.app.state.bodies
                        group = getattr(request.state, "key_name", None) or ""
                        request._json = await bodies.run(group, request, parse_body, raw, validate, digest)
                    if digest:
                        request.state.body_digest = digest[0]
            return await handler(request)

        return parse_first


def inline_body(raw: bytes) -> bool:
    """Whether ``raw`` is small enough to parse and validate on the loop: at most ``INLINE_BODY_BYTES`` and
    ``INLINE_BODY_CONTAINERS`` arrays and objects (a walk over each, the metadata's depth check, is Python's)."""
    return len(raw) <= INLINE_BODY_BYTES and raw.count(b"[") + raw.count(b"{") <= INLINE_BODY_CONTAINERS


class _BodyTooLarge(BaseException):
    """Not an Exception: FastAPI turns any Exception raised while it reads a body into a 400."""
