"""Completion callbacks delivered once across replicas (docs/scaling.md, Callbacks, exactly once; issue 17, step 6):
the ``callbacks`` rows on both stores (written with the job's end, claimed, taken over, outcomes fenced by the
claim), two claimers on one PostgreSQL database, and two in-process services on one database where a callback
left by a replica that stopped mid-delivery is delivered by the other, once, with the same ``webhook-id``."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from service.api import create_app
from service.callbacks import WEBHOOK_ID_HEADER, CallbackSecret, deliver
from service.errors import LeaseLost
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.store import CallbackClaim, Incarnation, JobStore, Registration, StoredJob
from service.store.pg import PostgresJobStore
from service.store.pg_db import async_url
from service.store.tables import callbacks
from service.tenancy import hash_token

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def registration(instance: str, token: str = "a" * 64) -> Registration:
    return Registration(instance, f"http://127.0.0.1:80{len(instance)}", token, "0.test", 10.0)


async def register(store: JobStore, instance: str = "r1") -> Incarnation:
    return Incarnation(instance, await store.replicas.register(registration(instance)))


def job(job_id: str, *, ended: bool = False, callback: bool = True, owner: str = "alice") -> StoredJob:
    return StoredJob(
        job_id,
        "lost" if ended else "running",
        "r1",
        T0,
        T0 + timedelta(minutes=1) if ended else None,
        f'{{"job_id": "{job_id}"}}'.encode(),
        b"{}",
        ended and callback,
        owner,
    )


def anyone(_: str | None) -> int:
    return 1000


async def test_a_lapsed_lease_stops_a_delivery_before_its_next_attempt() -> None:
    """The claimer's lease check runs before each attempt: once it fails, nothing more is sent, and the delivery
    ends with ``LeaseLost`` (no outcome: the claim passes on once the incarnation is expired)."""
    sent: list[httpx.Request] = []

    def receive(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    def lease_check() -> None:
        if len(sent) >= 2:
            raise LeaseLost("the test's lease")

    async with httpx.AsyncClient(transport=httpx.MockTransport(receive)) as client:
        with pytest.raises(LeaseLost):
            await deliver(
                client,
                "http://receiver.test/hook",
                b"{}",
                (CallbackSecret.parse("s" * 32),),
                msg_id="msg_job_a",
                max_attempts=5,
                backoff_s=0.01,
                timeout_s=1,
                on_attempt=lambda _: None,
                before_attempt=lease_check,
            )
    assert len(sent) == 2 and {r.headers[WEBHOOK_ID_HEADER] for r in sent} == {"msg_job_a"}


async def test_a_claim_held_by_a_live_replica_is_not_taken_and_an_expired_ones_is(postgres_url: str) -> None:
    one, two = PostgresJobStore(postgres_url), PostgresJobStore(postgres_url)
    await one.open()
    await two.open()
    try:
        r1 = await register(one, "r1")
        r2 = await register(two, "r2")
        assert await one.jobs.save(job("job_a"), r1)
        assert await one.jobs.save(job("job_a", ended=True), r1)
        assert await two.callbacks.claim(r2, 10, anyone) == []  # r1 is live: its claim holds
        assert await one.replicas.set_state(r1, "expired")  # what the reaper does to a replica whose lease passed
        assert await two.callbacks.claim(r2, 10, anyone) == [CallbackClaim("job_a", "alice", 0, True)]
        assert not await one.callbacks.end("job_a", r1, "delivered", 1)  # r1's late outcome matches no row
        assert await two.callbacks.end("job_a", r2, "delivered", 1)
    finally:
        await one.close()
        await two.close()


async def test_two_claimers_on_one_postgresql_store_claim_200_due_rows_once_each(postgres_url: str) -> None:
    one, two = PostgresJobStore(postgres_url), PostgresJobStore(postgres_url)
    await one.open()
    await two.open()
    try:
        r1 = await register(one, "r1")
        r2 = await register(two, "r2")
        await asyncio.gather(*(one.jobs.save(job(f"job_{n:03}", owner=f"k{n % 3}"), r1) for n in range(200)))
        await asyncio.gather(
            *(two.jobs.save_lost(job(f"job_{n:03}", ended=True, owner=f"k{n % 3}")) for n in range(200))
        )

        async def claimer(store: JobStore, me: Incarnation) -> list[str]:
            mine: list[str] = []
            while claimed := await store.callbacks.claim(me, 7, anyone):
                mine += [c.job_id for c in claimed]
                await asyncio.sleep(0)
            return mine

        first, second = await asyncio.gather(claimer(one, r1), claimer(two, r2))
        assert len(first) + len(second) == 200
        assert sorted(first + second) == [f"job_{n:03}" for n in range(200)]  # each once, none twice
        assert all(not c.takeover for c in await one.callbacks.claim(r1, 10, anyone))
        for job_id in first:
            row = await one.callbacks.get(job_id)
            assert row is not None and (row.state, row.claimed_by) == ("delivering", r1)
    finally:
        await one.close()
        await two.close()


# -- two in-process services on one PostgreSQL database, a real receiver -----------------------------------------

ALICE = "alice-token-0123456789abcdef"


class Receiver:
    """A callback receiver on 127.0.0.1 counting deliveries by ``webhook-id``: the first request of each id is held
    open, never answered (its replica stops meanwhile); every later one is answered 204."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.answered: list[tuple[str, dict[str, str]]] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                msg_id = self.headers[WEBHOOK_ID_HEADER]
                if msg_id not in receiver.held:
                    receiver.held.append(msg_id)
                    receiver.release.wait(30)
                    return
                receiver.answered.append((msg_id, {k.lower(): v for k, v in self.headers.items()}))
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def delivered(self, msg_id: str) -> int:
        return sum(1 for answered, _ in self.answered if answered == msg_id)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def short() -> Iterator[Path]:
    """Work dirs with short paths (the sandboxes' unix sockets live under them)."""
    path = Path(tempfile.mkdtemp(prefix="cbcl", dir="/tmp"))
    (path / "w1").mkdir()
    (path / "w2").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def replica(work_dir: Path, url: str, name: str, receiver: Receiver) -> AsyncIterator[httpx.AsyncClient]:
    """A service (``name``) on ``work_dir`` and the store at ``url``, FakeBackend; alice's client."""
    app = create_app(
        Settings(
            api_keys=f"alice:{hash_token(ALICE)}",
            work_dir=work_dir,
            sandbox_folders_tmpfs_mb=0,
            warm_pool_size=0,
            instance_id=name,
            store_url=url,
            internal_secret="x" * 32,
            store_timeout_s=2,
            replica_heartbeat_s=0.2,
            replica_lease_s=1.0,
            callback_secret="the-server-secret-free-form",
            callback_backoff_s=0.05,
            egress_allow=[receiver.origin],
        ),
        FakeBackend(),
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        headers = {"Authorization": f"Bearer {ALICE}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60, headers=headers) as c:
            yield c


async def until(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.05)


async def test_a_delivery_cut_by_its_replicas_stop_is_delivered_once_by_the_other(
    postgres_url: str, short: Path, receiver: Receiver
) -> None:
    """t1 ends a job and starts its callback; the receiver holds that attempt open; t1 stops (its claim's
    incarnation leaves): t2 takes the claim over and delivers it, once, with the same ``webhook-id``."""
    store = PostgresJobStore(postgres_url)
    async with replica(short / "w2", postgres_url, "t2", receiver) as alice2:
        async with replica(short / "w1", postgres_url, "t1", receiver) as alice1:
            body = {"script": "print('x')", "callback_url": receiver.origin + "/hook"}
            view = (await alice1.post("/execute", json=body)).json()
            job_id, msg_id = view["job_id"], f"msg_{view['job_id']}"
            assert view["status"] == "succeeded", view
            await until(lambda: msg_id in receiver.held)  # t1's attempt, held open
        await until(lambda: receiver.delivered(msg_id) == 1)
        await asyncio.sleep(1)  # a few of t2's scans more: nothing is sent again
        assert receiver.delivered(msg_id) == 1
        deadline = time.monotonic() + 10
        while (callback := (await alice2.get(f"/jobs/{job_id}")).json()["callback"])["state"] != "delivered":
            assert time.monotonic() < deadline, callback
            await asyncio.sleep(0.05)
        assert [a["status_code"] for a in callback["attempts"]][-1] == 204
    await store.open()
    try:
        row = await store.callbacks.get(job_id)
        assert row is not None and row.state == "delivered" and row.claimed_by is not None
        assert row.claimed_by.instance_id == "t2"
    finally:
        await store.close()


async def test_a_restarted_replicas_lost_jobs_callbacks_are_delivered_once(
    postgres_url: str, short: Path, receiver: Receiver
) -> None:
    """A job left running in the store (its replica died before its end was saved): the replica's next start marks
    it lost with its callback row pending, in one transaction, and one replica delivers it once."""
    store = PostgresJobStore(postgres_url)
    await store.open()
    try:
        async with replica(short / "w1", postgres_url, "t1", receiver) as alice1:
            body = {"script": "print('x')", "callback_url": receiver.origin + "/hook"}
            view = (await alice1.post("/execute", json=body)).json()
            job_id, msg_id = view["job_id"], f"msg_{view['job_id']}"
            await until(lambda: msg_id in receiver.held)
            ended = await store.jobs.get(job_id)
        assert ended is not None
        # What a kill -9 before the final save leaves: the row running, no callback row.
        running = dataclasses.replace(ended, status="running", ended_at=None, callback_pending=False)
        await store.jobs.put(running)
        engine = sa.create_engine(async_url(postgres_url), poolclass=sa.NullPool)
        await asyncio.to_thread(_execute, engine, sa.delete(callbacks).where(callbacks.c.job_id == job_id))
        async with (
            replica(short / "w2", postgres_url, "t2", receiver) as _,
            replica(short / "w1", postgres_url, "t1", receiver) as alice1,
        ):
            lost = (await alice1.get(f"/jobs/{job_id}")).json()
            assert lost["status"] == "lost", lost
            await until(lambda: receiver.delivered(msg_id) == 1)
            await asyncio.sleep(1)
            assert receiver.delivered(msg_id) == 1
        row = await store.callbacks.get(job_id)
        assert row is not None and row.state == "delivered"
    finally:
        await store.close()


def _execute(engine: sa.Engine, statement: sa.Executable) -> None:
    try:
        with engine.begin() as connection:
            connection.execute(statement)
    finally:
        engine.dispose()
