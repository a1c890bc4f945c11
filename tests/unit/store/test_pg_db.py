"""The PostgreSQL database under the shared store (``service.store.pg_db``): a server that is down, slow,
read-only or silent is ``StoreUnavailable`` within the timeout, never a hang; its password is never shown; and
``job_store``'s choice of store.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.errors import StoreUnavailable
from service.store.pg import PostgresJobStore
from service.store.pg_db import safe_url
from service.store.sqlite import SQLiteJobStore
from tests.unit.store.rows import job, key

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
        await store.jobs.put(job("job_1", 0, 1))
        with psycopg.connect(postgres_url) as blocker:  # holds the table until the test ends
            blocker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(StoreUnavailable):
                await store.jobs.get("job_1")
        assert await store.jobs.get("job_1") == job("job_1", 0, 1)  # and the store works again after
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
    from service.store import job_store

    assert isinstance(job_store(Settings(work_dir=tmp_path, store_url="")), SQLiteJobStore)
    chosen = job_store(Settings(work_dir=tmp_path, store_url=f"postgresql://u:{SECRET}@h:5432/db"))
    assert isinstance(chosen, PostgresJobStore) and SECRET not in chosen.describe()


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
        await store.jobs.put(job("job_1", 0, 1))
        assert await store.jobs.get("job_1") is not None
        proxy.flowing.clear()
        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(store.jobs.get("job_1"), 20)  # TimeoutError here: a hang
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.jobs.put(job("job_2", 0, 1)), 20)
        proxy.flowing.set()
        for _ in range(100):  # back once the server answers (connections left mid-statement are dropped)
            try:
                found = await asyncio.wait_for(store.jobs.get("job_1"), 20)
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
        await store.jobs.put(job("job_1", 0, 1))
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        assert await store.jobs.get("job_1") is not None
        with pytest.raises(StoreUnavailable):
            await store.jobs.put(job("job_2", 0, 1))
        with pytest.raises(StoreUnavailable):
            await store.toolsets.put("ts_1", b"[]", "alice")
        with pytest.raises(StoreUnavailable):
            await store.keys.bind(key("alice", "k", "job_2"))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")
        await store.close()
