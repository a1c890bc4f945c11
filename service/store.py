"""The job store: where jobs live once created, and where ended jobs outlive the process.

``JobStore`` is the small interface; ``SQLiteJobStore`` is the embedded default and ``service.store_pg``'s
``PostgresJobStore`` the shared one (``PTC_STORE_URL``). A stored job is its view as the API shows it (JSON
bytes) plus the columns used to find it. Output bytes of the SQLite store are files beside it (see
``service.output``); the blob methods (``put_blobs``, ``read_blob``, ``blob_sizes``) keep an ended job's retained
output and files in the store itself, for the PostgreSQL store (any replica serves them).

Schema: versioned migrations (``service.migrate``, Alembic) make and upgrade both stores' tables at open; the
tables are ``service.store_schema``.

SQLite settings: WAL journal, ``synchronous=NORMAL`` (a committed job
survives a crash of the process, including ``kill -9``; the last commits may
be lost only on power failure: https://www.sqlite.org/pragma.html#pragma_synchronous).
Every statement runs on one dedicated thread, never on the event loop.

Owners: each job row has the ``owner`` (API key name) that created it, and each
registered toolset one ``toolset_owners`` row per key that registered it. A
store made before owners were recorded is migrated when opened: the column is
added and its existing rows get owner NULL ("legacy"), which only the admin
role sees (``auth.Caller.may_access``); its toolsets get no owner row, so only
the admin role can use them.

Idempotency keys (``idempotency_keys``): one row per (owner, key), bound to the job or session the key's first
request created; a job's row is deleted with the job by ``purge``, a session's once the session has ended
(at the latest) before the retention's cutoff. A key never holds more than one row, and a row one resource, so
an owner's keys are at most its jobs and sessions within the retention.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import hashlib
import json
import os
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from service.errors import InstanceIdInUse
from service.migrations import HEAD

T = TypeVar("T")


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
        instance_epoch: the epoch of the incarnation of ``instance_id`` that saved it (``JobStore.save``); None
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


LIVE_STATES = ("live", "draining")
"""Registry states of an incarnation that may own and write jobs."""


@dataclass(frozen=True)
class StoredSession:
    """One session's row (docs/scaling.md, Sessions): where it lives and its view as last saved.

    Attributes:
        session_id / owner: its id and the key name that created it.
        instance_id / instance_epoch: the incarnation holding its sandbox.
        status: its status when saved (``ready`` while open; ``closed``, ``expired``, ``broken`` once ended).
        created_at / ended_at / ends_by: UTC times; ``ends_by``: the end of its lifetime (``max_lifetime_s``).
        view: its view (``schemas.SessionView``) as JSON bytes.
    """

    session_id: str
    owner: str
    instance_id: str
    instance_epoch: int
    status: str
    created_at: datetime
    ended_at: datetime | None
    ends_by: datetime
    view: bytes


SESSION_BROKEN = "the replica holding its sandbox stopped"
"""The error message of a session marked ``broken`` because its incarnation died (``JobStore.break_sessions``)."""


def broken_view(view: bytes, ended_at: datetime, reason: str = SESSION_BROKEN) -> bytes:
    """A stored session view (JSON bytes) as ``broken`` at ``ended_at``: no script runs or waits there any more."""
    data = json.loads(view)
    data.update(
        status="broken",
        ended_at=ended_at.isoformat(),
        expires_at=None,
        current_job_id=None,
        queued=0,
        error={"type": "session_broken", "message": reason},
    )
    return json.dumps(data, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Incarnation:
    """One start of one replica: ``(instance_id, epoch)``; every job write of the process carries it.

    Attributes:
        instance_id: ``PTC_INSTANCE_ID`` (or its default).
        epoch: how many times this instance id has registered, this start included (1 for the first).
    """

    instance_id: str
    epoch: int


@dataclass(frozen=True)
class Registration:
    """What a replica registers at start-up (``JobStore.register``).

    Attributes:
        instance_id: its instance id.
        internal_url: where the other replicas reach it (``http://host:port``).
        work_dir_token: SHA-256 (hex) of its work dir's ``replica.token``: the same work dir restarting.
        version: the service's version.
        lease_s: the lease's length from the registration (s).
    """

    instance_id: str
    internal_url: str
    work_dir_token: str
    version: str
    lease_s: float


@dataclass(frozen=True)
class Replica:
    """One row of the registry (``JobStore.replicas``).

    Attributes:
        instance_id / epoch: its newest incarnation.
        internal_url: where it is reached.
        version: its service version.
        state: ``live``, ``draining``, ``left`` or ``expired``.
        lease_left_s: seconds until its lease passes, by the store's clock at the read (negative: passed).
    """

    instance_id: str
    epoch: int
    internal_url: str
    version: str
    state: str
    lease_left_s: float

    @property
    def incarnation(self) -> Incarnation:
        """``(instance_id, epoch)``."""
        return Incarnation(self.instance_id, self.epoch)

    @property
    def holds_lease(self) -> bool:
        """It is live or draining and its lease has not passed."""
        return self.state in LIVE_STATES and self.lease_left_s > 0


CALLBACK_STATES = ("pending", "delivering", "delivered", "failed")
"""States of a ``callbacks`` row: due (any replica claims it), claimed by one incarnation, and the two outcomes."""


@dataclass(frozen=True)
class CallbackClaim:
    """A completion callback claimed by this incarnation (``JobStore.claim_callbacks``).

    Attributes:
        job_id: the job whose callback it is.
        owner: the job's owner (API key name; None before owners were recorded): the fairness bucket.
        attempts: attempts recorded by earlier claimers (``JobStore.end_callback``).
        takeover: it was ``delivering`` by an incarnation that is no longer live or draining (else ``pending``).
    """

    job_id: str
    owner: str | None
    attempts: int
    takeover: bool


@dataclass(frozen=True)
class CallbackRow:
    """One row of ``callbacks`` as it is (``JobStore.callback``): ``state`` of ``CALLBACK_STATES``, the claimer's
    incarnation (None before any claim), attempts recorded."""

    job_id: str
    state: str
    claimed_by: Incarnation | None
    attempts: int


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
    """An ``Idempotency-Key`` claimed by the request being admitted with it (``JobStore.claim_idempotency_key``):
    the ``claimed`` row of ``idempotency_keys`` (docs/scaling.md, Idempotency keys).

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


class JobStore(abc.ABC):
    """Persistence of jobs. All methods are coroutines and safe to call concurrently.

    Attributes:
        shares_output: the store keeps each ended job's retained output and output files (``put_blobs``), for
            any replica to serve when the job's folder is not on its disk (True for PostgreSQL).
    """

    shares_output: bool = False

    @abc.abstractmethod
    async def open(self) -> None:
        """Create or open the store."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and release the store."""

    @abc.abstractmethod
    async def put(self, job: StoredJob) -> None:
        """Insert or replace the job with this id."""

    @abc.abstractmethod
    async def get(self, job_id: str) -> StoredJob | None:
        """The job, or None."""

    @abc.abstractmethod
    async def page(self, query: JobQuery) -> tuple[list[StoredJob], str | None]:
        """A page of jobs (newest first, ``view`` left empty) and the cursor of the next page (None at the end).

        Raises:
            InvalidCursor: ``query.cursor`` is not one of this store's.
        """

    @abc.abstractmethod
    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        """Jobs of ``instance_id`` that were saved as not ended (for reconciliation at start-up)."""

    @abc.abstractmethod
    async def claim_callbacks(
        self, incarnation: Incarnation, limit: int, room: Callable[[str | None], int]
    ) -> list[CallbackClaim]:
        """Claim at most ``limit`` due callbacks for ``incarnation`` (docs/scaling.md, Callbacks, exactly once):
        rows ``pending`` whose ``next_attempt_at`` has come, and rows ``delivering`` whose claimer's incarnation is
        no longer ``live`` or ``draining`` (a takeover); at most ``room(owner)`` of one owner's (its free delivery
        slots here). Oldest due first; each becomes ``delivering``, claimed by ``incarnation``, in one transaction.
        On PostgreSQL the candidates are locked ``FOR UPDATE SKIP LOCKED``: two replicas claiming at once never
        take one row both. Nothing is claimed while ``incarnation`` itself is not live or draining.
        """

    @abc.abstractmethod
    async def end_callback(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        """Record a callback's outcome (``delivered`` or ``failed``, ``attempts`` in all), fenced by the claim: only
        while the row is ``delivering`` claimed by ``incarnation``. False: no row matched (another replica took the
        claim over, or the row is gone): nothing was written."""

    @abc.abstractmethod
    async def callback(self, job_id: str) -> CallbackRow | None:
        """The job's ``callbacks`` row, or None (no callback, or not ended yet)."""

    @abc.abstractmethod
    async def save_lost(self, job: StoredJob) -> bool:
        """End a job another run left unfinished (marked ``lost``: the start-up recovery, a reaper): its ended view
        replaces the row only while the row is not ended (``WHERE ended_at IS NULL``, whoever owns it), and, in the
        same transaction, a job with a callback (``job.callback_pending``) gets its ``callbacks`` row ``pending``,
        due now, for any replica to deliver. With PostgreSQL it notifies ``ptc_jobs`` (``<job_id> ended``) and,
        with a callback, ``ptc_callbacks``.

        Returns:
            whether the row was ended by this call (False: it had ended already, or is gone).
        """

    @abc.abstractmethod
    async def purge(self, ended_before: datetime, instance_id: str | None = None) -> list[str]:
        """Delete jobs that ended before ``ended_before`` (only those ``instance_id`` ran, when given: in a store
        shared by replicas each purges its own, whose output folders and quotas only it can free); returns their
        ids.

        The idempotency keys of those jobs go with them, in the same transaction, and so do session keys whose
        session ended (at the latest) before ``ended_before``, and job keys older than it whose job was never
        saved (the service stopped between the binding and the job's first save), and claims made before it
        (their requests are long gone).
        """

    @abc.abstractmethod
    async def bind_idempotency_key(self, record: IdempotencyRecord) -> IdempotencyRecord:
        """Bind ``record.key`` of ``record.owner`` unless it is bound already; returns the binding that holds
        (``record`` itself, or the earlier one)."""

    @abc.abstractmethod
    async def idempotency_key(self, owner: str, key: str) -> IdempotencyRecord | None:
        """The binding of ``key`` sent by ``owner``, or None (another owner's binding of the same key is None;
        so is a key only claimed)."""

    @abc.abstractmethod
    async def claim_idempotency_key(
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

    @abc.abstractmethod
    async def bind_claim(self, record: IdempotencyRecord, claim_token: str) -> bool:
        """Bind the key claimed with ``claim_token`` to ``record`` (``bound``, its ``resource_id``); with
        PostgreSQL notify ``ptc_keys`` (``key_digest``) in the same transaction. False: the claim is not held any
        more (taken over after this incarnation's lease passed), nothing written."""

    @abc.abstractmethod
    async def release_claim(self, owner: str, key: str, claim_token: str) -> bool:
        """Delete the key's row while it is ``claimed`` with ``claim_token`` (the request created nothing); notify
        as ``bind_claim``. False: no such claim."""

    @abc.abstractmethod
    async def count(self) -> int:
        """How many jobs the store holds."""

    @abc.abstractmethod
    async def put_toolset(self, toolset_id: str, manifest: bytes, owner: str) -> None:
        """Keep a registered manifest (JSON bytes) under its id, owned (also) by ``owner``.

        The same id always holds the same manifest; each owner that registers it may use it.
        """

    @abc.abstractmethod
    async def get_toolset(self, toolset_id: str, owner: str | None) -> bytes | None:
        """The manifest registered under ``toolset_id`` by ``owner`` (None: by anyone, or before owners), or None."""

    @abc.abstractmethod
    async def put_blobs(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        """Keep an ended job's bytes under their names (``stdout``, ``stderr``, ``files/<index>``), replacing
        earlier ones of the same names; they go with the job (``purge``).

        The caller keeps each within its cap (``PTC_OUTPUT_RETENTION_BYTES`` per stream, the output files' caps).
        """

    @abc.abstractmethod
    async def read_blob(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        """Bytes ``[offset, offset + length)`` of a job's blob (``length`` None: to its end), or None without it."""

    @abc.abstractmethod
    async def blob_sizes(self, job_id: str) -> dict[str, int]:
        """The names of a job's blobs and their sizes (bytes)."""

    @abc.abstractmethod
    async def save(self, job: StoredJob, incarnation: Incarnation) -> bool:
        """Save a job its owner runs, fenced (docs/scaling.md, The store is the fencing point): the first save
        inserts the row only while ``incarnation`` is ``live`` or ``draining`` in the registry; later ones replace
        it only while it is still this incarnation's and not ended. The row's ``instance_epoch`` is the epoch.
        With PostgreSQL, a save of an ended job (or of one waiting for its client) notifies ``ptc_jobs``
        (``<job_id> ended``, ``<job_id> waiting``) in the same transaction. The save that ends a job with a callback
        (``job.callback_pending``) writes its ``callbacks`` row in the same transaction, ``delivering``, claimed by
        ``incarnation``: the owner delivers it at once (``service.jobs.webhooks``).

        Returns:
            whether a row was written (False: fenced; the caller raises ``LeaseLost``).
        """

    @abc.abstractmethod
    async def register(self, registration: Registration) -> int:
        """Register a start of ``registration.instance_id`` in the registry (one transaction, its row locked);
        returns its epoch: 1 for a new instance id, else one more than the row's.

        Raises:
            InstanceIdInUse: the row is live, its lease holding, with another work dir's token (two replicas were
                given one instance id); or, on SQLite, another instance id is live on the same file.
        """

    @abc.abstractmethod
    async def renew(self, incarnation: Incarnation, lease_s: float) -> bool:
        """Extend the incarnation's lease to ``lease_s`` from now (the store's clock); False when no row matched:
        the incarnation was expired (or has left), and the replica is fenced."""

    @abc.abstractmethod
    async def set_replica_state(self, incarnation: Incarnation, state: str) -> bool:
        """Move a live incarnation to ``draining`` or ``left`` (``left`` also sets ``ended_at``); False when it
        is no longer live or draining."""

    @abc.abstractmethod
    async def replicas(self) -> list[Replica]:
        """Every row of the registry, newest incarnation per instance id."""

    async def expire_replicas(self, by: str) -> dict[Incarnation, float]:
        """Mark ``expired`` every live or draining incarnation whose lease passed (store time), recording ``by``
        (the expiring instance id); returns those this call expired (each by one caller, however many race), each
        with the seconds from its last heartbeat to its expiry (store time). With PostgreSQL it notifies
        ``ptc_replicas``. SQLite serves one replica: nothing to expire (``{}``)."""
        return {}

    async def orphans(self, limit: int) -> list[StoredJob]:
        """At most ``limit`` unended jobs whose incarnation is not live or draining (its lease passed and it was
        expired, it left, or a later epoch replaced it): the jobs a dead replica left. ``[]`` on SQLite (one
        replica, whose own leftovers its start-up marks)."""
        return []

    async def orphan_sessions(self) -> list[Incarnation]:
        """The incarnations that hold sessions not ended and are not live or draining (expired by a replica that
        stopped before it marked their sessions ``broken``, or replaced by a later epoch): for
        ``break_sessions``. ``[]`` on SQLite (one replica)."""
        return []

    @abc.abstractmethod
    async def save_session(self, session: StoredSession, incarnation: Incarnation) -> bool:
        """Save a session ``incarnation`` holds (at its creation and at its end), fenced like ``save``: inserted
        only while the incarnation is ``live`` or ``draining``, replaced only while the row is still its and not
        ended. Returns whether a row was written (False: fenced)."""

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> StoredSession | None:
        """One session's row, or None."""

    @abc.abstractmethod
    async def open_sessions(self, owner: str | None) -> list[StoredSession]:
        """The sessions not ended (of ``owner``; None: every owner's), oldest first."""

    @abc.abstractmethod
    async def break_sessions(self, incarnation: Incarnation, reason: str = SESSION_BROKEN) -> list[str]:
        """Mark every session of ``incarnation`` that has not ended ``broken`` (its view too: ``broken_view``),
        each only if it is still not ended (a racing end by its owner wins); returns their ids. For the reaper of
        a dead incarnation (docs/scaling.md, Lost jobs and broken sessions)."""

    async def ping(self) -> None:
        """Check that the store answers (``GET /readyz``).

        Raises:
            StoreUnavailable: it does not, or not in time.
        """
        return None  # an embedded store always answers

    def describe(self) -> str:
        """Where the store is, for logs: never a password."""
        return type(self).__name__


_KEY_COLUMNS = "owner, key, fingerprint, kind, resource_id, created_at, ends_by"
_CLAIM_COLUMNS = _KEY_COLUMNS + ", state, claim_token, claimed_by, claimed_epoch"


def _claim_row(row: tuple[Any, ...]) -> IdempotencyRecord | KeyClaim:
    """A row of ``_CLAIM_COLUMNS``: its binding, or its claim."""
    owner, key, fingerprint, kind, resource_id, created, ends_by, state, token, by, epoch = row
    if state == "bound":
        return _key_row((owner, key, fingerprint, kind, resource_id, created, ends_by))
    return KeyClaim(owner, key, fingerprint, kind, token, Incarnation(by, int(epoch)))


def _key_row(row: tuple[str, str, str, str, str, str, str | None]) -> IdempotencyRecord:
    owner, key, fingerprint, kind, resource_id, created, ends_by = row
    return IdempotencyRecord(
        owner,
        key,
        fingerprint,
        kind,
        resource_id,
        datetime.fromisoformat(created),
        datetime.fromisoformat(ends_by) if ends_by else None,
    )


_COLUMNS = "job_id, status, instance_id, created_at, ended_at, view, summary, callback_pending, owner"
_READ_COLUMNS = _COLUMNS + ", instance_epoch"
_SUMMARY_COLUMNS = (
    "job_id, status, instance_id, created_at, ended_at, x'', summary, callback_pending, owner, instance_epoch"
)


def _row(row: tuple[str, str, str, str, str | None, bytes, bytes, int, str | None, int | None]) -> StoredJob:
    job_id, status, instance_id, created, ended, view, summary, pending, owner, epoch = row
    return StoredJob(
        job_id,
        status,
        instance_id,
        datetime.fromisoformat(created),
        datetime.fromisoformat(ended) if ended else None,
        bytes(view),
        bytes(summary),
        bool(pending),
        owner,
        epoch,
    )


_FENCED_SAVE = f"""INSERT INTO jobs ({_COLUMNS}, instance_epoch)
SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (
    SELECT 1 FROM replicas WHERE instance_id = ? AND epoch = ? AND state IN ('live', 'draining'))
ON CONFLICT (job_id) DO UPDATE SET status = excluded.status, ended_at = excluded.ended_at, view = excluded.view,
    summary = excluded.summary, callback_pending = excluded.callback_pending
WHERE jobs.instance_id = excluded.instance_id AND jobs.instance_epoch = excluded.instance_epoch
    AND jobs.ended_at IS NULL"""
"""A job's save by its owning incarnation (``JobStore.save``): inserted while the incarnation is live, replaced
while the row is still its and not ended."""


@contextmanager
def _transaction(db: sqlite3.Connection, immediate: bool = False) -> Iterator[None]:
    """One transaction on the SQLite store's thread: committed when the block ends (a ``return`` in it too), rolled
    back when it raises. ``immediate``: take the file's write lock at once (a read then a write as one step)."""
    db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _live(db: sqlite3.Connection, incarnation: Incarnation) -> bool:
    """Whether ``incarnation`` is live or draining in the SQLite store's registry, its lease holding."""
    row = db.execute(
        "SELECT state, lease_until FROM replicas WHERE instance_id = ? AND epoch = ?",
        (incarnation.instance_id, incarnation.epoch),
    ).fetchone()
    return row is not None and row[0] in LIVE_STATES and datetime.fromisoformat(row[1]) > datetime.now(UTC)


_CLAIMABLE = """SELECT c.job_id, j.owner, c.attempts, c.state FROM callbacks c JOIN jobs j ON j.job_id = c.job_id
WHERE (c.state = 'pending' AND c.next_attempt_at <= ?) OR (c.state = 'delivering' AND NOT EXISTS (
    SELECT 1 FROM replicas r WHERE r.instance_id = c.claimed_by AND r.epoch = c.claimed_epoch
        AND r.state IN ('live', 'draining')))
ORDER BY c.next_attempt_at, c.job_id LIMIT ?"""
"""Due callbacks (``JobStore.claim_callbacks``): pending and due, or claimed by an incarnation that is not live."""

CLAIM_SCAN = 4
"""A claim looks at ``CLAIM_SCAN`` × its limit of the oldest due rows, and takes from them at most each owner's
room: an owner whose slots here are full leaves the rest of the window to the others."""


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


_SESSION_COLUMNS = "session_id, owner, instance_id, instance_epoch, status, created_at, ended_at, ends_by, view"
_FENCED_SESSION_SAVE = f"""INSERT INTO sessions ({_SESSION_COLUMNS})
SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (
    SELECT 1 FROM replicas WHERE instance_id = ? AND epoch = ? AND state IN ('live', 'draining'))
ON CONFLICT (session_id) DO UPDATE SET status = excluded.status, ended_at = excluded.ended_at, view = excluded.view
WHERE sessions.instance_id = excluded.instance_id AND sessions.instance_epoch = excluded.instance_epoch
    AND sessions.ended_at IS NULL"""
"""A session's save by its owning incarnation (``JobStore.save_session``), fenced as a job's."""


def _session_row(row: Sequence[object]) -> StoredSession:
    session_id, owner, instance_id, epoch, status, created_at, ended_at, ends_by, view = row
    return StoredSession(
        str(session_id),
        str(owner),
        str(instance_id),
        int(str(epoch)),
        str(status),
        datetime.fromisoformat(str(created_at)),
        datetime.fromisoformat(str(ended_at)) if ended_at else None,
        datetime.fromisoformat(str(ends_by)),
        bytes(view) if isinstance(view, bytes | bytearray | memoryview) else str(view).encode(),
    )


def in_use_message(instance_id: str) -> str:
    """``InstanceIdInUse``'s message for an instance id held by another work dir."""
    return (
        f"instance id {instance_id} is held by a live replica with another work dir; give each replica its own "
        "PTC_INSTANCE_ID"
    )


def _revision(db: sqlite3.Connection) -> str | None:
    """The migration revision of a SQLite store (None: never migrated)."""
    try:
        row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.OperationalError:  # no such table
        return None
    return str(row[0]) if row else None


class SQLiteJobStore(JobStore):
    """The embedded store: one SQLite file.

    Args:
        path: the database file (created with its folder when missing).
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptc-store")
        self._db: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._db is not None, "the store is not open"
            return fn(self._db)

        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def open(self) -> None:
        def connect() -> None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            if _revision(db) != HEAD:  # a new file, or one of an older schema: migrations (Alembic, imported then)
                import sqlalchemy

                from service import migrate

                migrate.upgrade(sqlalchemy.URL.create("sqlite", database=str(self._path)))
            os.chmod(self._path, 0o600)  # outputs, arguments and results: for the service only
            self._db = db

        await asyncio.get_running_loop().run_in_executor(self._thread, connect)

    async def close(self) -> None:
        def disconnect() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await asyncio.get_running_loop().run_in_executor(self._thread, disconnect)
        self._thread.shutdown(wait=True)

    async def put(self, job: StoredJob) -> None:
        await self._run(
            lambda db: db.execute(
                f"INSERT OR REPLACE INTO jobs ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.job_id,
                    job.status,
                    job.instance_id,
                    job.created_at.isoformat(),
                    job.ended_at.isoformat() if job.ended_at else None,
                    job.view,
                    job.summary,
                    int(job.callback_pending),
                    job.owner,
                ),
            )
        )

    async def get(self, job_id: str) -> StoredJob | None:
        if not storable(job_id):
            return None
        row = await self._run(
            lambda db: db.execute(f"SELECT {_READ_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        )
        return _row(row) if row else None

    async def page(self, query: JobQuery) -> tuple[list[StoredJob], str | None]:
        where: list[str] = []
        params: list[object] = []
        if query.owner is not None:
            where.append("owner = ?")
            params.append(query.owner)
        if query.statuses:
            where.append(f"status IN ({', '.join('?' * len(query.statuses))})")
            params += list(query.statuses)
        if query.created_after is not None:
            where.append("created_at > ?")
            params.append(query.created_after.isoformat())
        if query.created_before is not None:
            where.append("created_at < ?")
            params.append(query.created_before.isoformat())
        if query.cursor:
            created, job_id = decode_cursor(query.cursor)
            where.append("(created_at, job_id) < (?, ?)")
            params += [created, job_id]
        sql = f"SELECT {_SUMMARY_COLUMNS} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, job_id DESC LIMIT ?"
        params.append(query.limit + 1)
        rows = await self._run(lambda db: db.execute(sql, params).fetchall())
        jobs = [_row(r) for r in rows[: query.limit]]
        more = len(rows) > query.limit
        return jobs, encode_cursor(jobs[-1].created_at, jobs[-1].job_id) if more and jobs else None

    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        rows = await self._run(
            lambda db: db.execute(
                f"SELECT {_READ_COLUMNS} FROM jobs WHERE instance_id = ? AND ended_at IS NULL", (instance_id,)
            ).fetchall()
        )
        return [_row(r) for r in rows]

    async def claim_callbacks(
        self, incarnation: Incarnation, limit: int, room: Callable[[str | None], int]
    ) -> list[CallbackClaim]:
        if limit <= 0:
            return []

        def claim(db: sqlite3.Connection) -> list[CallbackClaim]:
            if not db.execute(_CLAIMABLE, (datetime.now(UTC).isoformat(), 1)).fetchall():
                return []  # the usual answer of a scan: no write lock taken for it
            with _transaction(db, immediate=True):  # the file's write lock: one claim at a time
                if not _live(db, incarnation):
                    chosen: list[CallbackClaim] = []
                else:
                    rows = db.execute(_CLAIMABLE, (datetime.now(UTC).isoformat(), limit * CLAIM_SCAN)).fetchall()
                    chosen = choose_claims(rows, limit, room)
                    db.executemany(
                        "UPDATE callbacks SET state = 'delivering', claimed_by = ?, claimed_epoch = ? WHERE job_id = ?",
                        [(incarnation.instance_id, incarnation.epoch, c.job_id) for c in chosen],
                    ).close()
            return chosen

        return await self._run(claim)

    async def end_callback(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        cursor = await self._run(
            lambda db: db.execute(
                "UPDATE callbacks SET state = ?, attempts = ? WHERE job_id = ? AND claimed_by = ? "
                "AND claimed_epoch = ? AND state = 'delivering'",
                (state, attempts, job_id, incarnation.instance_id, incarnation.epoch),
            )
        )
        return cursor.rowcount > 0

    async def callback(self, job_id: str) -> CallbackRow | None:
        if not storable(job_id):
            return None
        row = await self._run(
            lambda db: db.execute(
                "SELECT state, claimed_by, claimed_epoch, attempts FROM callbacks WHERE job_id = ?", (job_id,)
            ).fetchone()
        )
        if row is None:
            return None
        state, by, epoch, attempts = row
        return CallbackRow(job_id, state, Incarnation(by, int(epoch)) if by is not None else None, int(attempts))

    async def save_lost(self, job: StoredJob) -> bool:
        def end(db: sqlite3.Connection) -> bool:
            with _transaction(db):  # one transaction: never an ended job without its callback's row
                ended = db.execute(
                    "UPDATE jobs SET status = ?, ended_at = ?, view = ?, summary = ?, callback_pending = ? "
                    "WHERE job_id = ? AND ended_at IS NULL",
                    (
                        job.status,
                        job.ended_at.isoformat() if job.ended_at else None,
                        job.view,
                        job.summary,
                        int(job.callback_pending),
                        job.job_id,
                    ),
                ).rowcount
                if ended and job.callback_pending:
                    db.execute(
                        "INSERT OR IGNORE INTO callbacks (job_id, state, attempts, next_attempt_at) "
                        "VALUES (?, 'pending', 0, ?)",
                        (job.job_id, datetime.now(UTC).isoformat()),
                    )
            return ended > 0

        return await self._run(end)

    async def purge(self, ended_before: datetime, instance_id: str | None = None) -> list[str]:
        def delete(db: sqlite3.Connection) -> list[str]:
            cutoff = ended_before.isoformat()
            expired = "SELECT job_id FROM jobs WHERE ended_at < ? AND (? IS NULL OR instance_id = ?)"
            given = (cutoff, instance_id, instance_id)
            with _transaction(db):  # one transaction: a job never goes without its idempotency key, nor the reverse
                ids = [r[0] for r in db.execute(expired, given)]
                db.execute(f"DELETE FROM idempotency_keys WHERE kind = 'job' AND resource_id IN ({expired})", given)
                db.execute(f"DELETE FROM job_blobs WHERE job_id IN ({expired})", given)
                db.execute(f"DELETE FROM callbacks WHERE job_id IN ({expired})", given)  # no foreign keys here
                db.execute(f"DELETE FROM jobs WHERE job_id IN ({expired})", given)
                db.execute("DELETE FROM idempotency_keys WHERE kind = 'session' AND ends_by < ?", (cutoff,))
                db.execute("DELETE FROM idempotency_keys WHERE state = 'claimed' AND created_at < ?", (cutoff,))
                db.execute(
                    "DELETE FROM idempotency_keys WHERE kind = 'job' AND created_at < ? AND NOT EXISTS "
                    "(SELECT 1 FROM jobs WHERE jobs.job_id = idempotency_keys.resource_id)",
                    (cutoff,),
                )
            return ids

        return await self._run(delete)

    async def count(self) -> int:
        row = await self._run(lambda db: db.execute("SELECT COUNT(*) FROM jobs").fetchone())
        return int(row[0])

    async def bind_idempotency_key(self, record: IdempotencyRecord) -> IdempotencyRecord:
        def bind(db: sqlite3.Connection) -> IdempotencyRecord:
            db.execute(
                f"INSERT OR IGNORE INTO idempotency_keys ({_KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.owner,
                    record.key,
                    record.fingerprint,
                    record.kind,
                    record.resource_id,
                    record.created_at.isoformat(),
                    record.ends_by.isoformat() if record.ends_by else None,
                ),
            )
            row = db.execute(
                f"SELECT {_KEY_COLUMNS} FROM idempotency_keys WHERE owner = ? AND key = ? AND state = 'bound'",
                (record.owner, record.key),
            ).fetchone()
            return _key_row(row)

        return await self._run(bind)

    async def claim_idempotency_key(
        self, claim: KeyClaim, created_at: datetime, orphan: str | None = None
    ) -> IdempotencyRecord | KeyClaim:
        def take(db: sqlite3.Connection) -> IdempotencyRecord | KeyClaim:
            with _transaction(db, immediate=True):  # the file's write lock: the read and the write below are one step
                row = db.execute(
                    f"SELECT {_CLAIM_COLUMNS} FROM idempotency_keys WHERE owner = ? AND key = ?",
                    (claim.owner, claim.key),
                ).fetchone()
                held = None if row is None else _claim_row(row)
                claimer = (claim.claim_token, claim.claimed_by.instance_id, claim.claimed_by.epoch)
                if held is None:
                    db.execute(
                        "INSERT INTO idempotency_keys (owner, key, fingerprint, kind, resource_id, created_at, "
                        "ends_by, state, claim_token, claimed_by, claimed_epoch) "
                        "VALUES (?, ?, ?, ?, NULL, ?, NULL, 'claimed', ?, ?, ?)",
                        (claim.owner, claim.key, claim.fingerprint, claim.kind, created_at.isoformat(), *claimer),
                    )
                    held = claim
                elif isinstance(held, KeyClaim) and (held.claim_token == orphan or not _live(db, held.claimed_by)):
                    db.execute(
                        "UPDATE idempotency_keys SET fingerprint = ?, kind = ?, created_at = ?, claim_token = ?, "
                        "claimed_by = ?, claimed_epoch = ? WHERE owner = ? AND key = ? AND state = 'claimed'",
                        (claim.fingerprint, claim.kind, created_at.isoformat(), *claimer, claim.owner, claim.key),
                    )
                    held = claim
            return held

        return await self._run(take)

    async def bind_claim(self, record: IdempotencyRecord, claim_token: str) -> bool:
        cursor = await self._run(
            lambda db: db.execute(
                "UPDATE idempotency_keys SET state = 'bound', resource_id = ?, created_at = ?, ends_by = ?, "
                "fingerprint = ?, kind = ? WHERE owner = ? AND key = ? AND state = 'claimed' AND claim_token = ?",
                (
                    record.resource_id,
                    record.created_at.isoformat(),
                    record.ends_by.isoformat() if record.ends_by else None,
                    record.fingerprint,
                    record.kind,
                    record.owner,
                    record.key,
                    claim_token,
                ),
            )
        )
        return cursor.rowcount > 0

    async def release_claim(self, owner: str, key: str, claim_token: str) -> bool:
        cursor = await self._run(
            lambda db: db.execute(
                "DELETE FROM idempotency_keys WHERE owner = ? AND key = ? AND state = 'claimed' AND claim_token = ?",
                (owner, key, claim_token),
            )
        )
        return cursor.rowcount > 0

    async def idempotency_key(self, owner: str, key: str) -> IdempotencyRecord | None:
        if not storable(owner, key):
            return None
        row = await self._run(
            lambda db: db.execute(
                f"SELECT {_KEY_COLUMNS} FROM idempotency_keys WHERE owner = ? AND key = ? AND state = 'bound'",
                (owner, key),
            ).fetchone()
        )
        return _key_row(row) if row else None

    async def put_toolset(self, toolset_id: str, manifest: bytes, owner: str) -> None:
        def insert(db: sqlite3.Connection) -> None:
            with _transaction(db):  # one transaction: never a toolset without its owner
                db.execute(
                    "INSERT OR IGNORE INTO toolsets (toolset_id, manifest) VALUES (?, ?)", (toolset_id, manifest)
                )
                db.execute(
                    "INSERT OR IGNORE INTO toolset_owners (toolset_id, owner) VALUES (?, ?)", (toolset_id, owner)
                )

        await self._run(insert)

    async def get_toolset(self, toolset_id: str, owner: str | None) -> bytes | None:
        if not storable(toolset_id):
            return None
        params: tuple[str, ...]
        if owner is None:
            sql, params = "SELECT manifest FROM toolsets WHERE toolset_id = ?", (toolset_id,)
        else:
            sql = (
                "SELECT manifest FROM toolsets JOIN toolset_owners USING (toolset_id) "
                "WHERE toolset_id = ? AND owner = ?"
            )
            params = (toolset_id, owner)
        row = await self._run(lambda db: db.execute(sql, params).fetchone())
        return bytes(row[0]) if row else None

    async def put_blobs(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        rows = [(job_id, name, data) for name, data in blobs.items()]

        def insert(db: sqlite3.Connection) -> None:  # the cursor stays on the store's thread (see below)
            db.executemany("INSERT OR REPLACE INTO job_blobs VALUES (?, ?, ?)", rows).close()

        # An executemany cursor handed back to the event loop is finalized there, while the store's thread runs the
        # next statement: concurrent calls then failed with "bad parameter or other API misuse".
        await self._run(insert)

    async def read_blob(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        if not storable(job_id, name):
            return None
        params: tuple[int, ...]
        if length is None:  # substr counts from 1
            sql, params = "SELECT substr(data, ?) FROM job_blobs WHERE job_id = ? AND name = ?", (offset + 1,)
        else:
            sql, params = "SELECT substr(data, ?, ?) FROM job_blobs WHERE job_id = ? AND name = ?", (offset + 1, length)
        row = await self._run(lambda db: db.execute(sql, (*params, job_id, name)).fetchone())
        return bytes(row[0] or b"") if row else None  # substr of an empty blob is NULL

    async def blob_sizes(self, job_id: str) -> dict[str, int]:
        if not storable(job_id):
            return {}
        rows = await self._run(
            lambda db: db.execute("SELECT name, length(data) FROM job_blobs WHERE job_id = ?", (job_id,)).fetchall()
        )
        return {name: int(size) for name, size in rows}

    async def save(self, job: StoredJob, incarnation: Incarnation) -> bool:
        values = (
            job.job_id,
            job.status,
            incarnation.instance_id,  # the owner's, whatever ``job`` says
            job.created_at.isoformat(),
            job.ended_at.isoformat() if job.ended_at else None,
            job.view,
            job.summary,
            int(job.callback_pending),
            job.owner,
            incarnation.epoch,
            incarnation.instance_id,
            incarnation.epoch,
        )
        delivering = job.ended_at is not None and job.callback_pending

        def save(db: sqlite3.Connection) -> bool:
            with _transaction(db):  # one transaction: the end and its callback's row, claimed by the owner
                written = db.execute(_FENCED_SAVE, values).rowcount > 0
                if written and delivering:
                    db.execute(
                        "INSERT OR IGNORE INTO callbacks (job_id, state, claimed_by, claimed_epoch, attempts, "
                        "next_attempt_at) VALUES (?, 'delivering', ?, ?, 0, ?)",
                        (job.job_id, incarnation.instance_id, incarnation.epoch, datetime.now(UTC).isoformat()),
                    )
            return written

        return await self._run(save)

    async def register(self, registration: Registration) -> int:
        def register(db: sqlite3.Connection) -> int:
            now = datetime.now(UTC)
            lease = (now + timedelta(seconds=registration.lease_s)).isoformat()
            with _transaction(db, immediate=True):  # the file's write lock: one registration at a time
                for other, state, until in db.execute(
                    "SELECT instance_id, state, lease_until FROM replicas WHERE instance_id != ?",
                    (registration.instance_id,),
                ):
                    if state in LIVE_STATES and datetime.fromisoformat(until) > now:
                        raise InstanceIdInUse(
                            f"instance {other} is live on this SQLite store, which serves one replica; give this "
                            "one its own PTC_WORK_DIR, or PostgreSQL (PTC_STORE_URL)"
                        )
                row = db.execute(
                    "SELECT epoch, work_dir_token, state, lease_until FROM replicas WHERE instance_id = ?",
                    (registration.instance_id,),
                ).fetchone()
                if row is not None:
                    epoch, token, state, until = row
                    holding = state in LIVE_STATES and datetime.fromisoformat(until) > now
                    if holding and token != registration.work_dir_token:
                        raise InstanceIdInUse(in_use_message(registration.instance_id))
                epoch = 1 if row is None else int(row[0]) + 1
                db.execute(
                    "INSERT OR REPLACE INTO replicas (instance_id, epoch, internal_url, work_dir_token, version, "
                    "state, started_at, heartbeat_at, lease_until, ended_at, expired_by) "
                    "VALUES (?, ?, ?, ?, ?, 'live', ?, ?, ?, NULL, NULL)",
                    (
                        registration.instance_id,
                        epoch,
                        registration.internal_url,
                        registration.work_dir_token,
                        registration.version,
                        now.isoformat(),
                        now.isoformat(),
                        lease,
                    ),
                )
            return epoch

        return await self._run(register)

    async def renew(self, incarnation: Incarnation, lease_s: float) -> bool:
        now = datetime.now(UTC)
        until = (now + timedelta(seconds=lease_s)).isoformat()
        cursor = await self._run(
            lambda db: db.execute(
                "UPDATE replicas SET heartbeat_at = ?, lease_until = ? "
                "WHERE instance_id = ? AND epoch = ? AND state IN ('live', 'draining')",
                (now.isoformat(), until, incarnation.instance_id, incarnation.epoch),
            )
        )
        return cursor.rowcount > 0

    async def set_replica_state(self, incarnation: Incarnation, state: str) -> bool:
        ended = datetime.now(UTC).isoformat() if state == "left" else None
        cursor = await self._run(
            lambda db: db.execute(
                "UPDATE replicas SET state = ?, ended_at = ? "
                "WHERE instance_id = ? AND epoch = ? AND state IN ('live', 'draining')",
                (state, ended, incarnation.instance_id, incarnation.epoch),
            )
        )
        return cursor.rowcount > 0

    async def replicas(self) -> list[Replica]:
        rows = await self._run(
            lambda db: db.execute(
                "SELECT instance_id, epoch, internal_url, version, state, lease_until FROM replicas"
            ).fetchall()
        )
        now = datetime.now(UTC)
        return [
            Replica(i, int(e), url, v, state, (datetime.fromisoformat(until) - now).total_seconds())
            for i, e, url, v, state, until in rows
        ]

    async def save_session(self, session: StoredSession, incarnation: Incarnation) -> bool:
        values = (
            session.session_id,
            session.owner,
            incarnation.instance_id,
            incarnation.epoch,
            session.status,
            session.created_at.isoformat(),
            session.ended_at.isoformat() if session.ended_at else None,
            session.ends_by.isoformat(),
            session.view,
            incarnation.instance_id,
            incarnation.epoch,
        )
        cursor = await self._run(lambda db: db.execute(_FENCED_SESSION_SAVE, values))
        return cursor.rowcount > 0

    async def get_session(self, session_id: str) -> StoredSession | None:
        if not storable(session_id):
            return None
        row = await self._run(
            lambda db: db.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
        )
        return _session_row(row) if row else None

    async def open_sessions(self, owner: str | None) -> list[StoredSession]:
        where, params = ("AND owner = ?", (owner,)) if owner is not None else ("", ())
        sql = f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE ended_at IS NULL {where} ORDER BY created_at, session_id"
        rows = await self._run(lambda db: db.execute(sql, params).fetchall())
        return [_session_row(row) for row in rows]

    async def break_sessions(self, incarnation: Incarnation, reason: str = SESSION_BROKEN) -> list[str]:
        def mark(db: sqlite3.Connection) -> list[str]:
            now = datetime.now(UTC)
            broken = []
            rows = db.execute(
                "SELECT session_id, view FROM sessions WHERE instance_id = ? AND instance_epoch = ? "
                "AND ended_at IS NULL",
                (incarnation.instance_id, incarnation.epoch),
            ).fetchall()
            for session_id, view in rows:
                cursor = db.execute(
                    "UPDATE sessions SET status = 'broken', ended_at = ?, view = ? "
                    "WHERE session_id = ? AND ended_at IS NULL",
                    (now.isoformat(), broken_view(bytes(view), now, reason), session_id),
                )
                if cursor.rowcount:
                    broken.append(str(session_id))
            return broken

        return await self._run(mark)

    def describe(self) -> str:
        return f"sqlite {self._path}"
