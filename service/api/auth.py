"""Authentication over HTTP: the bearer token of a request, checked by an ASGI middleware before a body is read.

A request carries ``Authorization: Bearer <token>``; ``service.tenancy.KeyRing``
tells which key it is, in constant time. The key's name is put on
``request.state.key_name`` (None on open paths and when authentication is
disabled) for logs and metrics.

Every path needs a key except ``/healthz``, ``/readyz``, with
``PTC_METRICS_AUTH=open`` ``/metrics``, and the API documents (``/openapi.json``,
``/docs``, ``/redoc`` and their assets: ``api.routers.docs.OPEN_PATHS``, which
the app adds; they describe the code, not any tenant's data); that includes
unknown paths (a caller without a key learns nothing of which exist).
A missing or wrong key gets ``401`` problem+json with ``WWW-Authenticate: Bearer``
before the body is read. With ``PTC_METRICS_AUTH=required``, ``/metrics`` (which
names every tenant's tools and counts everyone's jobs) answers only keys that
``may_scrape``: the admin role and the keys named in ``PTC_METRICS_KEYS``; any
other key gets ``403``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.replicas.internal import SIGNATURE as _SIGNATURE
from service.replicas.internal import SOURCE as SOURCE_HEADER
from service.replicas.internal import InternalRefused, Verifier
from service.settings import Settings
from service.tenancy import KEY_NAME, KeyRing

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
METRICS_PATH = "/metrics"
_BEARER = b"bearer "
SIGNATURE_HEADER = _SIGNATURE.encode()


def open_paths(settings: Settings) -> frozenset[str]:
    """The paths that answer without a key."""
    return OPEN_PATHS | ({METRICS_PATH} if settings.metrics_auth == "open" else frozenset())


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's first ``Authorization: Bearer`` header (scheme case-insensitive), or None."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            if value[: len(_BEARER)].lower() == _BEARER:
                token = value[len(_BEARER) :].strip()
                return token or None
            return None
    return None


class BearerAuth:
    """ASGI middleware: refuse requests without a known key, before their body is read.

    A request that carries ``Ptc-Internal-Signature`` is a signed call of another replica (``replicas.internal``):
    its whole body (at most ``body_limit`` bytes) is read here and checked with ``verifier``; on success it runs as
    the key named by ``Ptc-Internal-Caller`` (``key_name``; the admin role from this replica's own keys), with
    ``state.internal`` set to the source instance id. Any failure is a 401 (503 when the nonce set is full), never
    a fall-back to the bearer check.

    Args:
        app: the application behind it.
        keys: the key ring; None disables authentication (``key_name`` is then None).
        open_paths: paths that answer without a key.
        deny: makes the 401 response from a reason (``api.problems`` owns the problem+json mapping);
            the middleware adds ``WWW-Authenticate``.
        verifier: checks signed requests; None: every signed request is refused (no ``PTC_INTERNAL_SECRET``).
        unavailable: makes the 503 response from a reason (the nonce set is full).
        body_limit: largest signed body read (``PTC_MAX_BODY_BYTES``); a longer one is refused.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing | None,
        open_paths: frozenset[str],
        deny: Callable[[str], Response],
        verifier: Verifier | None = None,
        unavailable: Callable[[str], Response] | None = None,
        body_limit: int = 8 * 1024 * 1024,
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.deny = deny
        self.verifier = verifier
        self.unavailable = unavailable or deny
        self.body_limit = body_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["key_name"] = None
        state["internal"] = None
        if scope["type"] == "http" and any(name == SIGNATURE_HEADER for name, _ in scope.get("headers") or ()):
            await self._internal(scope, receive, send)
            return
        if self.keys is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        name = self.keys.identify(token) if token is not None else None
        if name is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "API key missing or not valid"})
                return
            if token is None:
                response = self.deny("this route needs an API key: send Authorization: Bearer <token>")
                response.headers["WWW-Authenticate"] = 'Bearer realm="ptc-sandbox"'
            else:
                response = self.deny("the API key is not valid")
                response.headers["WWW-Authenticate"] = 'Bearer realm="ptc-sandbox", error="invalid_token"'
            await response(scope, receive, send)
            return
        state["key_name"] = name  # the request's log event names the key
        await self.app(scope, receive, send)

    async def _internal(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A signed request of another replica: check its signature, read its body, verify it, run it as its caller
        (or refuse it)."""
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers") or ()}
        raw_path = (scope.get("raw_path") or scope["path"].encode()).split(b"?", 1)[0]
        query = scope.get("query_string") or b""
        path = raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        try:
            if self.verifier is None:
                raise InternalRefused("bad_signature", "this replica accepts no internal calls")
            self.verifier.precheck(scope["method"], path, headers)  # a forgery's body is never read
        except InternalRefused as exc:
            log.warning("internal call refused (%s) from %s", exc.outcome, headers.get(SOURCE_HEADER, "?")[:64])
            await self.deny(f"internal call refused: {exc}")(scope, receive, send)
            return
        # pieces joined once (``body += piece`` copied the whole body at each piece: quadratic, on the event loop)
        pieces: list[bytes] = []
        size, complete = 0, False
        while not complete:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            piece = message.get("body", b"")
            pieces.append(piece)
            size += len(piece)
            complete = not message.get("more_body", False)
            if size > self.body_limit:
                break
        body = b"".join(pieces)
        del pieces
        try:
            if not complete:
                raise InternalRefused("bad_signature", "the internal call's body is over the limit")
            name = self.verifier.verify(scope["method"], path, headers, body)
            if self.keys is not None and (name is None or not KEY_NAME.match(name)):
                raise InternalRefused("bad_signature", "the internal call names no API key")
        except InternalRefused as exc:
            log.warning("internal call refused (%s) from %s", exc.outcome, headers.get(SOURCE_HEADER, "?")[:64])
            refuse = self.unavailable if exc.outcome == "busy" else self.deny
            await refuse(f"internal call refused: {exc}")(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["key_name"] = name if self.keys is not None else None
        state["internal"] = headers.get(SOURCE_HEADER, "")
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
