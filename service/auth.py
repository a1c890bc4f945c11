"""Authentication: API keys as bearer tokens, checked in constant time by an ASGI middleware.

Keys are configured by their SHA-256 (``PTC_API_KEYS`` = ``name:hex,name:hex``,
and/or ``PTC_API_KEYS_FILE`` with one ``name:hex`` per line), never by the token
itself: the service's environment and config hold nothing that would let a
reader call it. ``ptc-sandbox hash-key NAME`` makes the entry for a token.

A request carries ``Authorization: Bearer <token>``. Its SHA-256 is compared
with every configured hash by ``hmac.compare_digest`` — all of them, whether or
not one matched already — so the time taken does not depend on which key, or
which byte of it, matched. The key's name is put on ``request.state.key_name``
(None on open paths and when authentication is disabled) for logs and metrics.

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

``PTC_AUTH=disabled`` turns all of this off, for development: it is logged as a
warning at start-up, and refused (``InsecureConfig``) when ``PTC_HOST`` is not a
loopback address unless ``PTC_AUTH_FORCE_INSECURE=true``.

Owners: every job, session and toolset belongs to the key name that created it
(``IMPLICIT_OWNER`` when authentication is disabled); a request acts only on what
its ``Caller`` owns, except for the keys named in ``PTC_ADMIN_KEYS`` (the admin
role), which act on everything. With authentication disabled there is one
implicit owner, and it has the admin role (it sees what keys created before too).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import InsecureConfig
from service.internal import SIGNATURE as _SIGNATURE
from service.internal import SOURCE as SOURCE_HEADER
from service.internal import InternalRefused, Verifier
from service.settings import Settings

log = logging.getLogger(__name__)

IMPLICIT_OWNER = "anonymous"  # the owner of everything created while authentication is disabled
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
METRICS_PATH = "/metrics"
KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # bounded, safe as a log field and a metrics label
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
_BEARER = b"bearer "
SIGNATURE_HEADER = _SIGNATURE.encode()


def hash_token(token: str | bytes) -> str:
    """The SHA-256 (hex) of a token, as ``PTC_API_KEYS`` holds it; a str token is UTF-8 encoded."""
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One configured key: its name and the SHA-256 digest (32 bytes) of its token."""

    name: str
    digest: bytes


def named_entries(text: str, source: str, what: str) -> Iterator[tuple[str, str]]:
    """The ``(name, value)`` of each ``name:value`` entry in ``text``, entries separated by commas or newlines.

    A line starting with ``#`` is a comment; names are key names (``KEY_NAME``); values are stripped.

    Raises:
        ValueError: an entry has no ``:``, a name that is not a key name, or an empty value (the message names
            ``source`` and ``what`` a value should be, never the value).
    """
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        for entry in line.split(","):
            entry = entry.strip()
            if not entry:
                continue
            name, sep, value = entry.partition(":")
            name, value = name.strip(), value.strip()
            if not sep or not KEY_NAME.match(name) or not value:
                raise ValueError(f"{source}: an entry is not name:{what} (name: letters, digits, _ . -)")
            yield name, value


def parse_keys(text: str, source: str = "PTC_API_KEYS") -> list[ApiKey]:
    """Parse ``name:sha256hex`` entries separated by commas or newlines (``#`` starts a comment line).

    Raises:
        ValueError: an entry is malformed (names ``source`` and the entry's name, never the hash).
    """
    keys = []
    for name, digest in named_entries(text, source, "sha256hex"):
        if not _HEX_DIGEST.match(digest):
            raise ValueError(f"{source}: the hash of key {name!r} is not 64 hex digits (see ptc-sandbox hash-key)")
        keys.append(ApiKey(name, bytes.fromhex(digest)))
    return keys


@dataclass(frozen=True)
class Caller:
    """Who makes a request: the owner of what it creates, and whether it has the admin role.

    Attributes:
        owner: the key's name (``IMPLICIT_OWNER`` with authentication disabled).
        admin: sees and acts on what every owner created (legacy rows with no owner included).
    """

    owner: str
    admin: bool = False
    internal: bool = False
    """The request came signed from another replica (``service.internal``): it is never forwarded again."""

    def may_access(self, owner: str | None) -> bool:
        """Whether this caller may see and act on something owned by ``owner`` (None: saved before owners were)."""
        return self.admin or (owner is not None and owner == self.owner)

    @property
    def only_owner(self) -> str | None:
        """The owner a listing is restricted to; None for an admin (everything)."""
        return None if self.admin else self.owner


class KeyRing:
    """The configured keys; ``identify`` tells which one a token is, ``caller`` what it may do.

    Args:
        keys: at least one key.
        admins: names of the keys with the admin role.
        scrapers: names of the keys that may read ``/metrics`` besides the admins (``PTC_METRICS_KEYS``).
    """

    def __init__(self, keys: Iterable[ApiKey], admins: Iterable[str] = (), scrapers: Iterable[str] = ()) -> None:
        self._keys = tuple(keys)
        if not self._keys:
            raise ValueError("a key ring needs at least one key")
        self.admins = frozenset(admins)
        self.scrapers = frozenset(scrapers)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def tenants(self) -> int:
        """How many owners the keys make (several tokens of one name, e.g. while rotating, are one owner)."""
        return len({key.name for key in self._keys})

    def identify(self, token: bytes) -> str | None:
        """The name of the key whose token is ``token``, or None.

        Constant time in the token: its digest is compared with every key's digest by
        ``hmac.compare_digest``, with no early exit, whichever key matches.
        """
        digest = hashlib.sha256(token).digest()
        found: str | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key.name
        return found


def caller(keys: KeyRing | None, key_name: str | None, internal: bool = False) -> Caller:
    """The ``Caller`` of a request whose key is ``key_name`` (None: authentication disabled, the implicit owner);
    ``internal``: a signed request of another replica (the admin role still comes from this replica's keys).

    Raises:
        ValueError: ``key_name`` is None while authentication is on (an open path has no caller).
    """
    if keys is None:
        return Caller(IMPLICIT_OWNER, admin=True, internal=internal)
    if key_name is None:
        raise ValueError("no API key on this request")
    return Caller(key_name, admin=key_name in keys.admins, internal=internal)


def single_tenant(keys: KeyRing | None) -> bool:
    """Whether the service has one tenant: authentication disabled (``IMPLICIT_OWNER``), or keys of one name.

    Then the per-key quotas that default to a share of the host default to the whole host (``service.quotas``).
    """
    return keys is None or keys.tenants == 1


def may_scrape(keys: KeyRing | None, key_name: str | None) -> bool:
    """Whether a request whose key is ``key_name`` may read ``/metrics``.

    Yes with authentication disabled, on an open ``/metrics`` (``PTC_METRICS_AUTH=open``: no key is
    identified there, ``key_name`` is None), and for the admin role and ``PTC_METRICS_KEYS``; no for any
    other key (the metrics name every tenant's tools and count everyone's jobs).
    """
    if keys is None or key_name is None:
        return True
    return key_name in keys.admins or key_name in keys.scrapers


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the service to this machine only (``localhost`` or a loopback address)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def configure(settings: Settings) -> KeyRing | None:
    """The key ring the service authenticates with, or None when authentication is disabled.

    Raises:
        InsecureConfig: ``PTC_AUTH=required`` without any key, or ``PTC_AUTH=disabled`` on a
            non-loopback ``PTC_HOST`` without ``PTC_AUTH_FORCE_INSECURE``; or a key entry is malformed.
    """
    try:
        keys = parse_keys(settings.api_keys or "")
        if settings.api_keys_file is not None:
            keys += parse_keys(settings.api_keys_file.read_text(), f"PTC_API_KEYS_FILE ({settings.api_keys_file})")
    except (OSError, ValueError) as exc:
        raise InsecureConfig(str(exc)) from exc
    if settings.auth == "required":
        if not keys:
            raise InsecureConfig(
                "PTC_AUTH=required but no API keys are configured: set PTC_API_KEYS (entries from "
                "`ptc-sandbox hash-key NAME`), or PTC_AUTH=disabled for development on a loopback address"
            )
        names = {k.name for k in keys}
        for setting, named in (("PTC_ADMIN_KEYS", settings.admin_keys), ("PTC_METRICS_KEYS", settings.metrics_keys)):
            unknown = sorted(set(named) - names)
            if unknown:
                raise InsecureConfig(f"{setting} names {', '.join(unknown)}, which is no configured API key")
        log.info("authentication: %d API key(s): %s", len(keys), ", ".join(sorted(names)))
        if settings.admin_keys:
            log.info("admin role (sees every owner's jobs and sessions): %s", ", ".join(sorted(settings.admin_keys)))
        if settings.metrics_keys:
            log.info("may read /metrics besides the admin role: %s", ", ".join(sorted(settings.metrics_keys)))
        return KeyRing(keys, settings.admin_keys, settings.metrics_keys)
    if not is_loopback(settings.host):
        if not settings.auth_force_insecure:
            raise InsecureConfig(
                f"PTC_AUTH=disabled while bound to {settings.host}, which is not a loopback address: anyone who "
                "reaches it could run code; configure PTC_API_KEYS, or set PTC_AUTH_FORCE_INSECURE=true"
            )
        log.critical("!!! AUTHENTICATION DISABLED on non-loopback %s (PTC_AUTH_FORCE_INSECURE) !!!", settings.host)
    log.warning(
        "!!! AUTHENTICATION DISABLED (PTC_AUTH=disabled): any caller on %s can run code; development only !!!",
        settings.host,
    )
    return None


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

    A request that carries ``Ptc-Internal-Signature`` is a signed call of another replica (``service.internal``):
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
        state["key_name"] = name
        logs.KEY_NAME.set(name)  # the request's log event, and the events of the jobs it submits, name the key
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
        if name is not None:
            logs.KEY_NAME.set(name)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
