"""Completion callbacks: the final job view POSTed to the job's ``callback_url``, signed, retried.

Signature (header ``X-PTC-Signature``): ``t=<unix seconds>,v1=<hex>`` where
``hex = HMAC-SHA256(secret, f"{t}." + body)``, the scheme Stripe documents for
its webhooks (https://docs.stripe.com/webhooks#verify-manually). A receiver
recomputes it over the raw body and rejects stale timestamps. The same
timestamp is also sent alone in ``X-PTC-Timestamp``.

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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential

from service.auth import named_entries
from service.egress import EgressDenied
from service.errors import InsecureConfig
from service.settings import Settings

SIGNATURE_HEADER = "X-PTC-Signature"
TIMESTAMP_HEADER = "X-PTC-Timestamp"
OWNER_HEADER = "X-PTC-Owner"
MAX_BACKOFF_S = 60.0


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``X-PTC-Signature`` value for ``body`` sent at ``timestamp`` (unix seconds)."""
    digest = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: bytes | str, header: str, body: bytes, tolerance_s: float = 300) -> bool:
    """Check an ``X-PTC-Signature`` header (constant-time); False when wrong or older than ``tolerance_s``.

    ``secret`` is the job's key's ``PTC_CALLBACK_SECRETS`` entry, else ``PTC_CALLBACK_SECRET`` (str, UTF-8,
    or its bytes); ``body`` the raw request body (check its ``owner`` too).
    """
    if isinstance(secret, str):
        secret = secret.encode()
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
    except (ValueError, KeyError):
        return False
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), header)


class CallbackSecrets:
    """The keys callbacks are signed with: one per API key name, and the server's for the rest.

    Args:
        default: ``PTC_CALLBACK_SECRET`` (bytes), or None.
        per_owner: key name -> its own secret.
    """

    def __init__(self, default: bytes | None, per_owner: dict[str, bytes]) -> None:
        self._default = default
        self._per_owner = per_owner

    def for_owner(self, owner: str | None) -> bytes | None:
        """The secret that signs callbacks of ``owner``'s jobs (None: callbacks cannot be sent)."""
        return self._per_owner.get(owner or "", self._default)


def parse_secrets(text: str, source: str) -> dict[str, bytes]:
    """Parse ``name:secret`` entries separated by commas or newlines (``#`` starts a comment line).

    Raises:
        ValueError: an entry is malformed, empty, or names a key twice (names ``source`` and the key, never a secret).
    """
    found: dict[str, bytes] = {}
    for name, secret in named_entries(text, source, "secret"):
        if name in found:
            raise ValueError(f"{source}: key {name!r} has two callback secrets")
        found[name] = secret.encode()
    return found


def load_secrets(settings: Settings) -> CallbackSecrets:
    """The callback secrets of ``settings`` (``PTC_CALLBACK_SECRET``, ``PTC_CALLBACK_SECRETS`` and its file).

    Raises:
        InsecureConfig: an entry is malformed, a key has two secrets, or the file cannot be read.
    """
    per_owner: dict[str, bytes] = {}
    try:
        if settings.callback_secrets is not None:
            per_owner.update(parse_secrets(settings.callback_secrets.get_secret_value(), "PTC_CALLBACK_SECRETS"))
        if settings.callback_secrets_file is not None:
            source = f"PTC_CALLBACK_SECRETS_FILE ({settings.callback_secrets_file})"
            more = parse_secrets(settings.callback_secrets_file.read_text(), source)
            if twice := sorted(set(more) & set(per_owner)):
                raise ValueError(f"{source}: key {twice[0]!r} has a secret in PTC_CALLBACK_SECRETS too")
            per_owner.update(more)
    except (OSError, ValueError) as exc:
        raise InsecureConfig(str(exc)) from exc
    default = settings.callback_secret.get_secret_value().encode() if settings.callback_secret is not None else None
    return CallbackSecrets(default, per_owner)


class _NotDelivered(Exception):
    pass


async def deliver(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    secret: bytes,
    *,
    max_attempts: int,
    backoff_s: float,
    timeout_s: float,
    on_attempt: Callable[[dict[str, Any]], None],
    owner: str | None = None,
) -> bool:
    """POST ``body`` to ``url`` until a 2xx answer or ``max_attempts`` attempts; returns whether it was delivered.

    ``on_attempt`` receives ``{"at", "status_code", "error", "duration_ms"}`` after every attempt;
    ``owner`` (the job's, as in the body) is sent in ``X-PTC-Owner``.
    """
    retrying = AsyncRetrying(
        stop=stop_after_attempt(max_attempts),
        wait=wait_exponential(multiplier=backoff_s, max=MAX_BACKOFF_S),
        retry=retry_if_exception_type(_NotDelivered),
    )
    try:
        async for attempt in retrying:
            with attempt:
                await _attempt(client, url, body, secret, timeout_s, on_attempt, owner)
    except RetryError:
        return False
    except EgressDenied:
        return False
    return True


async def _attempt(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    secret: bytes,
    timeout_s: float,
    on_attempt: Callable[[dict[str, Any]], None],
    owner: str | None,
) -> None:
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        SIGNATURE_HEADER: sign(secret, timestamp, body),
        TIMESTAMP_HEADER: str(timestamp),
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
