"""Completion callbacks: the final job view POSTed to the job's ``callback_url``, signed, retried.

Signature, as the Standard Webhooks specification (version 1.0.0, "Signature scheme" and "Webhook headers") says:

- ``webhook-id``: ``msg_<job id>``, the same in every attempt of a job's one callback (retries and deliveries
  resumed after a restart included), so a receiver drops duplicates by it;
- ``webhook-timestamp``: this attempt's time, unix seconds;
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256(key, f"{id}.{timestamp}." + body)>``, one per secret of the
  job's owner, space-separated (two while a secret is rotated: a receiver holding either verifies).

A secret written ``whsec_<base64>`` (the specification's form) signs with the bytes its base64 decodes to, at
least 24; any other secret (a free-form one of the releases before) signs with its UTF-8 bytes, as the
specification's "Migrating" section allows. A receiver verifies with the ``standardwebhooks`` library:
``Webhook("whsec_...")``, or ``Webhook(secret.encode())`` for a free-form secret. The service signs with its own
few lines (``standard_signature``) rather than the library's ``Webhook.sign``, which takes the body as ``str``: a job
view of tens of MiB would be decoded and encoded again at every attempt. ``tests/unit/test_callbacks.py`` holds the
two to each other (the library's ``verify``) and to the vector the specification's libraries publish.

Deprecated (kept for one release, still correct): ``X-PTC-Signature: t=<unix seconds>,v1=<hex>`` where
``hex = HMAC-SHA256(secret, f"{t}." + body)`` keyed with the secret's text as configured (UTF-8, ``whsec_``
prefix and all), the scheme Stripe documents for its webhooks; one ``v1=`` per secret while a secret is
rotated. The same timestamp is also sent alone in ``X-PTC-Timestamp``.

Delivery: an attempt succeeds on any 2xx answer; otherwise (another status,
a timeout, a refused connection) it is retried with exponential backoff
(tenacity), at most ``max_attempts`` times in all. ``timeout_s`` bounds each
whole attempt; the receiver's response body is never read. Each attempt is
reported to ``on_attempt`` so that the job view can show it. A ``callback_url`` the
egress rules refuse (``service.egress``) is not retried: its one attempt records
``egress_denied: ...`` and nothing is sent.

Tenants: the body (the job view) names the job's ``owner`` (the API key's name),
also sent, unsigned, in ``X-PTC-Owner`` so that a receiver shared by several keys
can pick the secret to verify with. A key with an entry in ``PTC_CALLBACK_SECRETS``
(``name:secret,...``) or ``PTC_CALLBACK_SECRETS_FILE`` gets its jobs' callbacks
signed with that secret; the others with ``PTC_CALLBACK_SECRET``. So a key cannot
obtain a validly signed callback that claims another tenant: the owner in the body
is the submitting key, and a receiver holding its own secret refuses anyone else's.

Rotation: each of those settings' secrets may be two (or more), separated by spaces (``new old``, as the
signature header itself separates them): every callback is then signed with each.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential

from service.egress import EgressDenied, EgressPolicy
from service.errors import InsecureConfig
from service.settings import Settings
from service.tenancy import named_entries

WEBHOOK_ID_HEADER = "webhook-id"
WEBHOOK_TIMESTAMP_HEADER = "webhook-timestamp"
WEBHOOK_SIGNATURE_HEADER = "webhook-signature"
SIGNATURE_HEADER = "X-PTC-Signature"  # deprecated: see the module's docstring
TIMESTAMP_HEADER = "X-PTC-Timestamp"  # deprecated
OWNER_HEADER = "X-PTC-Owner"
MAX_BACKOFF_S = 60.0
SECRET_PREFIX = "whsec_"
MIN_KEY_BYTES = 24  # the specification's least size of a symmetric secret


@dataclass(frozen=True)
class CallbackSecret:
    """One secret that signs callbacks.

    Attributes:
        text: the secret as configured, UTF-8: the key of the deprecated ``X-PTC-Signature``.
        key: the HMAC key of ``webhook-signature``: what a ``whsec_`` secret's base64 decodes to, else ``text``.
    """

    text: bytes
    key: bytes

    def __repr__(self) -> str:  # never a secret in a log or a traceback
        return "CallbackSecret(...)"

    @classmethod
    def parse(cls, secret: str) -> CallbackSecret:
        """The secret written ``secret`` (``whsec_<base64>``, or free-form text).

        Raises:
            ValueError: a ``whsec_`` secret whose rest is not base64 (padding may be left out) or decodes to fewer
                than 24 bytes (the message never contains the secret).
        """
        if not secret.startswith(SECRET_PREFIX):
            return cls(secret.encode(), secret.encode())
        encoded = secret[len(SECRET_PREFIX) :]
        try:  # the reference library pads too (a whsec_ secret's base64 often comes without its '=')
            key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret is not base64 after its prefix") from None
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a whsec_ secret decodes to {len(key)} bytes, fewer than {MIN_KEY_BYTES}")
        return cls(secret.encode(), key)


Secrets = tuple[CallbackSecret, ...]
"""The secrets of one owner, newest first: one, or more while a secret is rotated."""


def parse_secret_list(value: str) -> Secrets:
    """The secrets of one setting's value, separated by whitespace (``new old`` while rotating).

    Raises:
        ValueError: no secret, one ``CallbackSecret.parse`` refuses, or several free-form ones of which one is
            shorter than ``MIN_KEY_BYTES`` (a passphrase with spaces, taken whole before rotation came); never
            echoes a secret.
    """
    found = tuple(CallbackSecret.parse(part) for part in value.split())
    if not found:
        raise ValueError("an empty callback secret")
    free_form = [s for s in found if s.text == s.key]
    if len(free_form) > 1 and any(len(s.text) < MIN_KEY_BYTES for s in free_form):
        # The releases before took a secret whole, spaces and all: a passphrase ("correct horse battery staple")
        # would now sign with each word alone, its X-PTC-Signature no longer the one receivers check, and each
        # word's HMAC in every callback an oracle for a dictionary search, word by word.
        raise ValueError(
            f"several free-form secrets separated by spaces, one shorter than {MIN_KEY_BYTES} bytes: a secret "
            "holds no spaces (a passphrase would be split into words); rotate to a whsec_ secret"
        )
    return found


def message_id(job_id: str) -> str:
    """The ``webhook-id`` of ``job_id``'s callback: ``msg_<job id>`` (one message per job end, so per job)."""
    return f"msg_{job_id}"


def standard_signature(keys: Sequence[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<base64>`` per key, space-separated, in the order of ``keys``.

    Each is the base64 of HMAC-SHA256(key, ``f"{msg_id}.{timestamp}."`` + ``body``), ``timestamp`` in unix seconds
    (Standard Webhooks 1.0.0, "Signature scheme").

    Raises:
        ValueError: ``msg_id`` holds a ``.`` (the specification's warning: it would make the signed text ambiguous).
    """
    if "." in msg_id:
        raise ValueError("a webhook-id may not contain '.'")
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join("v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode() for key in keys)


def sign(secret: bytes | Sequence[bytes], timestamp: int, body: bytes) -> str:
    """The deprecated ``X-PTC-Signature`` value for ``body`` sent at ``timestamp`` (unix seconds).

    ``t=<timestamp>,v1=<hex>``, one ``v1=`` per secret when ``secret`` is several (in their order).
    """
    keys = [secret] if isinstance(secret, bytes) else list(secret)
    signed = f"{timestamp}.".encode() + body
    return ",".join([f"t={timestamp}", *(f"v1={hmac.new(k, signed, hashlib.sha256).hexdigest()}" for k in keys)])


def verify(secret: bytes | str, header: str, body: bytes, tolerance_s: float = 300) -> bool:
    """Check a (deprecated) ``X-PTC-Signature`` header (constant-time); False when wrong or older than ``tolerance_s``.

    ``secret`` is the job's key's ``PTC_CALLBACK_SECRETS`` entry, else ``PTC_CALLBACK_SECRET`` (str, UTF-8,
    or its bytes; while rotating, either one of the two); ``body`` the raw request body (check its ``owner`` too).
    Any of the header's ``v1=`` may match.
    """
    if isinstance(secret, str):
        secret = secret.encode()
    try:
        fields = [part.split("=", 1) for part in header.split(",")]
        (timestamp,) = (int(value) for name, value in fields if name == "t")
        signatures = [value.encode() for name, value in fields if name == "v1"]
    except ValueError:
        return False
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body).split("=", 2)[2].encode()
    return any(hmac.compare_digest(expected, signature) for signature in signatures)


class CallbackSecrets:
    """The secrets callbacks are signed with: one set per API key name, and the server's for the rest.

    Args:
        default: ``PTC_CALLBACK_SECRET``'s secrets, or None.
        per_owner: key name -> its own secrets.
    """

    def __init__(self, default: Secrets | None, per_owner: dict[str, Secrets]) -> None:
        self._default = default
        self._per_owner = per_owner

    def for_owner(self, owner: str | None) -> Secrets | None:
        """The secrets that sign callbacks of ``owner``'s jobs, newest first (None: callbacks cannot be sent)."""
        return self._per_owner.get(owner or "", self._default)


@dataclass(frozen=True)
class CallbackPolicy:
    """What sending a job's callback takes: checked at admission (``jobs.admission.Intake``), used by each delivery
    (``jobs.webhooks.Webhooks``).

    Attributes:
        secrets: the secrets per owner: a callback of an owner without any cannot be sent.
        egress: the rules a ``callback_url`` and each delivery's connection pass (those of tool endpoints).
        single_tenant: one tenant (``tenancy.single_tenant``): its callbacks may take every delivery slot, not one
            owner's share.
    """

    secrets: CallbackSecrets
    egress: EgressPolicy
    single_tenant: bool = False


def parse_secrets(text: str, source: str) -> dict[str, Secrets]:
    """Parse ``name:secret`` entries separated by commas or newlines (``#`` starts a comment line).

    An entry's secret may be several separated by spaces (``name:new old`` while rotating).

    Raises:
        ValueError: an entry is malformed, empty, names a key twice, or holds a ``whsec_`` secret that is not
            one (names ``source`` and the key, never a secret).
    """
    found: dict[str, Secrets] = {}
    for name, secret in named_entries(text, source, "secret"):
        if name in found:
            raise ValueError(f"{source}: key {name!r} has two callback secrets")
        try:
            found[name] = parse_secret_list(secret)
        except ValueError as exc:
            raise ValueError(f"{source}: key {name!r}: {exc}") from None
    return found


def load_secrets(settings: Settings) -> CallbackSecrets:
    """The callback secrets of ``settings`` (``PTC_CALLBACK_SECRET``, ``PTC_CALLBACK_SECRETS`` and its file).

    Raises:
        InsecureConfig: an entry is malformed, a key has two entries, a ``whsec_`` secret is not one, or the
            file cannot be read.
    """
    per_owner: dict[str, Secrets] = {}
    default: Secrets | None = None
    try:
        if settings.callback_secrets is not None:
            per_owner.update(parse_secrets(settings.callback_secrets.get_secret_value(), "PTC_CALLBACK_SECRETS"))
        if settings.callback_secrets_file is not None:
            source = f"PTC_CALLBACK_SECRETS_FILE ({settings.callback_secrets_file})"
            more = parse_secrets(settings.callback_secrets_file.read_text(), source)
            if twice := sorted(set(more) & set(per_owner)):
                raise ValueError(f"{source}: key {twice[0]!r} has a secret in PTC_CALLBACK_SECRETS too")
            per_owner.update(more)
        if settings.callback_secret is not None:
            try:
                default = parse_secret_list(settings.callback_secret.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"PTC_CALLBACK_SECRET: {exc}") from None
    except (OSError, ValueError) as exc:
        raise InsecureConfig(str(exc)) from exc
    return CallbackSecrets(default, per_owner)


def signed_headers(secrets: Secrets, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The signature headers of one attempt: Standard Webhooks' three, and the deprecated two.

    Args:
        secrets: the job's owner's secrets, newest first.
        msg_id: the message's ``webhook-id`` (``message_id``).
        timestamp: the attempt's time, unix seconds.
        body: the raw body sent.
    """
    return {
        WEBHOOK_ID_HEADER: msg_id,
        WEBHOOK_TIMESTAMP_HEADER: str(timestamp),
        WEBHOOK_SIGNATURE_HEADER: standard_signature([s.key for s in secrets], msg_id, timestamp, body),
        SIGNATURE_HEADER: sign([s.text for s in secrets], timestamp, body),
        TIMESTAMP_HEADER: str(timestamp),
    }


class _NotDelivered(Exception):
    pass


async def deliver(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    secrets: Secrets,
    *,
    msg_id: str,
    max_attempts: int,
    backoff_s: float,
    timeout_s: float,
    on_attempt: Callable[[dict[str, Any]], None],
    owner: str | None = None,
    trace_headers: Mapping[str, str] | None = None,
    before_attempt: Callable[[], None] | None = None,
) -> bool:
    """POST ``body`` to ``url`` until a 2xx answer or ``max_attempts`` attempts; returns whether it was delivered.

    Every attempt carries ``msg_id`` in ``webhook-id`` and is signed anew with each of ``secrets``;
    ``on_attempt`` receives ``{"at", "status_code", "error", "duration_ms"}`` after every attempt;
    ``owner`` (the job's, as in the body) is sent in ``X-PTC-Owner``; ``trace_headers`` (the job's W3C
    ``traceparent``, ``observability.telemetry.inject``) with every attempt. ``before_attempt`` is called before each
    attempt (the claimer's lease check): what it raises ends the delivery at once, unsent, and propagates.
    """
    retrying = AsyncRetrying(
        stop=stop_after_attempt(max_attempts),
        wait=wait_exponential(multiplier=backoff_s, max=MAX_BACKOFF_S),
        retry=retry_if_exception_type(_NotDelivered),
    )
    try:
        async for attempt in retrying:
            if before_attempt is not None:
                before_attempt()
            with attempt:
                await _attempt(client, url, body, secrets, msg_id, timeout_s, on_attempt, owner, trace_headers or {})
    except RetryError:
        return False
    except EgressDenied:
        return False
    return True


async def _attempt(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    secrets: Secrets,
    msg_id: str,
    timeout_s: float,
    on_attempt: Callable[[dict[str, Any]], None],
    owner: str | None,
    trace_headers: Mapping[str, str],
) -> None:
    headers = {
        "content-type": "application/json",
        **trace_headers,
        **signed_headers(secrets, msg_id, int(time.time()), body),
    }
    if owner is not None:
        headers[OWNER_HEADER] = owner
    record: dict[str, Any] = {"at": datetime.now(UTC), "status_code": None, "error": None}
    started = time.perf_counter()
    try:
        # The receiver's body is never read, and timeout_s bounds the whole attempt, not each read.
        async with asyncio.timeout(timeout_s), client.stream("POST", url, content=body, headers=headers) as response:
            record["status_code"] = response.status_code
        if not 200 <= response.status_code < 300:
            record["error"] = f"HTTP {response.status_code}"
    except EgressDenied as exc:
        record["error"] = f"egress_denied: {exc}"
        record["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
        on_attempt(record)
        raise
    except TimeoutError:
        record["error"] = f"no answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        record["error"] = f"{type(exc).__name__}"
    record["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
    on_attempt(record)
    if record["error"] is not None:
        raise _NotDelivered(record["error"])
