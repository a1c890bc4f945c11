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
- Concurrency (``IdempotencyKeys.claim``): the first request with a key claims it in the store (a ``claimed``
  row with a random token and this replica's incarnation), on every replica sharing the store; the same key
  arriving meanwhile, on any replica, waits up to ``IN_FLIGHT_WAIT_S`` for the claim to be bound (then it
  replays the binding) or released (then it claims the key itself), else answers ``IdempotencyKeyInFlight``
  (409, ``Retry-After``). It is woken by the ``ptc_keys`` notification of the bind or release (PostgreSQL;
  ``wake_digest``, from ``service/replicas/notify.py``'s listener), by this replica's own, and reads the row every
  ``POLL_S`` regardless. A claim never expires by time while its replica lives (a slow session creation never
  makes two sessions); a claim of a replica that died (no longer live or draining, or its lease passed) is taken
  over by the next request with the key (docs/scaling.md, Idempotency keys).

Claims and bindings live in the job store and go with its retention (``JobRecords.purge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

from service.errors import IdempotencyKeyInFlight, IdempotencyKeyReused, InvalidField
from service.store import IdempotencyRecord, Incarnation, JobStore, KeyClaim, key_digest

log = logging.getLogger(__name__)

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on an answer that replays the key's first request
MAX_KEY_LENGTH = 255
IN_FLIGHT_WAIT_S = 10.0  # how long a repeat waits for the key's first request to be admitted, then 409
IN_FLIGHT_RETRY_AFTER_S = 1
POLL_S = 1.0  # how often a repeat waiting on a claim reads its row, notifications or not (s)
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
        token: the claim's ``claim_token`` in the store.
    """

    owner: str
    key: str
    fingerprint: str
    token: str
    _keys: IdempotencyKeys
    _ended: bool = False

    async def bind(self, kind: Kind, resource_id: str, created_at: datetime, ends_by: datetime | None = None) -> None:
        """Bind the key to the job or session the request created (saved in the store), which ends the claim.

        A claim taken over meanwhile (this incarnation's lease passed, so another replica may have admitted the
        key's request again) binds nothing: logged, the request still answers with what it created.
        """
        record = IdempotencyRecord(self.owner, self.key, self.fingerprint, kind, resource_id, created_at, ends_by)
        self._ended = True
        try:  # shielded: a request cancelled now (its client left) still binds what it created
            bound = await asyncio.shield(self._keys.store.keys.bind_claim(record, self.token))
        finally:
            self._keys.wake(self.owner, self.key)  # this replica's waiters; the others' by ptc_keys
        # Not bound for an error: the token stays held, so the claim blocks the key (409) until this incarnation
        # ends: a retry must not make a second job beside the one created.
        self._keys.held.discard(self.token)
        if not bound:
            log.warning("an idempotency claim was taken over before its %s %s was bound", kind, resource_id)

    def release(self) -> None:
        """Let the key go without a binding (the request failed before creating anything); idempotent. The
        store's row is deleted in the background (a failure is logged: the row is then an orphan, which this
        replica's next request with the key takes over)."""
        if self._ended:
            return
        self._ended = True
        self._keys.release_later(self.owner, self.key, self.token)


class IdempotencyKeys:
    """Bindings of idempotency keys and the claims of keys being admitted now, both in ``store``.

    Args:
        store: the job store, which keeps claims and bindings (shared by the replicas on PostgreSQL).
        incarnation: this replica's (``Replicas.incarnation``): the claims it makes carry it.
        wait_s: how long a repeat waits for an in-flight first request (s).
        poll_s: how often a waiting repeat reads the row even without a notification (s).
    """

    def __init__(
        self, store: JobStore, incarnation: Incarnation, wait_s: float = IN_FLIGHT_WAIT_S, poll_s: float = POLL_S
    ) -> None:
        self.store = store
        self.incarnation = incarnation
        self.wait_s = wait_s
        self.poll_s = poll_s
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self._releases: set[asyncio.Task[None]] = set()
        self.held: set[str] = set()
        """Tokens of the claims this process's requests hold or are making: a claim of this incarnation whose
        token is not here is an orphan (its write answered too late, or its release failed) and is taken over."""

    async def claim(self, owner: str, key: str, fingerprint_: str, kind: Kind) -> Claim | IdempotencyRecord:
        """Claim ``key`` of ``owner`` for a request of this fingerprint, or find its binding.

        The claim is a ``claimed`` row in the store (``KeyBindings.claim``), so two replicas given the
        same key (a client retrying through the balancer) admit one request. A repeat that finds the key claimed by
        a live incarnation waits: woken when that claim is bound or released (``wake``: by this replica, or by a
        ``ptc_keys`` notification), and reading the row every ``poll_s`` regardless.

        Returns:
            A ``Claim`` the caller must ``bind`` or ``release`` (the key is new, its first request failed, or its
            claimer died), or the ``IdempotencyRecord`` of the key's first request (replay it).

        Raises:
            IdempotencyKeyReused: the key is bound for a request of another fingerprint or kind.
            IdempotencyKeyInFlight: its first request has not been admitted within ``wait_s`` (409).
            StoreUnavailable: the store did not answer.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        with self._waiter(owner, key) as woken:  # before the first read: no wake-up is missed
            while True:
                woken.clear()
                mine = KeyClaim(owner, key, fingerprint_, kind, secrets.token_hex(16), self.incarnation)
                held = await self._claim(mine)
                if isinstance(held, KeyClaim) and held.claimed_by == self.incarnation and held != mine:
                    if held.claim_token not in self.held:  # an orphan of this process: nobody binds it
                        held = await self._claim(mine, orphan=held.claim_token)
                if held == mine:
                    return Claim(owner, key, fingerprint_, mine.claim_token, self)
                self.held.discard(mine.claim_token)
                if isinstance(held, IdempotencyRecord):
                    if held.fingerprint != fingerprint_ or held.kind != kind:
                        raise IdempotencyKeyReused(key)
                    return held
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise IdempotencyKeyInFlight(IN_FLIGHT_RETRY_AFTER_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(remaining, self.poll_s))

    async def _claim(self, mine: KeyClaim, orphan: str | None = None) -> IdempotencyRecord | KeyClaim:
        """``store.keys.claim``, shielded: when the caller is cancelled meanwhile (its client left), a
        claim the store made is released once its answer comes (a claim nobody holds would block the key). Its
        token is ``held`` from before the write until the claim ends (or the write failed)."""
        self.held.add(mine.claim_token)
        task = asyncio.ensure_future(self.store.keys.claim(mine, datetime.now(UTC), orphan))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def made(done: asyncio.Future[IdempotencyRecord | KeyClaim]) -> None:
                if not done.cancelled() and done.exception() is None and done.result() == mine:
                    self.release_later(mine.owner, mine.key, mine.claim_token)
                else:
                    self.held.discard(mine.claim_token)

            task.add_done_callback(made)
            raise
        except BaseException:  # the write may still land (a store timeout): an orphan then, taken over
            self.held.discard(mine.claim_token)
            raise

    def release_later(self, owner: str, key: str, token: str) -> None:
        """Release the claim ``token`` of ``key`` in the background (``KeyBindings.release``), then wake this
        replica's waiters on the key."""

        async def release() -> None:
            try:
                await self.store.keys.release(owner, key, token)
            except Exception:  # logged: an orphan then, taken over by this replica's next request with the key
                log.warning("an idempotency claim could not be released", exc_info=True)
            finally:
                self.held.discard(token)
                self.wake(owner, key)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def drain(self) -> None:
        """Wait for the releases under way (tests; shutdown)."""
        while self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    @contextlib.contextmanager
    def _waiter(self, owner: str, key: str) -> Iterator[asyncio.Event]:
        """An event set by ``wake`` of this key (or ``wake_digest`` of its digest) while the block runs."""
        digest = key_digest(owner, key)
        event = asyncio.Event()
        self._waiting.setdefault(digest, set()).add(event)
        try:
            yield event
        finally:
            events = self._waiting.get(digest)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[digest]

    def wake(self, owner: str, key: str) -> None:
        """Wake this replica's requests waiting on ``key`` of ``owner`` (its claim was bound or released)."""
        self.wake_digest(key_digest(owner, key))

    def wake_digest(self, digest: str) -> None:
        """Wake the requests waiting on the key of this ``key_digest`` (a ``ptc_keys`` notification's payload;
        an unknown one costs one dictionary lookup)."""
        for event in self._waiting.get(digest, ()):
            event.set()

    def __len__(self) -> int:
        """Requests waiting on a key now."""
        return sum(len(events) for events in self._waiting.values())
