"""Internal calls between replicas: HMAC-SHA256 signatures of forwarded requests (docs/scaling.md, Internal calls;
issue 17, step 3).

A replica that receives a request about a job or session another live replica owns sends the same public route to
the owner's internal URL, without the caller's bearer token, with these headers (``signed_headers``):

=========================  ==========================================================================================
header                     value
=========================  ==========================================================================================
``Ptc-Internal-Caller``    the caller's key name, percent-encoded (empty with ``PTC_AUTH=disabled``)
``Ptc-Internal-Source``    the forwarding instance id
``Ptc-Internal-Target``    ``<instance_id>.<epoch>`` of the owner's incarnation
``Ptc-Internal-Date``      Unix seconds
``Ptc-Internal-Nonce``     32 random hex digits
``Ptc-Internal-Body-SHA256`` SHA-256 (hex) of the body (the last signed line), so that the signature is checked
                           before the body is read
``Ptc-Internal-Signature`` ``v1=`` + HMAC-SHA256 (hex) with the first ``PTC_INTERNAL_SECRET`` over the lines ``v1``,
                           method, raw path and query, caller, source, target, date, nonce, ``Idempotency-Key`` (or
                           empty), ``Last-Event-ID`` (or empty), SHA-256 (hex) of the body
=========================  ==========================================================================================

The owner (``Verifier``, called by ``auth.BearerAuth``) checks, with any listed secret (rotation: sign with the
first, accept any): the signature, that the target is its own current incarnation, the date within
``WINDOW_S`` of its clock, and the nonce unseen in the last ``NONCE_TTL_S`` (a bounded set: when full, the request
is refused with 503 rather than the set grown). Each outcome is counted (``ptc_internal_requests_total``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets as _secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from urllib.parse import quote, unquote

SIGNATURE = "ptc-internal-signature"
CALLER = "ptc-internal-caller"
SOURCE = "ptc-internal-source"
TARGET = "ptc-internal-target"
DATE = "ptc-internal-date"
NONCE = "ptc-internal-nonce"
BODY = "ptc-internal-body-sha256"
"""SHA-256 (hex) of the body, also a signed line: the signature is checked before the body is read (``precheck``),
so a peer without the secret cannot make a replica read and hold a body."""
HEADERS = (CALLER, SOURCE, TARGET, DATE, NONCE, BODY, SIGNATURE)
"""The internal headers (lower case, as ASGI gives them)."""

VERSION = "v1"
WINDOW_S = 30.0
"""Largest difference between a signed request's date and the owner's clock (s)."""
NONCE_TTL_S = 60.0
"""How long a nonce is remembered (s): more than twice ``WINDOW_S``, so a replay inside the window is caught."""
MAX_NONCES = 100_000
"""Nonces remembered at most (about 10 MB); past it, signed requests are refused (503) until some expire."""
MAX_NONCES_PER_CALLER = MAX_NONCES // 8
"""Nonces of one caller (key name) remembered at most: one key's flood of relayed requests is refused (503) before
it fills the whole set, which would refuse every key's relays to this replica for up to ``NONCE_TTL_S``."""
MIN_SECRET_CHARS = 32


class InternalRefused(Exception):
    """A signed request that is refused; ``outcome`` is its ``ptc_internal_requests_total`` label
    (``bad_signature``, ``wrong_target``, ``stale``, ``replayed``, ``busy``: the nonce set is full)."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


def parse_secrets(text: str) -> list[bytes]:
    """``PTC_INTERNAL_SECRET``: one or more secrets separated by spaces, newest first.

    Raises:
        ValueError: no secret, or one shorter than ``MIN_SECRET_CHARS`` (the message never holds a secret).
    """
    found = text.split()
    if not found:
        raise ValueError("PTC_INTERNAL_SECRET holds no secret")
    if any(len(secret) < MIN_SECRET_CHARS for secret in found):
        raise ValueError(f"PTC_INTERNAL_SECRET: each secret must have at least {MIN_SECRET_CHARS} characters")
    return [secret.encode() for secret in found]


def signature(
    secret: bytes,
    method: str,
    path: str,
    caller: str,
    source: str,
    target: str,
    date: str,
    nonce: str,
    idempotency_key: str,
    last_event_id: str,
    body_sha256: str,
) -> str:
    """``v1=`` + HMAC-SHA256 (hex) of the signed lines (see the module's docstring); ``path``: raw path and query,
    ``caller``: the percent-encoded key name."""
    lines = (VERSION, method.upper(), path, caller, source, target, date, nonce, idempotency_key, last_event_id)
    message = "\n".join((*lines, body_sha256)).encode()
    return f"{VERSION}=" + hmac.new(secret, message, hashlib.sha256).hexdigest()


def signed_headers(
    secret: bytes,
    method: str,
    path: str,
    caller: str | None,
    source: str,
    target: str,
    body: bytes,
    idempotency_key: str | None = None,
    last_event_id: str | None = None,
    now: float | None = None,
) -> dict[str, str]:
    """The internal headers of one forwarded request (a fresh nonce each call).

    Args:
        secret: the first ``PTC_INTERNAL_SECRET``.
        path: the raw path and query string (``/jobs/x?calls=summary``), as the owner will see it.
        caller: the caller's key name (None: authentication disabled).
        source: this instance id; ``target``: ``<instance_id>.<epoch>`` of the owner.
        body: the raw body sent.
        now: Unix seconds (default: the clock).
    """
    encoded = quote(caller or "", safe="")
    date = str(int(time.time() if now is None else now))
    nonce = _secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    signed = signature(
        secret, method, path, encoded, source, target, date, nonce, idempotency_key or "", last_event_id or "", digest
    )
    return {CALLER: encoded, SOURCE: source, TARGET: target, DATE: date, NONCE: nonce, BODY: digest, SIGNATURE: signed}


class Verifier:
    """Checks signed requests on the owner (see the module's docstring).

    Args:
        secrets: the accepted secrets (``parse_secrets``); empty: every signed request is refused.

    Attributes:
        target: this replica's incarnation as ``<instance_id>.<epoch>``, set once it is registered (None before:
            every signed request is refused as ``wrong_target``).
        counts: signed requests received, by outcome (``accepted`` and the refusals).
        on_outcome: told each outcome (the metrics).
    """

    def __init__(self, secrets: list[bytes]) -> None:
        self._secrets = list(secrets)
        self._nonces: OrderedDict[str, tuple[float, str]] = OrderedDict()  # nonce -> (forget at, monotonic s; caller)
        self._callers: dict[str, int] = {}  # caller -> its nonces remembered
        self.target: str | None = None
        self.counts: dict[str, int] = {}
        self.on_outcome: Callable[[str], None] = lambda _: None

    def count(self, outcome: str) -> None:
        """Count one signed request's outcome (and tell ``on_outcome``: the metrics)."""
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.on_outcome(outcome)

    def verify(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes, now: float | None = None
    ) -> str | None:
        """Check one signed request; returns its caller's key name (None: sent with authentication disabled).

        Args:
            method, path: the request's method and raw path with its query string.
            headers: its headers, lower-case names.
            body: its whole body.
            now: Unix seconds (default: the clock).

        Raises:
            InternalRefused: any check failed (counted here, as is an accepted request).
        """
        try:
            caller = self._verify(method, path, headers, body, time.time() if now is None else now)
        except InternalRefused as exc:
            self.count(exc.outcome)
            raise
        self.count("accepted")
        return caller

    def precheck(self, method: str, path: str, headers: Mapping[str, str], now: float | None = None) -> None:
        """The checks that need no body, made before it is read: the signature (over the digest that
        ``Ptc-Internal-Body-SHA256`` announces), the target and the date.

        Raises:
            InternalRefused: one failed (counted here; an accepted request is counted by ``verify``).
        """
        try:
            self._signed(method, path, headers, headers.get(BODY, ""), time.time() if now is None else now)
        except InternalRefused as exc:
            self.count(exc.outcome)
            raise

    def _verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes, now: float) -> str | None:
        digest = hashlib.sha256(body).hexdigest()
        if not hmac.compare_digest(headers.get(BODY, "").encode(), digest.encode()):
            raise InternalRefused("bad_signature", "the internal call's body is not the one signed")
        caller, nonce = self._signed(method, path, headers, digest, now)
        self._remember(nonce, caller)
        name = unquote(caller)
        return name or None

    def _signed(self, method: str, path: str, headers: Mapping[str, str], digest: str, now: float) -> tuple[str, str]:
        """Check the signature over ``digest``, the target and the date; returns (caller as sent, nonce)."""
        given = headers.get(SIGNATURE, "")
        fields = [headers.get(name, "") for name in (CALLER, SOURCE, TARGET, DATE, NONCE)]
        caller, source, target, date, nonce = fields
        extra = (headers.get("idempotency-key", ""), headers.get("last-event-id", ""))
        valid = False
        for secret in self._secrets:  # every secret, whichever matches: no early exit
            expected = signature(secret, method, path, caller, source, target, date, nonce, *extra, digest)
            valid |= hmac.compare_digest(expected.encode(), given.encode())
        if not valid:
            raise InternalRefused("bad_signature", "the internal signature is not valid")
        if self.target is None or not hmac.compare_digest(target.encode(), self.target.encode()):
            raise InternalRefused("wrong_target", "the internal call is addressed to another incarnation")
        if not date.isdigit() or abs(now - int(date)) > WINDOW_S:
            raise InternalRefused("stale", f"the internal call's date is more than {WINDOW_S:.0f} s off")
        return caller, nonce

    def _remember(self, nonce: str, caller: str) -> None:
        clock = time.monotonic()
        while self._nonces:
            oldest, (until, whose) = next(iter(self._nonces.items()))
            if until > clock:
                break
            del self._nonces[oldest]
            left = self._callers.pop(whose) - 1
            if left:
                self._callers[whose] = left
        if len(nonce) != 32 or nonce in self._nonces:
            raise InternalRefused("replayed", "the internal call's nonce was seen already")
        held = self._callers.get(caller, 0)
        if len(self._nonces) >= MAX_NONCES or (caller and held >= MAX_NONCES_PER_CALLER):  # "": no keys, one tenant
            raise InternalRefused("busy", "too many internal calls at once; retry")
        self._nonces[nonce] = (clock + NONCE_TTL_S, caller)
        self._callers[caller] = held + 1
