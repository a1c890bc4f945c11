"""Relaying a request to the replica that owns its job or session: the one exception handler of ``OwnerElsewhere``
(docs/scaling.md, Serving any job from any replica; issue 17, step 3). No route forwards by hand: a route asks the
job service as usual, which raises ``OwnerElsewhere`` for a job or session running on another live replica, and
this handler sends the same request (method, raw path and query, the raw body ``api.bodies`` kept, the headers of
``remote.SENT_HEADERS``; never the bearer token) to the owner, signed, and streams its answer back (status, the
headers of ``remote.RELAYED_HEADERS``, the body as it comes: a view, output bytes, an event stream).

The owner refusing the signed call (401: secrets that differ) or not answering is 503 ``owner-unavailable`` here,
never the owner's 401: the caller's key is fine. Each relay is counted in ``ptc_forwarded_requests_total`` by route
template (never an id) and outcome.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from service.api import problems
from service.errors import OwnerElsewhere, QuotaExceeded
from service.observability.metrics import Metrics
from service.replicas.remote import RELAYED_HEADERS, Remote

log = logging.getLogger(__name__)


def route_of(request: Request) -> str:
    """The request's route template (``/jobs/{job_id}``), or ``other``: a bounded label."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "other"


def raw_target(request: Request) -> str:
    """The request's raw path and query string, as the client sent them."""
    raw: bytes = (request.scope.get("raw_path") or request.scope["path"].encode()).split(b"?", 1)[0]
    query: bytes = request.scope.get("query_string") or b""
    return raw.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")


async def relay(request: Request, exc: Exception) -> Response:
    """The answer to ``OwnerElsewhere``: the owner's, relayed (see the module's docstring)."""
    assert isinstance(exc, OwnerElsewhere)
    remote: Remote | None = getattr(request.app.state, "remote", None)
    metrics: Metrics = request.app.state.metrics
    route = route_of(request)
    if remote is None:  # no PTC_INTERNAL_SECRET (a SQLite store never gets here)
        return await problems.handle(request, exc.unavailable())
    method, path = request.method, raw_target(request)
    if exc.instead is not None:
        query = request.scope.get("query_string") or b""
        method, path = exc.instead[0], exc.instead[1] + ("?" + query.decode("latin-1") if query else "")
    body = b"" if exc.instead is not None else getattr(request.state, "raw_body", b"")
    headers = {name: value for name, value in request.headers.items()}
    try:
        answer = await remote.open(exc, method, path, request.state.key_name, body, headers)
    except QuotaExceeded as failure:  # the caller's relays open at once (remote.MAX_PER_CALLER): nothing sent
        return await problems.handle(request, failure)
    except Exception as failure:  # OwnerUnavailable; anything else is logged by problems.handle
        metrics.forwarded(route, "unavailable")
        return await problems.handle(request, failure)
    if answer.status_code == 401:
        await answer.aclose()
        metrics.forwarded(route, "refused")
        log.error("the owner %s refused an internal call (do the replicas share PTC_INTERNAL_SECRET?)", exc.target)
        return await problems.handle(request, exc.unavailable())
    metrics.forwarded(route, "relayed")
    relayed = {name: value for name, value in answer.headers.items() if name.lower() in RELAYED_HEADERS}

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as failure:  # the owner went away mid-answer: the relayed answer ends here too
            log.warning("the answer of %s was cut: %s", exc.target, type(failure).__name__)
        finally:
            await answer.aclose()

    return StreamingResponse(stream(), status_code=answer.status_code, headers=relayed)


def install(app: FastAPI) -> None:
    """Make ``relay`` the app's handler of ``OwnerElsewhere`` (after ``problems.install``: the nearer class wins)."""
    app.add_exception_handler(OwnerElsewhere, relay)
