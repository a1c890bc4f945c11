"""The PostgreSQL database the shared store's resources share (``PTC_STORE_URL``; issue 17).

SQLAlchemy 2 Core on psycopg 3's asyncio driver: no statement blocks the event loop. Every operation is bounded by
``PTC_STORE_TIMEOUT_S`` (connect, pool wait, the server's ``statement_timeout``, and an overall deadline); a store
that is down or slow raises ``StoreUnavailable`` (503 ``store-unavailable``), never hangs a request. The URL's
password is never logged nor put in an error: ``describe`` hides it, and driver errors (whose text may name the
server) are chained and logged, not shown.

Tables: ``service.store.tables`` (times as ISO text, as in SQLite, so cursors compare the same); migrations run at
``open`` under an advisory lock, so replicas starting together migrate once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from service.errors import StoreUnavailable
from service.store import migrate
from service.store.registry import LIVE_STATES, Incarnation
from service.store.tables import replicas

log = logging.getLogger(__name__)
T = TypeVar("T")

JOBS_CHANNEL = "ptc_jobs"
"""``NOTIFY`` channel of job ends (``<job_id> ended``) and client waits (``<job_id> waiting``): docs/scaling.md."""
REPLICAS_CHANNEL = "ptc_replicas"
"""``NOTIFY`` channel of registry changes (``<instance_id> <state>``)."""
KEYS_CHANNEL = "ptc_keys"
"""``NOTIFY`` channel of idempotency claims bound or released (``keys.key_digest``: 16 hex digits)."""
CALLBACKS_CHANNEL = "ptc_callbacks"
"""``NOTIFY`` channel of callbacks made due for any replica (``<job_id>``): a job marked lost (``save_lost``)."""

MIGRATION_LOCK = 0x70746317
"""``pg_advisory_xact_lock`` key held while migrating (ASCII "ptc" and the issue's number)."""

Operation = Callable[[AsyncConnection], Awaitable[T]]
"""What a resource runs on a pooled connection (``PostgresDatabase.call``)."""


def async_url(url: str) -> sa.URL:
    """``postgresql://…`` (or ``postgres://``) as SQLAlchemy's URL for psycopg 3."""
    parsed = sa.make_url(url)
    return parsed.set(drivername="postgresql+psycopg")


def safe_url(url: str) -> str:
    """The URL for logs: the password (also one given as a query parameter, ``?password=``, ``?sslpassword=``)
    replaced by ``***``; an unparsable URL is not shown at all."""
    try:
        parsed = async_url(url)
        hidden = {k: "***" for k in parsed.query if "password" in k.lower()}  # libpq's password, sslpassword
        return parsed.update_query_dict(hidden).render_as_string(hide_password=True)
    except (sa.exc.ArgumentError, ValueError):
        return "postgresql (unparsable URL)"


def seconds(value: float) -> sa.ColumnElement[Any]:
    """``value`` seconds as a PostgreSQL interval."""
    return sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.literal(float(value), sa.Float))


async def notify(conn: AsyncConnection, channel: str, payload: str) -> None:
    """``NOTIFY channel, payload`` in ``conn``'s transaction (sent when it commits)."""
    await conn.execute(sa.select(sa.func.pg_notify(channel, payload)))


def typed_text(sql: str, table: sa.Table) -> sa.TextClause:
    """``sql`` (named parameters ``:column``) with each parameter of a column of ``table`` typed as the column: a
    ``bytea`` stays bytes where PostgreSQL cannot infer it (``INSERT … SELECT :view``)."""
    return sa.text(sql).bindparams(*(sa.bindparam(column.name, type_=column.type) for column in table.columns))


def is_live(incarnation: Incarnation) -> sa.ColumnElement[bool]:
    """``incarnation`` is live or draining in the registry."""
    r = replicas.c
    return sa.exists().where(
        r.instance_id == incarnation.instance_id, r.epoch == incarnation.epoch, r.state.in_(LIVE_STATES)
    )


def _migrate(connection: sa.Connection) -> None:
    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")  # one replica at a time
    migrate.upgrade_connection(connection)


class PostgresDatabase:
    """One PostgreSQL database and its connection pool.

    Args:
        url: ``postgresql://user:password@host:port/db``.
        timeout_s: longest wait for one operation (s): connecting, a pooled connection, a statement.
        pool_size: connections kept open (more are opened up to twice this under load).
    """

    def __init__(self, url: str, timeout_s: float = 5.0, pool_size: int = 10) -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._pool_size = pool_size
        self._engine: AsyncEngine | None = None
        self._abandoned: set[asyncio.Future[Any]] = set()  # operations past their deadline, still ending

    def describe(self) -> str:
        """The URL without its password."""
        return safe_url(self.url)

    async def call(self, operation: str, fn: Operation[T], write: bool = False) -> T:
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
    async def _run(engine: AsyncEngine, fn: Operation[T], write: bool) -> T:
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
        """Make the pool and migrate the database to ``HEAD`` (under ``MIGRATION_LOCK``).

        Raises:
            StoreUnavailable: as ``call``.
        """
        timeout_ms = int(self._timeout_s * 1000)
        self._engine = create_async_engine(
            async_url(self.url),
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
            await self.call("migrate", upgrade)
        except BaseException:
            await self._engine.dispose()
            self._engine = None
            raise

    async def close(self) -> None:
        """Close the pool's connections."""
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    async def ping(self) -> None:
        """``SELECT 1``.

        Raises:
            StoreUnavailable: as ``call``.
        """

        async def select(conn: AsyncConnection) -> None:
            await conn.execute(sa.text("SELECT 1"))

        await self.call("ping", select)
