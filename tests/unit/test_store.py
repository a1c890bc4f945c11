"""The job store's contract, run against both stores (``store_kind``: SQLite, PostgreSQL), and their migrations
(``service/store.py``, ``service/store_pg.py``, ``service/migrate.py``; issue 17, point 1).

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from service import migrate
from service.errors import StoreUnavailable
from service.migrations import HEAD
from service.store import (
    IdempotencyRecord,
    InvalidCursor,
    JobQuery,
    JobStore,
    SQLiteJobStore,
    StoredJob,
    encode_cursor,
)
from service.store_pg import PostgresJobStore, async_url, safe_url

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def job(
    job_id: str,
    minutes: int = 0,
    ended: int | None = None,
    *,
    status: str = "succeeded",
    instance: str = "i1",
    owner: str | None = "alice",
    pending: bool = False,
) -> StoredJob:
    created = T0 + timedelta(minutes=minutes)
    return StoredJob(
        job_id,
        status,
        instance,
        created,
        None if ended is None else T0 + timedelta(minutes=ended),
        f'{{"job_id": "{job_id}", "output": "x"}}'.encode(),
        f'{{"job_id": "{job_id}"}}'.encode(),
        pending,
        owner,
    )


async def test_a_job_is_kept_and_replaced_whole(store: JobStore) -> None:
    first = job("job_a", 0, None, status="running")
    await store.put(first)
    assert await store.get("job_a") == first
    ended = job("job_a", 0, 5, status="failed", pending=True)
    await store.put(ended)
    assert await store.get("job_a") == ended
    assert await store.get("job_b") is None
    assert await store.count() == 1


async def test_bytes_and_owners_round_trip(store: JobStore) -> None:
    legacy = StoredJob("job_l", "lost", "i", T0, T0, bytes(range(256)), b"\x00\xff", False, None)
    await store.put(legacy)
    assert await store.get("job_l") == legacy


async def test_pages_are_newest_first_with_cursors_and_no_view(store: JobStore) -> None:
    for i in range(7):
        await store.put(job(f"job_{i}", i, i + 1))
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = await store.page(JobQuery(limit=3, cursor=cursor))
        assert all(row.view == b"" and row.summary for row in page)
        seen += [row.job_id for row in page]
        if cursor is None:
            break
    assert seen == [f"job_{i}" for i in reversed(range(7))]


async def test_same_creation_time_orders_by_id(store: JobStore) -> None:
    for name in ("job_b", "job_a", "job_c"):
        await store.put(job(name, 0))
    first, cursor = await store.page(JobQuery(limit=2))
    assert [row.job_id for row in first] == ["job_c", "job_b"]
    rest, end = await store.page(JobQuery(limit=2, cursor=cursor))
    assert [row.job_id for row in rest] == ["job_a"] and end is None


async def test_pages_filter_by_owner_status_and_time(store: JobStore) -> None:
    await store.put(job("job_1", 1, 2, owner="alice"))
    await store.put(job("job_2", 2, None, status="running", owner="bob"))
    await store.put(job("job_3", 3, 4, status="failed", owner="alice"))
    await store.put(job("job_4", 4, 5, owner=None))

    async def ids(**query: Any) -> list[str]:
        return [row.job_id for row in (await store.page(JobQuery(**query)))[0]]

    assert await ids(owner="alice") == ["job_3", "job_1"]
    assert await ids(owner="carol") == []
    assert await ids() == ["job_4", "job_3", "job_2", "job_1"]
    assert await ids(statuses=("running", "failed")) == ["job_3", "job_2"]
    assert await ids(created_after=T0 + timedelta(minutes=1), created_before=T0 + timedelta(minutes=4)) == [
        "job_3",
        "job_2",
    ]


async def test_a_foreign_cursor_is_refused(store: JobStore) -> None:
    with pytest.raises(InvalidCursor):
        await store.page(JobQuery(cursor="not-a-cursor"))


async def test_unfinished_jobs_are_per_instance(store: JobStore) -> None:
    await store.put(job("job_run", 0, None, status="running", instance="i1"))
    await store.put(job("job_other", 0, None, status="running", instance="i2"))
    await store.put(job("job_cb", 0, 1, instance="i1", pending=True))
    await store.put(job("job_done", 0, 1, instance="i1"))
    assert [row.job_id for row in await store.unfinished("i1")] == ["job_run"]
    assert [row.job_id for row in await store.unfinished("i2")] == ["job_other"]
    assert (await store.unfinished("i1"))[0].view  # whole rows: recovery rebuilds from the view


def key(owner: str, name: str, resource: str, kind: str = "job", ends_by: datetime | None = None) -> IdempotencyRecord:
    return IdempotencyRecord(owner, name, "f" * 64, kind, resource, T0, ends_by)


async def test_purge_takes_jobs_their_keys_and_blobs(store: JobStore) -> None:
    await store.put(job("job_old", 0, 10))
    await store.put(job("job_new", 0, 120))
    await store.put(job("job_running", 0, None, status="running"))
    await store.bind_idempotency_key(key("alice", "old", "job_old"))
    await store.bind_idempotency_key(key("alice", "new", "job_new"))
    await store.bind_idempotency_key(key("alice", "orphan", "job_never_saved"))
    await store.bind_idempotency_key(key("alice", "ses", "ses_1", "session", T0 + timedelta(minutes=30)))
    await store.put_blobs("job_old", {"stdout": b"out"})
    await store.put_blobs("job_new", {"stdout": b"kept"})
    assert await store.purge(T0 + timedelta(hours=1)) == ["job_old"]
    assert await store.get("job_old") is None
    assert await store.read_blob("job_old", "stdout") is None
    assert await store.read_blob("job_new", "stdout") == b"kept"
    assert await store.idempotency_key("alice", "old") is None
    assert await store.idempotency_key("alice", "orphan") is None
    assert await store.idempotency_key("alice", "ses") is None
    assert await store.idempotency_key("alice", "new") is not None
    assert await store.count() == 2


async def test_a_key_keeps_its_first_binding_per_owner(store: JobStore) -> None:
    first = key("alice", "k", "job_1")
    assert await store.bind_idempotency_key(first) == first
    assert await store.bind_idempotency_key(key("alice", "k", "job_2")) == first
    bobs = key("bob", "k", "job_3")
    assert await store.bind_idempotency_key(bobs) == bobs
    assert await store.idempotency_key("alice", "k") == first
    assert await store.idempotency_key("carol", "k") is None


async def test_toolsets_belong_to_the_owners_that_registered_them(store: JobStore) -> None:
    await store.put_toolset("ts_1", b'{"tools": []}', "alice")
    await store.put_toolset("ts_1", b'{"other": 1}', "bob")  # same id: same manifest, a second owner
    assert await store.get_toolset("ts_1", "alice") == b'{"tools": []}'
    assert await store.get_toolset("ts_1", "bob") == b'{"tools": []}'
    assert await store.get_toolset("ts_1", "carol") is None
    assert await store.get_toolset("ts_1", None) == b'{"tools": []}'
    assert await store.get_toolset("ts_2", None) is None


async def test_blobs_are_read_by_range(store: JobStore) -> None:
    data = bytes(range(256)) * 4
    await store.put_blobs("job_1", {"stdout": data, "stderr": b"", "files/0": b"\x00png"})
    assert await store.read_blob("job_1", "stdout") == data
    assert await store.read_blob("job_1", "stdout", 10, 5) == data[10:15]
    assert await store.read_blob("job_1", "stdout", 1000) == data[1000:]
    assert await store.read_blob("job_1", "stdout", 5000, 10) == b""
    assert await store.read_blob("job_1", "stderr") == b""
    assert await store.read_blob("job_1", "files/1") is None
    assert await store.read_blob("job_2", "stdout") is None
    assert await store.blob_sizes("job_1") == {"stdout": 1024, "stderr": 0, "files/0": 4}
    await store.put_blobs("job_1", {"stdout": b"again"})
    assert await store.read_blob("job_1", "stdout") == b"again"


async def test_what_is_stored_survives_reopening(make_store: Callable[[], JobStore]) -> None:
    first = make_store()
    await first.open()
    await first.put(job("job_1", 0, 1))
    await first.bind_idempotency_key(key("alice", "k", "job_1"))
    await first.close()
    second = make_store()
    await second.open()
    try:
        assert await second.get("job_1") == job("job_1", 0, 1)
        assert await second.idempotency_key("alice", "k") == key("alice", "k", "job_1")
    finally:
        await second.close()


async def test_concurrent_puts_and_reads(store: JobStore) -> None:
    await asyncio.gather(*(store.put(job(f"job_{i}", i, i)) for i in range(40)))
    rows = await asyncio.gather(*(store.get(f"job_{i}") for i in range(40)))
    assert all(row is not None for row in rows)
    assert await store.count() == 40


# -- migrations ------------------------------------------------------------------------------------


def store_url(kind: str, make_store: Callable[[], JobStore], tmp_path: Path) -> str:
    """The SQLAlchemy URL of the store ``make_store`` makes."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.sqlite3'}"
    made = make_store()
    assert isinstance(made, PostgresJobStore)
    return async_url(made._url).render_as_string(hide_password=False)


async def test_a_fresh_store_is_migrated_to_head_and_again_changes_nothing(
    store_kind: str, make_store: Callable[[], JobStore], tmp_path: Path
) -> None:
    url = store_url(store_kind, make_store, tmp_path)
    opened = make_store()
    await opened.open()
    await opened.put(job("job_1", 0, 1))
    await opened.close()
    assert await asyncio.to_thread(migrate.current, url) == HEAD
    await asyncio.to_thread(migrate.upgrade, url)  # idempotent
    assert await asyncio.to_thread(migrate.current, url) == HEAD
    again = make_store()
    await again.open()
    try:
        assert await again.get("job_1") == job("job_1", 0, 1)
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
        assert await store.get("job_main") == job("job_main", 0, 1, pending=True)
        assert await store.get_toolset("ts_1", "alice") == b"{}"
        assert (await store.idempotency_key("alice", "k")) is not None
        moved = await store.callback("job_main")  # its pending callback moved to the callbacks table (0006)
        assert moved is not None and moved.state == "pending" and moved.claimed_by is None
        await store.put_blobs("job_main", {"stdout": b"x"})  # the table of revision 0002 is there
    finally:
        await store.close()
    assert migrate.current(f"sqlite:///{path}") == HEAD
    reopened = SQLiteJobStore(path)
    await reopened.open()
    try:
        assert await reopened.count() == 1
        assert await reopened.read_blob("job_main", "stdout") == b"x"
    finally:
        await reopened.close()


async def test_postgresql_migrations_make_the_tables_the_store_queries(postgres_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from service.store_schema import metadata

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


# -- a PostgreSQL that is down or slow -------------------------------------------------------------------

SECRET = "s3cr3t-PASSWORD"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_store_that_is_down_is_unavailable_without_its_password(caplog: pytest.LogCaptureFixture) -> None:
    store = PostgresJobStore(f"postgresql://ptc:{SECRET}@127.0.0.1:{closed_port()}/ptc", timeout_s=1.0)
    with pytest.raises(StoreUnavailable) as caught:
        await store.open()
    assert SECRET not in str(caught.value)
    assert SECRET not in caplog.text
    assert SECRET not in store.describe() and "***" in store.describe()


async def test_a_store_that_never_answers_times_out(caplog: pytest.LogCaptureFixture) -> None:
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepts the connection, never answers

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = PostgresJobStore(f"postgresql://ptc:{SECRET}@127.0.0.1:{port}/ptc", timeout_s=1.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    ticks = 0

    async def ticker() -> None:  # the event loop stays free while the store waits
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    beat = asyncio.create_task(ticker())
    try:
        with pytest.raises(StoreUnavailable):
            await store.open()
    finally:
        beat.cancel()
        server.close()
        for writer in held:
            writer.close()
        await server.wait_closed()
    assert loop.time() - started < 4  # its timeout_s (1 s) and the second of grace: not the default 5 s, not a hang
    assert ticks > 0
    assert SECRET not in caplog.text


async def test_ping_fails_once_the_server_is_gone(postgres_url: str) -> None:
    """A cut pooled connection is replaced (pre-ping), not an error; a server that is gone is StoreUnavailable."""
    url = sa.make_url(postgres_url)
    proxy = FreezingProxy(int(url.port or 5432))  # the server, as long as the proxy listens
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = PostgresJobStore(url.set(port=port).render_as_string(hide_password=False), timeout_s=2.0)
    await store.open()
    try:
        await store.ping()
        import psycopg

        name = url.database
        admin_url = url.set(database="postgres").render_as_string(hide_password=False)
        with psycopg.connect(admin_url, autocommit=True) as admin:  # every connection of the store is cut
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        await store.ping()  # a pooled connection cut is replaced (pre-ping), not an error
        server.close()  # the server is gone: no new connection, and the open ones closed
        for writer in proxy.writers:
            writer.close()
        await server.wait_closed()
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.ping(), 20)
    finally:
        server.close()
        await store.close()


def test_urls_are_shown_without_passwords() -> None:
    shown = safe_url(f"postgresql://u:{SECRET}@db.example:5432/ptc")
    assert SECRET not in shown and "db.example" in shown
    assert SECRET not in safe_url(f"postgresql://u:{SECRET}@[bad")


async def test_a_statement_held_by_a_lock_ends_at_the_timeout(postgres_url: str) -> None:
    import psycopg

    store = PostgresJobStore(postgres_url, timeout_s=1.0)
    await store.open()
    try:
        await store.put(job("job_1", 0, 1))
        with psycopg.connect(postgres_url) as blocker:  # holds the table until the test ends
            blocker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(StoreUnavailable):
                await store.get("job_1")
        assert await store.get("job_1") == job("job_1", 0, 1)  # and the store works again after
    finally:
        await store.close()


@pytest.mark.parametrize(
    "url",
    [
        f"mysql://u:{SECRET}@h/db",
        f"postgresql://u:{SECRET}@h:notaport/db",
        f"postgresql://u:{SECRET}@h:5432",
        f"http://u:{SECRET}@h/db",
    ],
)
def test_a_bad_store_url_is_refused_without_showing_it(url: str) -> None:
    from pydantic import ValidationError

    from service.__main__ import _settings_errors
    from service.settings import Settings

    with pytest.raises(ValidationError) as caught:
        Settings(store_url=url)
    shown = _settings_errors(caught.value)  # what `ptc-sandbox serve` prints when it refuses to start
    assert SECRET not in shown
    assert "PTC_STORE_URL must be a postgresql://" in shown


def test_an_empty_store_url_means_sqlite(tmp_path: Path) -> None:
    from service.settings import Settings
    from service.store_pg import job_store

    assert isinstance(job_store(Settings(work_dir=tmp_path, store_url="")), SQLiteJobStore)
    chosen = job_store(Settings(work_dir=tmp_path, store_url=f"postgresql://u:{SECRET}@h:5432/db"))
    assert isinstance(chosen, PostgresJobStore) and SECRET not in chosen.describe()


async def test_a_sqlite_path_with_url_characters_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "odd ?name#1" / "jobs.sqlite3"
    store = SQLiteJobStore(path)
    await store.open()
    try:
        await store.put(job("job_1", 0, 1))
    finally:
        await store.close()
    assert migrate.current(sa.URL.create("sqlite", database=str(path))) == HEAD


@pytest.mark.parametrize("odd", ["job_\x00x", "job_\ud800"])
async def test_a_value_no_row_can_hold_finds_nothing(store: JobStore, odd: str) -> None:
    """User-controlled text (a job id in a path, an id in a cursor, a toolset id, an idempotency key) that no
    text column can hold (NUL, a lone surrogate) is simply not found, on both stores: never a driver error."""
    await store.put(job("job_1", 0, 1))
    assert await store.get(odd) is None
    assert await store.get_toolset(odd, "alice") is None
    assert await store.get_toolset(odd, None) is None
    assert await store.idempotency_key("alice", odd) is None
    assert await store.read_blob(odd, "stdout") is None
    assert await store.blob_sizes(odd) == {}
    if "\x00" in odd:  # a cursor decodes as strict UTF-8: only NUL can be in it
        with pytest.raises(InvalidCursor):
            await store.page(JobQuery(cursor=encode_cursor(T0, odd)))


@pytest.mark.parametrize("secret_param", ["password", "sslpassword"])
def test_a_password_given_as_a_query_parameter_is_hidden(secret_param: str) -> None:
    url = f"postgresql://ptc@db.internal:5432/ptc?{secret_param}={SECRET}&sslmode=require"
    shown = safe_url(url)
    assert SECRET not in shown
    assert "sslmode=require" in shown and "db.internal" in shown
    assert SECRET not in PostgresJobStore(url).describe()


class FreezingProxy:
    """A TCP proxy in front of PostgreSQL that can stop passing bytes on (a server or network that stops answering
    mid-request while its connections stay open: a paused VM, a partition the kernel has not noticed yet)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, up_writer]

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    await self.flowing.wait()
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def test_a_server_that_stops_answering_mid_request_is_unavailable_not_a_hang(postgres_url: str) -> None:
    """Pooled connections stay open but nothing comes back: every operation ends within about the timeout with
    StoreUnavailable (never a hang, never a driver error), and the store answers again once the server does."""
    url = sa.make_url(postgres_url)
    proxy = FreezingProxy(int(url.port or 5432))
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = PostgresJobStore(url.set(port=port).render_as_string(hide_password=False), timeout_s=1.0)
    await store.open()
    try:
        await store.put(job("job_1", 0, 1))
        assert await store.get("job_1") is not None
        proxy.flowing.clear()
        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(store.get("job_1"), 20)  # TimeoutError here: a hang
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.put(job("job_2", 0, 1)), 20)
        proxy.flowing.set()
        for _ in range(100):  # back once the server answers (connections left mid-statement are dropped)
            try:
                found = await asyncio.wait_for(store.get("job_1"), 20)
                break
            except StoreUnavailable:
                await asyncio.sleep(0.2)
        assert found is not None
    finally:
        proxy.flowing.set()
        await asyncio.wait_for(store.close(), 30)
        server.close()
        for writer in proxy.writers:
            writer.close()


async def test_a_read_only_server_is_unavailable_for_writes(postgres_url: str) -> None:
    """A server that takes no writes (a standby after a fail-over, default_transaction_read_only) is a store that
    cannot do its work now: StoreUnavailable (503), not a driver error (500); reads still answer."""
    import psycopg

    store = PostgresJobStore(postgres_url, timeout_s=2.0)
    await store.open()
    name = sa.make_url(postgres_url).database
    admin_url = sa.make_url(postgres_url).set(database="postgres").render_as_string(hide_password=False)
    try:
        await store.put(job("job_1", 0, 1))
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        assert await store.get("job_1") is not None
        with pytest.raises(StoreUnavailable):
            await store.put(job("job_2", 0, 1))
        with pytest.raises(StoreUnavailable):
            await store.put_toolset("ts_1", b"[]", "alice")
        with pytest.raises(StoreUnavailable):
            await store.bind_idempotency_key(key("alice", "k", "job_2"))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")
        await store.close()


async def test_concurrent_blob_writes(store: JobStore) -> None:
    """``put_blobs`` from many tasks at once (jobs ending together), as every method: safe concurrently."""
    for round_ in range(5):
        await asyncio.gather(*(store.put_blobs(f"job_{round_}_{n}", {"stdout": b"x" * n}) for n in range(12)))
    assert await store.blob_sizes("job_4_11") == {"stdout": 11}


async def test_a_downgrade_refuses_to_drop_what_holds_rows(make_store: Callable[[], JobStore], store_kind: str) -> None:
    """Alembic's downgrade of a store that holds jobs (or their blobs) stops with an error instead of dropping
    them; an empty store goes down (and up again) cleanly."""
    from alembic import command
    from alembic.util import CommandError

    store = make_store()
    await store.open()
    await store.put(job("job_1", 0, 1))
    await store.put_blobs("job_1", {"stdout": b"kept"})
    url = (
        sa.URL.create("sqlite", database=str(store._path))  # type: ignore[attr-defined]
        if store_kind == "sqlite"
        else async_url(store._url)  # type: ignore[attr-defined]
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
        assert await again.get("job_1") is not None
        assert await again.read_blob("job_1", "stdout") == b"kept"
        assert await again.purge(T0 + timedelta(days=1)) == ["job_1"]
    finally:
        await again.close()
    await asyncio.to_thread(downgrade, "base")  # nothing left to lose
    assert await asyncio.to_thread(migrate.current, url) is None


async def test_a_purge_for_one_instance_takes_only_its_jobs(store: JobStore) -> None:
    await store.put(job("job_mine", 0, 10, instance="i1"))
    await store.put(job("job_theirs", 0, 10, instance="i2"))
    await store.bind_idempotency_key(key("alice", "theirs", "job_theirs"))
    await store.put_blobs("job_theirs", {"stdout": b"kept"})
    assert await store.purge(T0 + timedelta(hours=1), "i1") == ["job_mine"]
    assert await store.get("job_theirs") is not None
    assert await store.idempotency_key("alice", "theirs") is not None
    assert await store.read_blob("job_theirs", "stdout") == b"kept"
    assert await store.purge(T0 + timedelta(hours=1)) == ["job_theirs"]  # every instance's (no instance given)
