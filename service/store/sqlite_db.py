"""The SQLite database the embedded store's resources share: one file, one connection, one thread.

Settings: WAL journal, ``synchronous=NORMAL`` (a committed job survives a crash of the process, including
``kill -9``; the last commits may be lost only on power failure:
https://www.sqlite.org/pragma.html#pragma_synchronous). Every statement runs on one dedicated thread, never on the
event loop. Versioned migrations (``service.store.migrate``, Alembic) make and upgrade the tables at open.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from service.store.migrations import HEAD
from service.store.registry import LIVE_STATES, Incarnation

T = TypeVar("T")


class SQLiteDatabase:
    """One SQLite file and the thread its statements run on.

    Args:
        path: the database file (created with its folder when missing).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptc-store")
        self._db: sqlite3.Connection | None = None

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` on the store's thread; its result (a cursor's rows read there, not a cursor to
        read later: a cursor finalized on the event loop races the thread's next statement)."""

        def call() -> T:
            assert self._db is not None, "the store is not open"
            return fn(self._db)

        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def changed(self, sql: str, params: Sequence[object]) -> bool:
        """Run one writing statement; whether it changed a row."""
        return await self.run(lambda db: db.execute(sql, params).rowcount > 0)

    async def open(self) -> None:
        """Open the file (made with mode 0600: outputs, arguments and results are for the service only) and
        migrate it to ``HEAD`` when it is new or older."""

        def connect() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            if _revision(db) != HEAD:  # a new file, or one of an older schema: migrations (Alembic, imported then)
                import sqlalchemy

                from service.store import migrate

                migrate.upgrade(sqlalchemy.URL.create("sqlite", database=str(self.path)))
            os.chmod(self.path, 0o600)
            self._db = db

        await asyncio.get_running_loop().run_in_executor(self._thread, connect)

    async def close(self) -> None:
        """Close the connection and end the thread."""

        def disconnect() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await asyncio.get_running_loop().run_in_executor(self._thread, disconnect)
        self._thread.shutdown(wait=True)


@contextmanager
def transaction(db: sqlite3.Connection, immediate: bool = False) -> Iterator[None]:
    """One transaction on the SQLite store's thread: committed when the block ends (a ``return`` in it too), rolled
    back when it raises. ``immediate``: take the file's write lock at once (a read then a write as one step)."""
    db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def is_live(db: sqlite3.Connection, incarnation: Incarnation) -> bool:
    """Whether ``incarnation`` is live or draining in the SQLite store's registry, its lease holding."""
    row = db.execute(
        "SELECT state, lease_until FROM replicas WHERE instance_id = ? AND epoch = ?",
        (incarnation.instance_id, incarnation.epoch),
    ).fetchone()
    return row is not None and row[0] in LIVE_STATES and datetime.fromisoformat(row[1]) > datetime.now(UTC)


def _revision(db: sqlite3.Connection) -> str | None:
    """The migration revision of a SQLite store (None: never migrated)."""
    try:
        row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.OperationalError:  # no such table
        return None
    return str(row[0]) if row else None
