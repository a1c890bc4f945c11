"""The store's migrations (``service.store.migrate``, Alembic), run against both stores (``store_kind``:
SQLite, PostgreSQL): a fresh store, one made before migrations, downgrades, replicas migrating together.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from service.store import JobStore, migrate
from service.store.migrations import HEAD
from service.store.pg import PostgresJobStore
from service.store.pg_db import async_url
from service.store.sqlite import SQLiteJobStore
from tests.unit.store.rows import T0, job


def store_url(kind: str, make_store: Callable[[], JobStore], tmp_path: Path) -> str:
    """The SQLAlchemy URL of the store ``make_store`` makes."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.sqlite3'}"
    made = make_store()
    assert isinstance(made, PostgresJobStore)
    return async_url(made.url).render_as_string(hide_password=False)


async def test_a_fresh_store_is_migrated_to_head_and_again_changes_nothing(
    store_kind: str, make_store: Callable[[], JobStore], tmp_path: Path
) -> None:
    url = store_url(store_kind, make_store, tmp_path)
    opened = make_store()
    await opened.open()
    await opened.jobs.put(job("job_1", 0, 1))
    await opened.close()
    assert await asyncio.to_thread(migrate.current, url) == HEAD
    await asyncio.to_thread(migrate.upgrade, url)  # idempotent
    assert await asyncio.to_thread(migrate.current, url) == HEAD
    again = make_store()
    await again.open()
    try:
        assert await again.jobs.get("job_1") == job("job_1", 0, 1)
    finally:
        await again.close()


# The store exactly as the code before migrations made it (main before issue 17: service/store.py's schema and
# INSERT), with a row of each table.
_MAIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id      TEXT PRIMARY KEY,
    status      TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    ended_at    TEXT,
    view        BLOB NOT NULL,
    summary     BLOB NOT NULL,
    callback_pending INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS toolsets (
    toolset_id  TEXT PRIMARY KEY,
    manifest    BLOB NOT NULL,
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE TABLE IF NOT EXISTS toolset_owners (
    toolset_id  TEXT NOT NULL,
    owner       TEXT NOT NULL,
    PRIMARY KEY (toolset_id, owner)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS idempotency_keys (
    owner       TEXT NOT NULL,
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    kind        TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    ends_by     TEXT,
    PRIMARY KEY (owner, key)
) WITHOUT ROWID;
ALTER TABLE jobs ADD COLUMN owner TEXT;
CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created_at DESC, job_id DESC);
CREATE INDEX IF NOT EXISTS jobs_by_ended ON jobs (ended_at) WHERE ended_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_unfinished ON jobs (instance_id) WHERE ended_at IS NULL;
CREATE INDEX IF NOT EXISTS jobs_callback_pending ON jobs (instance_id) WHERE callback_pending = 1;
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, created_at DESC, job_id DESC);
CREATE INDEX IF NOT EXISTS idempotency_keys_by_resource ON idempotency_keys (resource_id);
CREATE INDEX IF NOT EXISTS idempotency_keys_by_end ON idempotency_keys (ends_by) WHERE ends_by IS NOT NULL;
"""


def main_store(path: Path) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(_MAIN_SCHEMA)
    row = job("job_main", 0, 1, pending=True)
    db.execute(
        "INSERT OR REPLACE INTO jobs (job_id, status, instance_id, created_at, ended_at, view, summary, "
        "callback_pending, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            row.job_id,
            row.status,
            row.instance_id,
            row.created_at.isoformat(),
            row.ended_at.isoformat() if row.ended_at else None,
            row.view,
            row.summary,
            1,
            row.owner,
        ),
    )
    db.execute("INSERT INTO toolsets (toolset_id, manifest) VALUES ('ts_1', x'7b7d')")
    db.execute("INSERT INTO toolset_owners VALUES ('ts_1', 'alice')")
    db.execute(
        "INSERT INTO idempotency_keys VALUES ('alice', 'k', 'ff', 'job', 'job_main', ?, NULL)", (T0.isoformat(),)
    )
    db.close()


async def test_a_sqlite_store_made_before_migrations_is_adopted_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    main_store(path)
    assert migrate.current(f"sqlite:///{path}") is None
    store = SQLiteJobStore(path)
    await store.open()
    try:
        assert await store.jobs.get("job_main") == job("job_main", 0, 1, pending=True)
        assert await store.toolsets.get("ts_1", "alice") == b"{}"
        assert (await store.keys.get("alice", "k")) is not None
        moved = await store.callbacks.get("job_main")  # its pending callback moved to the callbacks table (0006)
        assert moved is not None and moved.state == "pending" and moved.claimed_by is None
        await store.blobs.put("job_main", {"stdout": b"x"})  # the table of revision 0002 is there
    finally:
        await store.close()
    assert migrate.current(f"sqlite:///{path}") == HEAD
    reopened = SQLiteJobStore(path)
    await reopened.open()
    try:
        assert await reopened.jobs.count() == 1
        assert await reopened.blobs.read("job_main", "stdout") == b"x"
    finally:
        await reopened.close()


async def test_postgresql_migrations_make_the_tables_the_store_queries(postgres_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from service.store.tables import metadata

    store = PostgresJobStore(postgres_url)
    await store.open()
    await store.close()

    def differences() -> list[Any]:
        engine = sa.create_engine(async_url(postgres_url), poolclass=sa.NullPool)
        try:
            with engine.connect() as connection:
                return list(compare_metadata(MigrationContext.configure(connection), metadata))
        finally:
            engine.dispose()

    assert await asyncio.to_thread(differences) == []


async def test_replicas_opening_together_migrate_once(postgres_url: str) -> None:
    stores = [PostgresJobStore(postgres_url) for _ in range(3)]
    await asyncio.gather(*(s.open() for s in stores))
    await asyncio.gather(*(s.close() for s in stores))
    assert await asyncio.to_thread(migrate.current, async_url(postgres_url)) == HEAD


async def test_a_sqlite_path_with_url_characters_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "odd ?name#1" / "jobs.sqlite3"
    store = SQLiteJobStore(path)
    await store.open()
    try:
        await store.jobs.put(job("job_1", 0, 1))
    finally:
        await store.close()
    assert migrate.current(sa.URL.create("sqlite", database=str(path))) == HEAD


async def test_a_downgrade_refuses_to_drop_what_holds_rows(make_store: Callable[[], JobStore], store_kind: str) -> None:
    """Alembic's downgrade of a store that holds jobs (or their blobs) stops with an error instead of dropping
    them; an empty store goes down (and up again) cleanly."""
    from alembic import command
    from alembic.util import CommandError

    store = make_store()
    await store.open()
    await store.jobs.put(job("job_1", 0, 1))
    await store.blobs.put("job_1", {"stdout": b"kept"})
    url = (
        sa.URL.create("sqlite", database=str(store.path))  # type: ignore[attr-defined]
        if store_kind == "sqlite"
        else async_url(store.url)  # type: ignore[attr-defined]
    )
    await store.close()

    def downgrade(target: str) -> None:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            with engine.connect() as connection:
                command.downgrade(migrate._config(connection), target)
                connection.commit()
        finally:
            engine.dispose()

    for target in ("0001", "base"):
        with pytest.raises((CommandError, RuntimeError)):
            await asyncio.to_thread(downgrade, target)
    again = make_store()
    await again.open()
    try:
        assert await again.jobs.get("job_1") is not None
        assert await again.blobs.read("job_1", "stdout") == b"kept"
        assert await again.jobs.purge(T0 + timedelta(days=1)) == ["job_1"]
    finally:
        await again.close()
    await asyncio.to_thread(downgrade, "base")  # nothing left to lose
    assert await asyncio.to_thread(migrate.current, url) is None
