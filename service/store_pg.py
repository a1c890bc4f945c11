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
    LIVE_STATES,
    SESSION_BROKEN,
    IdempotencyRecord,
    Incarnation,
    JobQuery,
    JobStore,
    Registration,
    Replica,
    SQLiteJobStore,
    StoredJob,
    StoredSession,
    broken_view,
    decode_cursor,
    encode_cursor,
    in_use_message,
    storable,
)
from service.store_schema import idempotency_keys, job_blobs, jobs, replicas, sessions, toolset_owners, toolsets

log = logging.getLogger(__name__)
T = TypeVar("T")

JOBS_CHANNEL = "ptc_jobs"
"""``NOTIFY`` channel of job ends (``<job_id> ended``) and client waits (``<job_id> waiting``): docs/scaling.md."""
REPLICAS_CHANNEL = "ptc_replicas"
"""``NOTIFY`` channel of registry changes (``<instance_id> <state>``)."""

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


def _seconds(value: float) -> sa.ColumnElement[Any]:
    """``value`` seconds as a PostgreSQL interval."""
    return sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.literal(float(value), sa.Float))


async def _notify(conn: AsyncConnection, channel: str, payload: str) -> None:
    """``NOTIFY channel, payload`` in ``conn``'s transaction (sent when it commits)."""
    await conn.execute(sa.select(sa.func.pg_notify(channel, payload)))


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

    async def callbacks_pending(self, instance_id: str) -> list[StoredJob]:
        return await self._jobs(
            "callbacks_pending", sa.and_(jobs.c.instance_id == instance_id, jobs.c.callback_pending == 1)
        )

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
        return sa.select(*_KEY_COLUMNS).where(idempotency_keys.c.owner == owner, idempotency_keys.c.key == key)

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

        async def run(conn: AsyncConnection) -> bool:
            if (await conn.execute(statement)).first() is None:  # the driver gives no rowcount for this insert
                return False
            if word is not None:  # in the transaction: delivered only once the row is committed
                await _notify(conn, JOBS_CHANNEL, f"{job.job_id} {word}")
            return True

        return await self._call("save", run, write=True)

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
