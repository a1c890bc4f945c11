"""Completion callbacks' rows (table ``callbacks``; docs/scaling.md, Callbacks, exactly once): one per ended job
with a ``callback_url``, ``pending`` (due at ``next_attempt_at``, any replica claims it), ``delivering`` (claimed
by one incarnation), ``delivered`` or ``failed``.

A job's save that ends it writes its row in the same transaction (``JobRecords.save``, ``save_lost``, through the
backends' ``add_delivering`` and ``add_pending``). ``CallbackLedger`` is the resource's interface;
``sqlite_ledger`` and ``pg_ledger`` implement it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from service.store.registry import Incarnation

CALLBACK_STATES = ("pending", "delivering", "delivered", "failed")
"""States of a ``callbacks`` row: due (any replica claims it), claimed by one incarnation, and the two outcomes."""

CLAIM_SCAN = 4
"""A claim looks at ``CLAIM_SCAN`` × its limit of the oldest due rows, and takes from them at most each owner's
room: an owner whose slots here are full leaves the rest of the window to the others."""


@dataclass(frozen=True)
class CallbackClaim:
    """A completion callback claimed by this incarnation (``CallbackLedger.claim``).

    Attributes:
        job_id: the job whose callback it is.
        owner: the job's owner (API key name; None before owners were recorded): the fairness bucket.
        attempts: attempts recorded by earlier claimers (``CallbackLedger.end``).
        takeover: it was ``delivering`` by an incarnation that is no longer live or draining (else ``pending``).
    """

    job_id: str
    owner: str | None
    attempts: int
    takeover: bool


@dataclass(frozen=True)
class CallbackRow:
    """One row of ``callbacks`` as it is (``CallbackLedger.get``): ``state`` of ``CALLBACK_STATES``, the
    claimer's incarnation (None before any claim), attempts recorded."""

    job_id: str
    state: str
    claimed_by: Incarnation | None
    attempts: int


def choose_claims(
    candidates: Sequence[tuple[str, str | None, int, str]], limit: int, room: Callable[[str | None], int]
) -> list[CallbackClaim]:
    """Of ``candidates`` (job id, owner, attempts, state; oldest due first), the first ``limit`` whose owner still
    has room (``room(owner)`` free delivery slots, less those chosen here already)."""
    taken: dict[str | None, int] = {}
    chosen: list[CallbackClaim] = []
    for job_id, owner, attempts, state in candidates:
        if len(chosen) >= limit:
            break
        if taken.get(owner, 0) >= room(owner):
            continue
        taken[owner] = taken.get(owner, 0) + 1
        chosen.append(CallbackClaim(job_id, owner, int(attempts), state == "delivering"))
    return chosen


class CallbackLedger(Protocol):
    """Claims and outcomes of completion callbacks. Coroutines, safe to call concurrently."""

    async def claim(
        self, incarnation: Incarnation, limit: int, room: Callable[[str | None], int]
    ) -> list[CallbackClaim]:
        """Claim at most ``limit`` due callbacks for ``incarnation``: rows ``pending`` whose ``next_attempt_at``
        has come, and rows ``delivering`` whose claimer's incarnation is no longer ``live`` or ``draining`` (a
        takeover); at most ``room(owner)`` of one owner's (its free delivery slots here). Oldest due first; each
        becomes ``delivering``, claimed by ``incarnation``, in one transaction. On PostgreSQL the candidates are
        locked ``FOR UPDATE SKIP LOCKED``: two replicas claiming at once never take one row both. Nothing is
        claimed while ``incarnation`` itself is not live or draining.
        """
        ...

    async def end(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        """Record a callback's outcome (``delivered`` or ``failed``, ``attempts`` in all), fenced by the claim:
        only while the row is ``delivering`` claimed by ``incarnation``. False: no row matched (another replica
        took the claim over, or the row is gone): nothing was written."""
        ...

    async def get(self, job_id: str) -> CallbackRow | None:
        """The job's ``callbacks`` row, or None (no callback, or not ended yet)."""
        ...
