"""The PostgreSQL job store (``PTC_STORE_URL``): the same ``JobStore`` as the SQLite one, on a database that
several replicas can share (issue 17).

SQLAlchemy 2 Core on psycopg 3's asyncio driver: no statement blocks the event loop. Every operation is bounded by
``PTC_STORE_TIMEOUT_S`` (connect, pool wait, the server's ``statement_timeout``, and an overall deadline); a store
that is down or slow raises ``StoreUnavailable`` (503 ``store-unavailable``), never hangs a request. The URL's
password is never logged nor put in an error: ``describe`` hides it, and driver errors (whose text may name the
server) are chained and logged, not shown.

Tables: ``service.store_schema`` (times as ISO text, as in SQLite, so cursors compare the same); migrations run at
``open`` under an advisory lock, so replicas starting together migrate once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from service import migrate
from service.errors import InstanceIdInUse, StoreUnavailable
from service.settings import Settings
from service.store import (
    CLAIM_SCAN,
    LIVE_STATES,
    SESSION_BROKEN,
    CallbackClaim,
    CallbackRow,
    IdempotencyRecord,
    Incarnation,
    JobQuery,
    JobStore,
    KeyClaim,
    Registration,
    Replica,
    SQLiteJobStore,
    StoredJob,
    StoredSession,
    broken_view,
    choose_claims,
    decode_cursor,
    encode_cursor,
    in_use_message,
    key_digest,
    storable,
)
from service.store_schema import (
    callbacks,
    idempotency_keys,
    job_blobs,
    jobs,
    replicas,
    sessions,
    toolset_owners,
    toolsets,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

JOBS_CHANNEL = "ptc_jobs"
"""``NOTIFY`` channel of job ends (``<job_id> ended``) and client waits (``<job_id> waiting``): docs/scaling.md."""
REPLICAS_CHANNEL = "ptc_replicas"
"""``NOTIFY`` channel of registry changes (``<instance_id> <state>``)."""
KEYS_CHANNEL = "ptc_keys"
"""``NOTIFY`` channel of idempotency claims bound or released (``store.key_digest``: 16 hex digits)."""
CALLBACKS_CHANNEL = "ptc_callbacks"
"""``NOTIFY`` channel of callbacks made due for any replica (``<job_id>``): a job marked lost (``save_lost``)."""

MIGRATION_LOCK = 0x70746317
"""``pg_advisory_xact_lock`` key held while migrating (ASCII "ptc" and the issue's number)."""

_JOB_COLUMNS = (
    jobs.c.job_id,
    jobs.c.status,
    jobs.c.instance_id,
    jobs.c.created_at,
    jobs.c.ended_at,
    jobs.c.view,
    jobs.c.summary,
    jobs.c.callback_pending,
    jobs.c.owner,
    jobs.c.instance_epoch,
)
_SUMMARY_COLUMNS = tuple(c for c in _JOB_COLUMNS if c is not jobs.c.view)
_KEY_COLUMNS = (
    idempotency_keys.c.owner,
    idempotency_keys.c.key,
    idempotency_keys.c.fingerprint,
    idempotency_keys.c.kind,
    idempotency_keys.c.resource_id,
    idempotency_keys.c.created_at,
    idempotency_keys.c.ends_by,
)
_CLAIM_COLUMNS = (
    *_KEY_COLUMNS,
    idempotency_keys.c.state,
    idempotency_keys.c.claim_token,
    idempotency_keys.c.claimed_by,
    idempotency_keys.c.claimed_epoch,
)


def async_url(url: str) -> sa.URL:
    """``postgresql://…`` (or ``postgres://``) as SQLAlchemy's URL for psycopg 3."""
    parsed = sa.make_url(url)
    return parsed.set(drivername="postgresql+psycopg")


def job_store(settings: Settings) -> JobStore:
    """The store ``settings`` choose: PostgreSQL with ``PTC_STORE_URL``, else SQLite at ``job_store_path()``."""
    if settings.store_url is not None:
        return PostgresJobStore(settings.store_url.get_secret_value(), timeout_s=settings.store_timeout_s)
    return SQLiteJobStore(settings.job_store_path())


def safe_url(url: str) -> str:
    """The URL for logs: the password (also one given as a query parameter, ``?password=``, ``?sslpassword=``)
    replaced by ``***``; an unparsable URL is not shown at all."""
    try:
        parsed = async_url(url)
        hidden = {k: "***" for k in parsed.query if "password" in k.lower()}  # libpq's password, sslpassword
        return parsed.update_query_dict(hidden).render_as_string(hide_password=True)
    except (sa.exc.ArgumentError, ValueError):
        return "postgresql (unparsable URL)"


def _job(row: Any, with_view: bool = True) -> StoredJob:
    return StoredJob(
        row.job_id,
        row.status,
        row.instance_id,
        datetime.fromisoformat(row.created_at),
        datetime.fromisoformat(row.ended_at) if row.ended_at else None,
        bytes(row.view) if with_view else b"",
        bytes(row.summary),
        bool(row.callback_pending),
        row.owner,
        row.instance_epoch,
    )


def _key(row: Any) -> IdempotencyRecord:
    return IdempotencyRecord(
        row.owner,
        row.key,
        row.fingerprint,
        row.kind,
        row.resource_id,
        datetime.fromisoformat(row.created_at),
        datetime.fromisoformat(row.ends_by) if row.ends_by else None,
    )


def _held(row: Any) -> IdempotencyRecord | KeyClaim:
    """A row of ``_CLAIM_COLUMNS``: its binding, or its claim."""
    if row.state == "bound":
        return _key(row)
    incarnation = Incarnation(row.claimed_by, int(row.claimed_epoch))
    return KeyClaim(row.owner, row.key, row.fingerprint, row.kind, row.claim_token, incarnation)


def _seconds(value: float) -> sa.ColumnElement[Any]:
    """``value`` seconds as a PostgreSQL interval."""
    return sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.literal(float(value), sa.Float))


async def _notify(conn: AsyncConnection, channel: str, payload: str) -> None:
    """``NOTIFY channel, payload`` in ``conn``'s transaction (sent when it commits)."""
    await conn.execute(sa.select(sa.func.pg_notify(channel, payload)))


def _live(incarnation: Incarnation) -> sa.ColumnElement[bool]:
    """``incarnation`` is live or draining in the registry."""
    r = replicas.c
    return sa.exists().where(
        r.instance_id == incarnation.instance_id, r.epoch == incarnation.epoch, r.state.in_(LIVE_STATES)
    )


async def add_pending_callback(conn: AsyncConnection, job_id: str) -> None:
    """In ``conn``'s transaction: the ``callbacks`` row of a job just ended by someone other than its owner (marked
    lost), ``pending`` and due now, and a ``ptc_callbacks`` notification (sent at commit) that wakes every
    replica's callback worker; nothing when the row exists. For a store method that ends jobs in its own
    transaction (``save_lost`` does; the reaper's batch may call this for each job it ends)."""
    await conn.execute(
        insert(callbacks)
        .values(job_id=job_id, state="pending", attempts=0, next_attempt_at=sa.func.now())
        .on_conflict_do_nothing(index_elements=[callbacks.c.job_id])
    )
    await _notify(conn, CALLBACKS_CHANNEL, job_id)


def _migrate(connection: sa.Connection) -> None:
    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")  # one replica at a time
    migrate.upgrade_connection(connection)


class PostgresJobStore(JobStore):
    """The shared store: one PostgreSQL database.

    Args:
        url: ``postgresql://user:password@host:port/db``.
        timeout_s: longest wait for one operation (s): connecting, a pooled connection, a statement.
        pool_size: connections kept open (more are opened up to twice this under load).
    """

    shares_output = True

    def __init__(self, url: str, timeout_s: float = 5.0, pool_size: int = 10) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._pool_size = pool_size
        self._engine: AsyncEngine | None = None
        self._abandoned: set[asyncio.Future[Any]] = set()  # operations past their deadline, still ending

    def describe(self) -> str:
        return safe_url(self._url)

    async def _call(self, operation: str, fn: Callable[[AsyncConnection], Awaitable[T]], write: bool = False) -> T:
        """Run ``fn`` on a pooled connection (in a transaction when ``write``) within the timeout.

        The operation runs as a task of its own: past the deadline the caller gets its answer at once, and the task
        is cancelled and left to end in the background (``_abandoned``). Cancelling in place is not enough: on a
        connection whose server stopped answering, the driver's cancel request times out and SQLAlchemy's clean-up
        then waits on the same silent socket, with no deadline left (a hang, then a driver error). Such a task
        holds its pooled connection until the socket answers or fails; the pool's wait is bounded, so the worst is
        more 503s, never a hang.

        Raises:
            StoreUnavailable: the database could not be reached, refused, or did not answer in time.
        """
        assert self._engine is not None, "the store is not open"
        task = asyncio.ensure_future(self._run(self._engine, fn, write))
        try:
            done, _ = await asyncio.wait({task}, timeout=self._timeout_s + 1)  # statement_timeout comes first
        except asyncio.CancelledError:  # the caller went away: so does its statement
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            log.warning("job store %s: %s did not answer within %.1f s", self.describe(), operation, self._timeout_s)
            raise StoreUnavailable(operation)
        try:
            return task.result()
        except (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError, TimeoutError, OSError) as exc:
            log.warning("job store %s: %s failed: %s", self.describe(), operation, type(exc).__name__, exc_info=exc)
            raise StoreUnavailable(operation) from exc
        except sa.exc.DBAPIError as exc:  # e.g. the server cancelled a statement past statement_timeout
            read_only = isinstance(exc.orig, psycopg.errors.ReadOnlySqlTransaction)  # a standby, after a fail-over
            if exc.connection_invalidated or read_only or "statement timeout" in str(exc.orig):
                log.warning("job store %s: %s failed", self.describe(), operation, exc_info=exc)
                raise StoreUnavailable(operation) from exc
            raise

    @staticmethod
    async def _run(engine: AsyncEngine, fn: Callable[[AsyncConnection], Awaitable[T]], write: bool) -> T:
        if write:
            async with engine.begin() as conn:
                return await fn(conn)
        async with engine.connect() as conn:
            return await fn(conn)

    def _abandon(self, task: asyncio.Future[Any]) -> None:
        """Cancel an operation nobody waits for any more; keep it referenced until it ends, its error logged."""
        task.cancel()
        self._abandoned.add(task)

        def ended(done: asyncio.Future[Any]) -> None:
            self._abandoned.discard(done)
            if not done.cancelled() and done.exception() is not None:
                log.info("job store %s: an abandoned operation ended: %r", self.describe(), done.exception())

        task.add_done_callback(ended)

    async def open(self) -> None:
        timeout_ms = int(self._timeout_s * 1000)
        self._engine = create_async_engine(
            async_url(self._url),
            pool_size=self._pool_size,
            max_overflow=self._pool_size,
            pool_timeout=self._timeout_s,
            pool_pre_ping=True,
            connect_args={
                "connect_timeout": max(1, round(self._timeout_s)),
                "options": f"-c statement_timeout={timeout_ms}",
                "application_name": "ptc-sandbox",
            },
        )

        async def upgrade(conn: AsyncConnection) -> None:
            await conn.run_sync(_migrate)

        try:
            await self._call("migrate", upgrade)
        except BaseException:
            await self._engine.dispose()
            self._engine = None
            raise

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    async def ping(self) -> None:
        async def select(conn: AsyncConnection) -> None:
            await conn.execute(sa.text("SELECT 1"))

        await self._call("ping", select)

    async def put(self, job: StoredJob) -> None:
        values = {
            "job_id": job.job_id,
            "status": job.status,
            "instance_id": job.instance_id,
            "created_at": job.created_at.isoformat(),
            "ended_at": job.ended_at.isoformat() if job.ended_at else None,
            "view": job.view,
            "summary": job.summary,
            "callback_pending": int(job.callback_pending),
            "owner": job.owner,
        }
        statement = insert(jobs).values(values)
        statement = statement.on_conflict_do_update(
            index_elements=[jobs.c.job_id], set_={k: statement.excluded[k] for k in values if k != "job_id"}
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)
            if job.ended_at is not None:  # an ended job re-saved (marked lost, a callback's state): caches drop it
                await _notify(conn, JOBS_CHANNEL, f"{job.job_id} saved")

        await self._call("put", run, write=True)

    async def get(self, job_id: str) -> StoredJob | None:
        if not storable(job_id):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None

        async def run(conn: AsyncConnection) -> StoredJob | None:
            row = (await conn.execute(sa.select(*_JOB_COLUMNS).where(jobs.c.job_id == job_id))).first()
            return _job(row) if row else None

        return await self._call("get", run)

    async def page(self, query: JobQuery) -> tuple[list[StoredJob], str | None]:
        statement = sa.select(*_SUMMARY_COLUMNS)
        if query.owner is not None:
            statement = statement.where(jobs.c.owner == query.owner)
        if query.statuses:
            statement = statement.where(jobs.c.status.in_(list(query.statuses)))
        if query.created_after is not None:
            statement = statement.where(jobs.c.created_at > query.created_after.isoformat())
        if query.created_before is not None:
            statement = statement.where(jobs.c.created_at < query.created_before.isoformat())
        if query.cursor:
            created, job_id = decode_cursor(query.cursor)
            after = sa.tuple_(sa.literal(created), sa.literal(job_id))
            statement = statement.where(sa.tuple_(jobs.c.created_at, jobs.c.job_id) < after)
        statement = statement.order_by(jobs.c.created_at.desc(), jobs.c.job_id.desc()).limit(query.limit + 1)

        async def run(conn: AsyncConnection) -> list[StoredJob]:
            return [_job(row, with_view=False) for row in await conn.execute(statement)]

        rows = await self._call("page", run)
        page = rows[: query.limit]
        more = len(rows) > query.limit
        return page, encode_cursor(page[-1].created_at, page[-1].job_id) if more and page else None

    async def _jobs(self, operation: str, where: sa.ColumnElement[bool]) -> list[StoredJob]:
        async def run(conn: AsyncConnection) -> list[StoredJob]:
            return [_job(row) for row in await conn.execute(sa.select(*_JOB_COLUMNS).where(where))]

        return await self._call(operation, run)

    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        return await self._jobs("unfinished", sa.and_(jobs.c.instance_id == instance_id, jobs.c.ended_at.is_(None)))

    async def claim_callbacks(
        self, incarnation: Incarnation, limit: int, room: Callable[[str | None], int]
    ) -> list[CallbackClaim]:
        if limit <= 0:
            return []
        c, r = callbacks.c, replicas.c
        claimer_live = sa.exists().where(
            r.instance_id == c.claimed_by, r.epoch == c.claimed_epoch, r.state.in_(LIVE_STATES)
        )
        candidates = (
            sa.select(c.job_id, jobs.c.owner, c.attempts, c.state)
            .join(jobs, jobs.c.job_id == c.job_id)
            .where(
                sa.or_(
                    sa.and_(c.state == "pending", c.next_attempt_at <= sa.func.now()),
                    sa.and_(c.state == "delivering", ~claimer_live),
                ),
                _live(incarnation),
            )
            .order_by(c.next_attempt_at, c.job_id)
            .limit(limit * CLAIM_SCAN)
            .with_for_update(of=callbacks, skip_locked=True)
        )

        async def run(conn: AsyncConnection) -> list[CallbackClaim]:
            rows = [(row.job_id, row.owner, row.attempts, row.state) for row in await conn.execute(candidates)]
            chosen = choose_claims(rows, limit, room)
            if chosen:  # the rows are locked by this transaction: nobody else claims them meanwhile
                await conn.execute(
                    sa.update(callbacks)
                    .where(c.job_id.in_([claim.job_id for claim in chosen]))
                    .values(state="delivering", claimed_by=incarnation.instance_id, claimed_epoch=incarnation.epoch)
                )
            return chosen

        return await self._call("claim_callbacks", run, write=True)

    async def end_callback(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        c = callbacks.c
        statement = (
            sa.update(callbacks)
            .where(
                c.job_id == job_id,
                c.claimed_by == incarnation.instance_id,
                c.claimed_epoch == incarnation.epoch,
                c.state == "delivering",
            )
            .values(state=state, attempts=attempts)
        )

        async def run(conn: AsyncConnection) -> bool:
            return bool((await conn.execute(statement)).rowcount)

        return await self._call("end_callback", run, write=True)

    async def callback(self, job_id: str) -> CallbackRow | None:
        if not storable(job_id):
            return None
        c = callbacks.c
        statement = sa.select(c.state, c.claimed_by, c.claimed_epoch, c.attempts).where(c.job_id == job_id)

        async def run(conn: AsyncConnection) -> CallbackRow | None:
            row = (await conn.execute(statement)).first()
            if row is None:
                return None
            by = Incarnation(row.claimed_by, int(row.claimed_epoch)) if row.claimed_by is not None else None
            return CallbackRow(job_id, row.state, by, int(row.attempts))

        return await self._call("callback", run)

    async def save_lost(self, job: StoredJob) -> bool:
        end = (
            sa.update(jobs)
            .where(jobs.c.job_id == job.job_id, jobs.c.ended_at.is_(None))
            .values(
                status=job.status,
                ended_at=job.ended_at.isoformat() if job.ended_at else None,
                view=job.view,
                summary=job.summary,
                callback_pending=int(job.callback_pending),
            )
        )

        async def run(conn: AsyncConnection) -> bool:
            if not (await conn.execute(end)).rowcount:
                return False
            if job.callback_pending:
                await add_pending_callback(conn, job.job_id)
            await _notify(conn, JOBS_CHANNEL, f"{job.job_id} ended")
            return True

        return await self._call("save_lost", run, write=True)

    async def purge(self, ended_before: datetime, instance_id: str | None = None) -> list[str]:
        cutoff = ended_before.isoformat()
        expired = sa.select(jobs.c.job_id).where(jobs.c.ended_at < cutoff)
        if instance_id is not None:  # each replica its own (see JobStore.purge)
            expired = expired.where(jobs.c.instance_id == instance_id)

        async def run(conn: AsyncConnection) -> list[str]:  # one transaction, as in SQLite
            ids = [row.job_id for row in await conn.execute(expired)]
            keys = idempotency_keys.c
            await conn.execute(sa.delete(idempotency_keys).where(keys.kind == "job", keys.resource_id.in_(expired)))
            await conn.execute(sa.delete(job_blobs).where(job_blobs.c.job_id.in_(expired)))
            await conn.execute(sa.delete(jobs).where(jobs.c.job_id.in_(expired)))
            await conn.execute(sa.delete(idempotency_keys).where(keys.kind == "session", keys.ends_by < cutoff))
            await conn.execute(sa.delete(idempotency_keys).where(keys.state == "claimed", keys.created_at < cutoff))
            await conn.execute(
                sa.delete(idempotency_keys).where(
                    keys.kind == "job",
                    keys.created_at < cutoff,
                    ~sa.exists().where(jobs.c.job_id == keys.resource_id),
                )
            )
            return ids

        return await self._call("purge", run, write=True)

    async def count(self) -> int:
        async def run(conn: AsyncConnection) -> int:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(jobs))).scalar_one())

        return await self._call("count", run)

    async def bind_idempotency_key(self, record: IdempotencyRecord) -> IdempotencyRecord:
        statement = (
            insert(idempotency_keys)
            .values(
                owner=record.owner,
                key=record.key,
                fingerprint=record.fingerprint,
                kind=record.kind,
                resource_id=record.resource_id,
                created_at=record.created_at.isoformat(),
                ends_by=record.ends_by.isoformat() if record.ends_by else None,
            )
            .on_conflict_do_nothing(index_elements=[idempotency_keys.c.owner, idempotency_keys.c.key])
        )

        async def run(conn: AsyncConnection) -> IdempotencyRecord:
            await conn.execute(statement)
            row = (await conn.execute(self._key_query(record.owner, record.key))).one()
            return _key(row)

        return await self._call("bind_idempotency_key", run, write=True)

    @staticmethod
    def _key_query(owner: str, key: str) -> sa.Select[Any]:
        k = idempotency_keys.c
        return sa.select(*_KEY_COLUMNS).where(k.owner == owner, k.key == key, k.state == "bound")

    async def claim_idempotency_key(
        self, claim: KeyClaim, created_at: datetime, orphan: str | None = None
    ) -> IdempotencyRecord | KeyClaim:
        k = idempotency_keys.c
        claimer = {
            "fingerprint": claim.fingerprint,
            "kind": claim.kind,
            "created_at": created_at.isoformat(),
            "claim_token": claim.claim_token,
            "claimed_by": claim.claimed_by.instance_id,
            "claimed_epoch": claim.claimed_by.epoch,
        }
        new = (
            insert(idempotency_keys)
            .values(owner=claim.owner, key=claim.key, state="claimed", resource_id=None, ends_by=None, **claimer)
            .on_conflict_do_nothing(index_elements=[k.owner, k.key])
            .returning(k.owner)
        )
        live = sa.exists().where(
            replicas.c.instance_id == k.claimed_by,
            replicas.c.epoch == k.claimed_epoch,
            replicas.c.state.in_(LIVE_STATES),
            replicas.c.lease_until > sa.func.now(),
        )
        take_over = (
            sa.update(idempotency_keys)
            .where(
                k.owner == claim.owner,
                k.key == claim.key,
                k.state == "claimed",
                sa.or_(~live, k.claim_token == orphan) if orphan is not None else ~live,
            )
            .values(**claimer)
            .returning(k.owner)
        )
        held = sa.select(*_CLAIM_COLUMNS).where(k.owner == claim.owner, k.key == claim.key)

        async def run(conn: AsyncConnection) -> IdempotencyRecord | KeyClaim:
            while True:  # a row released between the insert and the read: insert again
                if (await conn.execute(new)).first() is not None:  # waits for a racing insert to commit
                    return claim
                if (await conn.execute(take_over)).first() is not None:  # its claimer died
                    return claim
                row = (await conn.execute(held)).first()
                if row is not None:
                    return _held(row)

        return await self._call("claim_idempotency_key", run, write=True)

    async def bind_claim(self, record: IdempotencyRecord, claim_token: str) -> bool:
        k = idempotency_keys.c
        statement = (
            sa.update(idempotency_keys)
            .where(k.owner == record.owner, k.key == record.key, k.state == "claimed", k.claim_token == claim_token)
            .values(
                state="bound",
                resource_id=record.resource_id,
                created_at=record.created_at.isoformat(),
                ends_by=record.ends_by.isoformat() if record.ends_by else None,
                fingerprint=record.fingerprint,
                kind=record.kind,
            )
            .returning(k.owner)
        )
        return await self._claim_ended("bind_claim", statement, record.owner, record.key)

    async def release_claim(self, owner: str, key: str, claim_token: str) -> bool:
        k = idempotency_keys.c
        statement = (
            sa.delete(idempotency_keys)
            .where(k.owner == owner, k.key == key, k.state == "claimed", k.claim_token == claim_token)
            .returning(k.owner)
        )
        return await self._claim_ended("release_claim", statement, owner, key)

    async def _claim_ended(self, operation: str, statement: Any, owner: str, key: str) -> bool:
        """Run ``bind_claim``'s or ``release_claim``'s statement; notify ``ptc_keys`` when it matched a row."""

        async def run(conn: AsyncConnection) -> bool:
            if (await conn.execute(statement)).first() is None:
                return False
            await _notify(conn, KEYS_CHANNEL, key_digest(owner, key))  # delivered once the change is committed
            return True

        return await self._call(operation, run, write=True)

    async def idempotency_key(self, owner: str, key: str) -> IdempotencyRecord | None:
        if not storable(owner, key):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None

        async def run(conn: AsyncConnection) -> IdempotencyRecord | None:
            row = (await conn.execute(self._key_query(owner, key))).first()
            return _key(row) if row else None

        return await self._call("idempotency_key", run)

    async def put_toolset(self, toolset_id: str, manifest: bytes, owner: str) -> None:
        created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"  # as SQLite's default
        add_toolset = (
            insert(toolsets)
            .values(toolset_id=toolset_id, manifest=manifest, created_at=created)
            .on_conflict_do_nothing(index_elements=[toolsets.c.toolset_id])
        )
        add_owner = (
            insert(toolset_owners)
            .values(toolset_id=toolset_id, owner=owner)
            .on_conflict_do_nothing(index_elements=[toolset_owners.c.toolset_id, toolset_owners.c.owner])
        )

        async def run(conn: AsyncConnection) -> None:  # one transaction: never a toolset without its owner
            await conn.execute(add_toolset)
            await conn.execute(add_owner)

        await self._call("put_toolset", run, write=True)

    async def get_toolset(self, toolset_id: str, owner: str | None) -> bytes | None:
        if not storable(toolset_id):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None
        statement = sa.select(toolsets.c.manifest).where(toolsets.c.toolset_id == toolset_id)
        if owner is not None:
            statement = statement.join(toolset_owners, toolset_owners.c.toolset_id == toolsets.c.toolset_id).where(
                toolset_owners.c.owner == owner
            )

        async def run(conn: AsyncConnection) -> bytes | None:
            value = (await conn.execute(statement)).scalar_one_or_none()
            return bytes(value) if value is not None else None

        return await self._call("get_toolset", run)

    async def put_blobs(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        if not blobs:
            return
        statement = insert(job_blobs).values([{"job_id": job_id, "name": n, "data": d} for n, d in blobs.items()])
        statement = statement.on_conflict_do_update(
            index_elements=[job_blobs.c.job_id, job_blobs.c.name], set_={"data": statement.excluded.data}
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)

        await self._call("put_blobs", run, write=True)

    async def read_blob(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        if not storable(job_id, name):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None
        part = (
            sa.func.substring(job_blobs.c.data, offset + 1)
            if length is None
            else sa.func.substring(job_blobs.c.data, offset + 1, length)
        )
        statement = sa.select(part.label("data")).where(job_blobs.c.job_id == job_id, job_blobs.c.name == name)

        async def run(conn: AsyncConnection) -> bytes | None:
            value = (await conn.execute(statement)).scalar_one_or_none()
            return bytes(value) if value is not None else None

        return await self._call("read_blob", run)

    async def blob_sizes(self, job_id: str) -> dict[str, int]:
        if not storable(job_id):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return {}
        statement = sa.select(job_blobs.c.name, sa.func.length(job_blobs.c.data)).where(job_blobs.c.job_id == job_id)

        async def run(conn: AsyncConnection) -> dict[str, int]:
            return {name: int(size) for name, size in await conn.execute(statement)}

        return await self._call("blob_sizes", run)

    async def save(self, job: StoredJob, incarnation: Incarnation) -> bool:
        values: dict[str, Any] = {
            "job_id": job.job_id,
            "status": job.status,
            "instance_id": incarnation.instance_id,  # the owner's, whatever ``job`` says
            "created_at": job.created_at.isoformat(),
            "ended_at": job.ended_at.isoformat() if job.ended_at else None,
            "view": job.view,
            "summary": job.summary,
            "callback_pending": int(job.callback_pending),
            "owner": job.owner,
            "instance_epoch": incarnation.epoch,
        }
        live = sa.exists().where(
            replicas.c.instance_id == incarnation.instance_id,
            replicas.c.epoch == incarnation.epoch,
            replicas.c.state.in_(LIVE_STATES),
        )
        source = sa.select(*(sa.literal(value, jobs.c[name].type).label(name) for name, value in values.items()))
        upsert = insert(jobs).from_select(list(values), source.where(live))
        statement = upsert.on_conflict_do_update(
            index_elements=[jobs.c.job_id],
            set_={k: upsert.excluded[k] for k in ("status", "ended_at", "view", "summary", "callback_pending")},
            where=sa.and_(
                jobs.c.instance_id == upsert.excluded.instance_id,
                jobs.c.instance_epoch == upsert.excluded.instance_epoch,
                jobs.c.ended_at.is_(None),
            ),
        ).returning(jobs.c.job_id)
        word = "ended" if job.ended_at is not None else "waiting" if job.status == "waiting" else None
        delivering = job.ended_at is not None and job.callback_pending

        async def run(conn: AsyncConnection) -> bool:
            if (await conn.execute(statement)).first() is None:  # the driver gives no rowcount for this insert
                return False
            if word is not None:  # in the transaction: delivered only once the row is committed
                await _notify(conn, JOBS_CHANNEL, f"{job.job_id} {word}")
            if delivering:  # the end and its callback's row, claimed by the owner, in one transaction
                await conn.execute(
                    insert(callbacks)
                    .values(
                        job_id=job.job_id,
                        state="delivering",
                        claimed_by=incarnation.instance_id,
                        claimed_epoch=incarnation.epoch,
                        attempts=0,
                        next_attempt_at=sa.func.now(),
                    )
                    .on_conflict_do_nothing(index_elements=[callbacks.c.job_id])
                )
            return True

        return await self._call("save", run, write=True)

    async def expire_replicas(self, by: str) -> dict[Incarnation, float]:
        r = replicas.c
        passed = sa.and_(r.state.in_(LIVE_STATES), r.lease_until < sa.func.now())
        locked = sa.select(r.instance_id).where(passed).with_for_update(skip_locked=True)
        statement = (
            sa.update(replicas)
            .where(r.instance_id.in_(locked), passed)
            .values(state="expired", ended_at=sa.func.now(), expired_by=by)
            .returning(r.instance_id, r.epoch, sa.extract("epoch", r.ended_at - r.heartbeat_at).label("silent_s"))
        )

        async def run(conn: AsyncConnection) -> dict[Incarnation, float]:
            expired = {
                Incarnation(row.instance_id, int(row.epoch)): float(row.silent_s or 0.0)
                for row in await conn.execute(statement)
            }
            for incarnation in expired:
                await _notify(conn, REPLICAS_CHANNEL, f"{incarnation.instance_id} expired")
            return expired

        return await self._call("expire_replicas", run, write=True)

    async def orphans(self, limit: int) -> list[StoredJob]:
        r = replicas.c
        alive = sa.exists().where(
            r.instance_id == jobs.c.instance_id, r.epoch == jobs.c.instance_epoch, r.state.in_(LIVE_STATES)
        )
        statement = sa.select(*_JOB_COLUMNS).where(jobs.c.ended_at.is_(None), ~alive).limit(limit)

        async def run(conn: AsyncConnection) -> list[StoredJob]:
            return [_job(row) for row in await conn.execute(statement)]

        return await self._call("orphans", run)

    async def orphan_sessions(self) -> list[Incarnation]:
        r, c = replicas.c, sessions.c
        alive = sa.exists().where(r.instance_id == c.instance_id, r.epoch == c.instance_epoch, r.state.in_(LIVE_STATES))
        statement = sa.select(c.instance_id, c.instance_epoch).where(c.ended_at.is_(None), ~alive).distinct()

        async def run(conn: AsyncConnection) -> list[Incarnation]:
            return [Incarnation(row.instance_id, int(row.instance_epoch)) for row in await conn.execute(statement)]

        return await self._call("orphan_sessions", run)

    async def register(self, registration: Registration) -> int:
        r = replicas.c
        lease = sa.func.now() + _seconds(registration.lease_s)
        placeholder = (
            insert(replicas)
            .values(
                instance_id=registration.instance_id,
                epoch=0,
                internal_url=registration.internal_url,
                work_dir_token=registration.work_dir_token,
                version=registration.version,
                state="left",
                started_at=sa.func.now(),
                heartbeat_at=sa.func.now(),
                lease_until=sa.func.now(),
            )
            .on_conflict_do_nothing(index_elements=[r.instance_id])
        )
        locked = (
            sa.select(r.epoch, r.work_dir_token, r.state, (r.lease_until > sa.func.now()).label("holding"))
            .where(r.instance_id == registration.instance_id)
            .with_for_update()
        )

        async def run(conn: AsyncConnection) -> int:
            await conn.execute(placeholder)  # a first start: a row to lock (racing starts meet on it)
            row = (await conn.execute(locked)).one()
            if row.state in LIVE_STATES and row.holding and row.work_dir_token != registration.work_dir_token:
                raise InstanceIdInUse(in_use_message(registration.instance_id))
            epoch = int(row.epoch) + 1
            await conn.execute(
                sa.update(replicas)
                .where(r.instance_id == registration.instance_id)
                .values(
                    epoch=epoch,
                    internal_url=registration.internal_url,
                    work_dir_token=registration.work_dir_token,
                    version=registration.version,
                    state="live",
                    started_at=sa.func.now(),
                    heartbeat_at=sa.func.now(),
                    lease_until=lease,
                    ended_at=None,
                    expired_by=None,
                )
            )
            await _notify(conn, REPLICAS_CHANNEL, f"{registration.instance_id} live")
            return epoch

        return await self._call("register", run, write=True)

    async def renew(self, incarnation: Incarnation, lease_s: float) -> bool:
        r = replicas.c
        statement = (
            sa.update(replicas)
            .where(r.instance_id == incarnation.instance_id, r.epoch == incarnation.epoch, r.state.in_(LIVE_STATES))
            .values(heartbeat_at=sa.func.now(), lease_until=sa.func.now() + _seconds(lease_s))
        )

        async def run(conn: AsyncConnection) -> bool:
            return bool((await conn.execute(statement)).rowcount)

        return await self._call("renew", run, write=True)

    async def set_replica_state(self, incarnation: Incarnation, state: str) -> bool:
        r = replicas.c
        statement = (
            sa.update(replicas)
            .where(r.instance_id == incarnation.instance_id, r.epoch == incarnation.epoch, r.state.in_(LIVE_STATES))
            .values(state=state, ended_at=sa.func.now() if state == "left" else None)
        )

        async def run(conn: AsyncConnection) -> bool:
            if not (await conn.execute(statement)).rowcount:
                return False
            await _notify(conn, REPLICAS_CHANNEL, f"{incarnation.instance_id} {state}")
            return True

        return await self._call("set_replica_state", run, write=True)

    async def replicas(self) -> list[Replica]:
        r = replicas.c
        left = sa.func.extract("epoch", r.lease_until - sa.func.now()).label("left")
        statement = sa.select(r.instance_id, r.epoch, r.internal_url, r.version, r.state, left)

        async def run(conn: AsyncConnection) -> list[Replica]:
            return [
                Replica(row.instance_id, int(row.epoch), row.internal_url, row.version, row.state, float(row.left))
                for row in await conn.execute(statement)
            ]

        return await self._call("replicas", run)

    async def save_session(self, session: StoredSession, incarnation: Incarnation) -> bool:
        values: dict[str, Any] = {
            "session_id": session.session_id,
            "owner": session.owner,
            "instance_id": incarnation.instance_id,
            "instance_epoch": incarnation.epoch,
            "status": session.status,
            "created_at": session.created_at.isoformat(),
            "ended_at": session.ended_at.isoformat() if session.ended_at else None,
            "ends_by": session.ends_by.isoformat(),
            "view": session.view,
        }
        live = sa.exists().where(
            replicas.c.instance_id == incarnation.instance_id,
            replicas.c.epoch == incarnation.epoch,
            replicas.c.state.in_(LIVE_STATES),
        )
        source = sa.select(*(sa.literal(value, sessions.c[name].type).label(name) for name, value in values.items()))
        upsert = insert(sessions).from_select(list(values), source.where(live))
        statement = upsert.on_conflict_do_update(
            index_elements=[sessions.c.session_id],
            set_={k: upsert.excluded[k] for k in ("status", "ended_at", "view")},
            where=sa.and_(
                sessions.c.instance_id == upsert.excluded.instance_id,
                sessions.c.instance_epoch == upsert.excluded.instance_epoch,
                sessions.c.ended_at.is_(None),
            ),
        ).returning(sessions.c.session_id)

        async def run(conn: AsyncConnection) -> bool:
            return (await conn.execute(statement)).first() is not None

        return await self._call("save_session", run, write=True)

    async def get_session(self, session_id: str) -> StoredSession | None:
        if not storable(session_id):
            return None

        async def run(conn: AsyncConnection) -> StoredSession | None:
            row = (await conn.execute(sa.select(sessions).where(sessions.c.session_id == session_id))).first()
            return _session(row) if row else None

        return await self._call("get_session", run)

    async def open_sessions(self, owner: str | None) -> list[StoredSession]:
        statement = sa.select(sessions).where(sessions.c.ended_at.is_(None))
        if owner is not None:
            statement = statement.where(sessions.c.owner == owner)
        statement = statement.order_by(sessions.c.created_at, sessions.c.session_id)

        async def run(conn: AsyncConnection) -> list[StoredSession]:
            return [_session(row) for row in await conn.execute(statement)]

        return await self._call("open_sessions", run)

    async def break_sessions(self, incarnation: Incarnation, reason: str = SESSION_BROKEN) -> list[str]:
        s = sessions.c
        select = (
            sa.select(s.session_id, s.view)
            .where(s.instance_id == incarnation.instance_id, s.instance_epoch == incarnation.epoch)
            .where(s.ended_at.is_(None))
            .with_for_update(skip_locked=True)
        )

        async def run(conn: AsyncConnection) -> list[str]:
            now = datetime.now(UTC)
            broken = []
            for row in (await conn.execute(select)).all():
                update = (
                    sa.update(sessions)
                    .where(s.session_id == row.session_id, s.ended_at.is_(None))
                    .values(status="broken", ended_at=now.isoformat(), view=broken_view(bytes(row.view), now, reason))
                )
                if (await conn.execute(update)).rowcount:
                    broken.append(str(row.session_id))
            return broken

        return await self._call("break_sessions", run, write=True)


def _session(row: Any) -> StoredSession:
    return StoredSession(
        row.session_id,
        row.owner,
        row.instance_id,
        int(row.instance_epoch),
        row.status,
        datetime.fromisoformat(row.created_at),
        datetime.fromisoformat(row.ended_at) if row.ended_at else None,
        datetime.fromisoformat(row.ends_by),
        bytes(row.view),
    )
