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

from service.egress import EgressDenied

SIGNATURE_HEADER = "X-PTC-Signature"
TIMESTAMP_HEADER = "X-PTC-Timestamp"
MAX_BACKOFF_S = 60.0


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``X-PTC-Signature`` value for ``body`` sent at ``timestamp`` (unix seconds)."""
    digest = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: bytes | str, header: str, body: bytes, tolerance_s: float = 300) -> bool:
    """Check an ``X-PTC-Signature`` header (constant-time); False when wrong or older than ``tolerance_s``.

    ``secret`` is ``PTC_CALLBACK_SECRET`` (str, UTF-8) or its bytes; ``body`` the raw request body.
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
) -> bool:
    """POST ``body`` to ``url`` until a 2xx answer or ``max_attempts`` attempts; returns whether it was delivered.

    ``on_attempt`` receives ``{"at", "status_code", "error", "duration_ms"}`` after every attempt.
    """
    retrying = AsyncRetrying(
        stop=stop_after_attempt(max_attempts),
        wait=wait_exponential(multiplier=backoff_s, max=MAX_BACKOFF_S),
        retry=retry_if_exception_type(_NotDelivered),
    )
    try:
        async for attempt in retrying:
            with attempt:
                await _attempt(client, url, body, secret, timeout_s, on_attempt)
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
) -> None:
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        SIGNATURE_HEADER: sign(secret, timestamp, body),
        TIMESTAMP_HEADER: str(timestamp),
    }
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
