"""Idempotency keys (table ``idempotency_keys``; docs/scaling.md, Idempotency keys; ``service.idempotency``).

One row per (owner, key): ``claimed`` by the request being admitted with it, then ``bound`` to the job or session
that request created. A job's row is deleted with the job (``JobRecords.purge``), a session's once the session
has ended (at the latest) before the retention's cutoff. A key never holds more than one row, and a row one
resource, so an owner's keys are at most its jobs and sessions within the retention.

``KeyBindings`` is the resource's interface; ``sqlite_keys`` and ``pg_keys`` implement it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from service.store.registry import Incarnation


@dataclass(frozen=True)
class IdempotencyRecord:
    """One ``Idempotency-Key`` bound to what its first request created (``service.idempotency``).

    Attributes:
        owner: the API key name that sent it; keys are looked up by (owner, key), never by key alone.
        key: the ``Idempotency-Key`` header's value (1 to 255 printable ASCII characters).
        fingerprint: SHA-256 (hex) of the request's route and canonical body (``idempotency.fingerprint``).
        kind: ``job`` or ``session``.
        resource_id: the job's or the session's id.
        created_at: UTC time of the binding.
        ends_by: for a session, the latest time it can end (created + ``max_lifetime_s``); None for a job,
            whose key is deleted with the job's record.
    """

    owner: str
    key: str
    fingerprint: str
    kind: str
    resource_id: str
    created_at: datetime
    ends_by: datetime | None = None


@dataclass(frozen=True)
class KeyClaim:
    """An ``Idempotency-Key`` claimed by the request being admitted with it (``KeyBindings.claim``): the
    ``claimed`` row of ``idempotency_keys``.

    Attributes:
        owner / key / fingerprint / kind: as in ``IdempotencyRecord``.
        claim_token: 32 random hex digits naming this claim: only its holder binds or releases it.
        claimed_by: the incarnation admitting the request; a claim of an incarnation no longer live (or whose
            lease passed) is taken over by the next claim of the key.
    """

    owner: str
    key: str
    fingerprint: str
    kind: str
    claim_token: str
    claimed_by: Incarnation


def key_digest(owner: str, key: str) -> str:
    """The ``ptc_keys`` notification's payload for ``key`` of ``owner``: 16 hex digits of SHA-256 over both
    (JSON, so no two pairs write alike); neither the key nor its owner can be read from it."""
    return hashlib.sha256(json.dumps([owner, key]).encode()).hexdigest()[:16]


def held_key(
    owner: str,
    key: str,
    fingerprint: str,
    kind: str,
    resource_id: str | None,
    created_at: str,
    ends_by: str | None,
    state: str,
    claim_token: str | None,
    claimed_by: str | None,
    claimed_epoch: int | None,
) -> IdempotencyRecord | KeyClaim:
    """A row of ``idempotency_keys`` (times as ISO text, as both stores keep them): its binding, or its claim."""
    if state == "bound":
        made = datetime.fromisoformat(created_at)
        ends = datetime.fromisoformat(ends_by) if ends_by else None
        return IdempotencyRecord(owner, key, fingerprint, kind, str(resource_id), made, ends)
    return KeyClaim(
        owner, key, fingerprint, kind, str(claim_token), Incarnation(str(claimed_by), int(claimed_epoch or 0))
    )


class KeyBindings(Protocol):
    """Idempotency keys, claimed then bound. Coroutines, safe to call concurrently."""

    async def bind(self, record: IdempotencyRecord) -> IdempotencyRecord:
        """Bind ``record.key`` of ``record.owner`` unless it is bound already; returns the binding that holds
        (``record`` itself, or the earlier one)."""
        ...

    async def get(self, owner: str, key: str) -> IdempotencyRecord | None:
        """The binding of ``key`` sent by ``owner``, or None (another owner's binding of the same key is None;
        so is a key only claimed)."""
        ...

    async def claim(
        self, claim: KeyClaim, created_at: datetime, orphan: str | None = None
    ) -> IdempotencyRecord | KeyClaim:
        """Claim ``claim.key`` of ``claim.owner`` in one transaction: insert the row ``claimed`` unless the key has
        a row; or take over a ``claimed`` row whose incarnation is not live or draining, or whose lease passed
        (its request died with it, having created nothing it could bind), or whose token is ``orphan`` (a claim
        of this incarnation that no request of it holds: ``IdempotencyKeys.held``).

        Returns:
            ``claim`` itself (claimed: the caller binds or releases it), the claim that holds the key (another
            request, of a live incarnation, is being admitted with it), or the key's binding.
        """
        ...

    async def bind_claim(self, record: IdempotencyRecord, claim_token: str) -> bool:
        """Bind the key claimed with ``claim_token`` to ``record`` (``bound``, its ``resource_id``); with
        PostgreSQL notify ``ptc_keys`` (``key_digest``) in the same transaction. False: the claim is not held any
        more (taken over after this incarnation's lease passed), nothing written."""
        ...

    async def release(self, owner: str, key: str, claim_token: str) -> bool:
        """Delete the key's row while it is ``claimed`` with ``claim_token`` (the request created nothing); notify
        as ``bind_claim``. False: no such claim."""
        ...
