"""Idempotency keys: the ``Idempotency-Key`` request header of ``POST /execute`` and ``POST /sessions``.

The header follows the IETF HTTPAPI draft (draft-ietf-httpapi-idempotency-key-header) with the semantics of the
large payment APIs: a client that retries a request it may already have sent sends the same key, and the
service creates at most one job (or session) per key.

- A key is 1 to 255 printable ASCII characters (``parse_key``), scoped to the caller's API key (its owner):
  bindings are looked up by (owner, key), so another API key's same key is another binding.
- The binding (``store.IdempotencyRecord``) holds the job or session the key's first request created and the
  request's ``fingerprint``: SHA-256 over the route, the query parameters that change what is done (none today:
  ``FINGERPRINT_QUERY``) and the canonical JSON of the body (``canonical_digest``: keys sorted, no whitespace,
  integers exact), so the same request written differently is the same request.
- A request that fails before it creates anything (a 4xx, a 429, a 503 before a job or session exists) binds
  nothing: a retry may succeed.
- Concurrency (``IdempotencyKeys.claim``): the first request with a key claims it in memory before any await;
  the same key arriving meanwhile waits up to ``IN_FLIGHT_WAIT_S`` for the claim to be bound (then it replays
  the binding) or released (then it claims the key itself), else answers ``IdempotencyKeyInFlight`` (409,
  ``Retry-After``). One service instance holds a work dir (``workdir.py``), so an in-memory claim is enough.

Bindings live in the job store and go with its retention (``JobStore.purge``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import orjson

from service.errors import IdempotencyKeyInFlight, IdempotencyKeyReused, InvalidField
from service.store import IdempotencyRecord, JobStore

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on an answer that replays the key's first request
MAX_KEY_LENGTH = 255
IN_FLIGHT_WAIT_S = 10.0  # how long a repeat waits for the key's first request to be admitted, then 409
IN_FLIGHT_RETRY_AFTER_S = 1
FINGERPRINT_QUERY: dict[str, tuple[str, ...]] = {
    "/execute": (),
    "/sessions": (),
}
"""Per route, the query parameters that change what is done (part of the fingerprint). View parameters, which
shape only the answer, are not: a replay may ask for another view of the same job."""

Kind = Literal["job", "session"]


def parse_key(value: str | None) -> str | None:
    """The ``Idempotency-Key`` header's value, or None when the request has none.

    Raises:
        InvalidField: empty, longer than ``MAX_KEY_LENGTH`` characters, or a character outside printable ASCII
            (0x20 to 0x7E); ``loc`` is ``("header", "Idempotency-Key")`` (a 422 ``invalid-request``).
    """
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise InvalidField(f"must be 1 to {MAX_KEY_LENGTH} characters long", ("header", KEY_HEADER))
    if not all(" " <= char <= "~" for char in value):
        raise InvalidField("must be printable ASCII characters only", ("header", KEY_HEADER))
    return value


def canonical_json(value: Any) -> bytes:
    """A parsed JSON value written one way: object keys sorted, no whitespace, UTF-8, integers exact, and the
    stdlib's ``NaN``, ``Infinity`` and ``-Infinity`` (which its reader takes) written as such, never as ``null``.

    Raises:
        ValueError: not representable as JSON (cannot happen for a value parsed from a request body).
    """
    try:
        written = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # an integer past 64 bits: the stdlib writes it exactly
        return _stdlib_json(value)
    if b"null" in written and _has_non_finite(value):  # orjson writes NaN and infinities as null
        return _stdlib_json(value)
    return written


def _stdlib_json(value: Any) -> bytes:
    """``canonical_json`` by the stdlib: exact integers, and non-finite floats apart from ``null`` and each other."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not representable as JSON: {exc}") from None
    return text.encode("utf-8", "surrogatepass")


def _has_non_finite(value: Any) -> bool:
    """Whether a parsed JSON value holds a NaN or an infinity anywhere (iteratively: no recursion limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def canonical_digest(value: Any) -> bytes:
    """SHA-256 (32 bytes) of ``canonical_json(value)``; blocking (about 2 ms per MiB): run it off the loop."""
    return hashlib.sha256(canonical_json(value)).digest()


def fingerprint(route: str, query: Iterable[tuple[str, str]], body_digest: bytes) -> str:
    """The request's fingerprint (SHA-256, hex): ``route`` (e.g. ``POST /execute``), the query parameters of
    ``FINGERPRINT_QUERY`` (sorted), and the digest of the body's canonical JSON."""
    hasher = hashlib.sha256()
    hasher.update(route.encode() + b"\n")
    hasher.update(orjson.dumps(sorted(query)) + b"\n")
    hasher.update(body_digest)
    return hasher.hexdigest()


@dataclass
class Claim:
    """A key claimed by the request now being admitted; ``bind`` it to what it created, or ``release`` it.

    Attributes:
        owner / key / fingerprint: the request's.
    """

    owner: str
    key: str
    fingerprint: str
    _keys: IdempotencyKeys
    _done: asyncio.Event

    async def bind(self, kind: Kind, resource_id: str, created_at: datetime, ends_by: datetime | None = None) -> None:
        """Bind the key to the job or session the request created (saved in the store), then release the claim."""
        record = IdempotencyRecord(self.owner, self.key, self.fingerprint, kind, resource_id, created_at, ends_by)
        try:  # shielded: a request cancelled now (its client left) still binds what it created
            await asyncio.shield(self._keys.store.bind_idempotency_key(record))
        finally:
            self.release()  # a repeat's lookup runs on the store's one thread after this write

    def release(self) -> None:
        """Let the key go without a binding (the request failed before creating anything); idempotent."""
        if self._keys.in_flight.get((self.owner, self.key)) is self._done:
            del self._keys.in_flight[(self.owner, self.key)]
        self._done.set()


class IdempotencyKeys:
    """Bindings of idempotency keys (in ``store``) and the keys being admitted now (in memory).

    Args:
        store: the job store, which keeps the bindings.
        wait_s: how long a repeat waits for an in-flight first request (s).
    """

    def __init__(self, store: JobStore, wait_s: float = IN_FLIGHT_WAIT_S) -> None:
        self.store = store
        self.wait_s = wait_s
        self.in_flight: dict[tuple[str, str], asyncio.Event] = {}

    async def claim(self, owner: str, key: str, fingerprint_: str, kind: Kind) -> Claim | IdempotencyRecord:
        """Claim ``key`` of ``owner`` for a request of this fingerprint, or find its binding.

        Returns:
            A ``Claim`` the caller must ``bind`` or ``release`` (the key is new, or its first request failed),
            or the ``IdempotencyRecord`` of the key's first request (replay it).

        Raises:
            IdempotencyKeyReused: the key is bound (or claimed) for a request of another fingerprint or kind.
            IdempotencyKeyInFlight: its first request has not been admitted within ``wait_s`` (409).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while True:
            pending = self.in_flight.get((owner, key))
            if pending is None:
                done = asyncio.Event()
                self.in_flight[(owner, key)] = done  # before any await: one claim per (owner, key) at a time
                claim = Claim(owner, key, fingerprint_, self, done)
                try:
                    record = await self.store.idempotency_key(owner, key)
                except BaseException:
                    claim.release()
                    raise
                if record is None:
                    return claim
                claim.release()
                if record.fingerprint != fingerprint_ or record.kind != kind:
                    raise IdempotencyKeyReused(key)
                return record
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise IdempotencyKeyInFlight(IN_FLIGHT_RETRY_AFTER_S)
            try:
                await asyncio.wait_for(pending.wait(), remaining)
            except TimeoutError:
                raise IdempotencyKeyInFlight(IN_FLIGHT_RETRY_AFTER_S) from None
