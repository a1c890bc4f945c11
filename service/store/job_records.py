"""Job records (table ``jobs``): where jobs live once created, and where ended jobs outlive the process.

A stored job is its view as the API shows it (JSON bytes) plus the columns used to find it. ``JobRecords`` is the
resource's interface; ``sqlite_jobs`` and ``pg_jobs`` implement it.

Owners: each job row has the ``owner`` (API key name) that created it. A store made before owners were recorded
is migrated when opened: its existing rows get owner NULL ("legacy"), which only the admin role sees
(``auth.Caller.may_access``).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from service.store.registry import Incarnation


@dataclass(frozen=True)
class StoredJob:
    """One job in the store.

    Attributes:
        job_id: the job's id.
        status: its status when last saved.
        instance_id: the service instance that ran it.
        created_at: UTC creation time.
        ended_at: UTC end time, None while it has not ended.
        view: the job view as JSON bytes (the final view once ended); empty in listings.
        summary: the job's listing entry as JSON bytes (small: no output, no calls).
        callback_pending: the job has ended and its completion callback is not yet delivered or given up (as its
            view says). A save that ends the job (``save``, ``save_lost``) makes its ``callbacks`` row from it;
            the column is no longer read (the ``callbacks`` rows say what is left to deliver: migration 0006).
        owner: the API key name that created it; None for a job saved before owners were recorded.
        instance_epoch: the epoch of the incarnation of ``instance_id`` that saved it (``JobRecords.save``); None
            for a row saved otherwise (``put``: before replicas, a job marked lost, a callback's re-save).
    """

    job_id: str
    status: str
    instance_id: str
    created_at: datetime
    ended_at: datetime | None
    view: bytes
    summary: bytes
    callback_pending: bool = False
    owner: str | None = None
    instance_epoch: int | None = None


@dataclass(frozen=True)
class JobQuery:
    """A page of ``GET /jobs``: newest first.

    Attributes:
        statuses: keep only these statuses (empty = all).
        created_after / created_before: bounds on ``created_at`` (exclusive).
        cursor: from a previous page's ``next_cursor``.
        limit: page size.
        owner: keep only this owner's jobs; None keeps every owner's (the admin role).
    """

    statuses: Sequence[str] = ()
    created_after: datetime | None = None
    created_before: datetime | None = None
    cursor: str | None = None
    limit: int = 50
    owner: str | None = None


class InvalidCursor(ValueError):
    """A ``cursor`` that no page of this store produced."""


def storable(*values: str) -> bool:
    """Whether every value can be a text column's value in both stores (no NUL, which PostgreSQL refuses, and
    no lone surrogate, which neither can encode). Lookups by a user-given value that is not find nothing."""
    for value in values:
        if "\x00" in value:
            return False
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
    return True


def encode_cursor(created_at: datetime, job_id: str) -> str:
    """Opaque cursor for the position after (``created_at``, ``job_id``) in newest-first order."""
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{job_id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[str, str]:
    """(created_at ISO text, job_id) of a cursor; raises InvalidCursor."""
    try:
        created, job_id = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        datetime.fromisoformat(created)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCursor("cursor is not one this service produced") from exc
    if not storable(job_id):
        raise InvalidCursor("cursor is not one this service produced")
    return created, job_id


def next_cursor(rows: list[StoredJob], limit: int) -> tuple[list[StoredJob], str | None]:
    """A page of ``limit`` rows from ``rows`` (``limit + 1`` read, newest first) and the cursor after it (None: the
    last page)."""
    page = rows[:limit]
    more = len(rows) > limit
    return page, encode_cursor(page[-1].created_at, page[-1].job_id) if more and page else None


class JobRecords(Protocol):
    """Persistence of jobs. Coroutines, safe to call concurrently."""

    async def put(self, job: StoredJob) -> None:
        """Insert or replace the job with this id (unfenced: before replicas, a callback's re-save). With
        PostgreSQL, an ended job's put notifies ``ptc_jobs`` (``<job_id> saved``)."""
        ...

    async def get(self, job_id: str) -> StoredJob | None:
        """The job, or None."""
        ...

    async def page(self, query: JobQuery) -> tuple[list[StoredJob], str | None]:
        """A page of jobs (newest first, ``view`` left empty) and the cursor of the next page (None at the end).

        Raises:
            InvalidCursor: ``query.cursor`` is not one of this store's.
        """
        ...

    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        """Jobs of ``instance_id`` that were saved as not ended (for reconciliation at start-up)."""
        ...

    async def save(self, job: StoredJob, incarnation: Incarnation) -> bool:
        """Save a job its owner runs, fenced (``fenced_write``; docs/scaling.md, The store is the fencing point):
        the first save inserts the row only while ``incarnation`` is ``live`` or ``draining`` in the registry;
        later ones replace it only while it is still this incarnation's and not ended. The row's
        ``instance_epoch`` is the epoch. With PostgreSQL, a save of an ended job (or of one waiting for its
        client) notifies ``ptc_jobs`` (``<job_id> ended``, ``<job_id> waiting``) in the same transaction. The save
        that ends a job with a callback (``job.callback_pending``) writes its ``callbacks`` row in the same
        transaction, ``delivering``, claimed by ``incarnation``: the owner delivers it at once
        (``service.jobs.webhooks``).

        Returns:
            whether a row was written (False: fenced; the caller raises ``LeaseLost``).
        """
        ...

    async def save_lost(self, job: StoredJob) -> bool:
        """End a job another run left unfinished (marked ``lost``: the start-up recovery, a reaper): its ended view
        replaces the row only while the row is not ended (``WHERE ended_at IS NULL``, whoever owns it), and, in the
        same transaction, a job with a callback (``job.callback_pending``) gets its ``callbacks`` row ``pending``,
        due now, for any replica to deliver. With PostgreSQL it notifies ``ptc_jobs`` (``<job_id> ended``) and,
        with a callback, ``ptc_callbacks``.

        Returns:
            whether the row was ended by this call (False: it had ended already, or is gone).
        """
        ...

    async def adopt(self, job_id: str, previous: tuple[str, int | None], owner: tuple[str, int]) -> bool:
        """Make the incarnation ``owner`` (instance id, epoch) the owner of an unfinished job that ``previous``
        (instance id, epoch, None for a row saved without one) owned: a durable job resumed (docs/durability.md),
        whose saves are fenced by its owner from then on. Only while the row is not ended and still ``previous``'s:
        of several incarnations adopting one job, one succeeds.

        Returns:
            whether the row is ``owner``'s now.
        """
        ...

    async def purge(self, ended_before: datetime, instance_id: str | None = None) -> list[str]:
        """Delete jobs that ended before ``ended_before`` (only those ``instance_id`` ran, when given: in a store
        shared by replicas each purges its own, whose output folders and quotas only it can free); returns their
        ids.

        Their blobs, run specs and call logs, callbacks and idempotency keys go with them, in the same
        transaction, and so do session keys whose session ended (at the latest) before ``ended_before``, and job
        keys older than it whose job was never saved (the service stopped between the binding and the job's first
        save), and claims made before it (their requests are long gone).
        """
        ...

    async def count(self) -> int:
        """How many jobs the store holds."""
        ...

    async def orphans(self, limit: int) -> list[StoredJob]:
        """At most ``limit`` unended jobs whose incarnation is not live or draining (its lease passed and it was
        expired, it left, or a later epoch replaced it): the jobs a dead replica left. ``[]`` on SQLite (one
        replica, whose own leftovers its start-up marks)."""
        ...
