"""Replicas on one store (docs/scaling.md, steps 1 and 2; issue 17, point 2), on both stores where it applies:
registration with epochs, the lease's renewal, the registry read, fenced job saves; a replica whose saves are
fenced stops; on PostgreSQL, two in-process services on one database: an ended job is served by either, a running
job elsewhere answers 503 ``owner-unavailable``, and ``wait`` on the other replica returns when the job ends
(``LISTEN/NOTIFY``)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.errors import InstanceIdInUse, LeaseLost
from service.replicas.registration import Replicas, internal_url, work_dir_token
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.store import Incarnation, JobStore, Registration, StoredJob
from service.tenancy import hash_token
from tests.conftest import free_port

T0 = datetime(2026, 1, 1, tzinfo=UTC)
INTERNAL_SECRET = "replicas-internal-secret-for-tests-0123456789"


def registration(instance: str = "r1", token: str = "a" * 64, lease_s: float = 10.0) -> Registration:
    return Registration(instance, f"http://127.0.0.1:80{len(instance)}", token, "0.test", lease_s)


def job(job_id: str, *, ended: bool = False, status: str = "running", instance: str = "r1") -> StoredJob:
    return StoredJob(
        job_id,
        "succeeded" if ended else status,
        instance,
        T0,
        T0 if ended else None,
        f'{{"job_id": "{job_id}"}}'.encode(),
        b"{}",
        False,
        "alice",
    )


async def test_a_sqlite_store_serves_one_live_replica(tmp_path: Path) -> None:
    from service.store.sqlite import SQLiteJobStore

    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    try:
        await store.replicas.register(registration("r1"))
        with pytest.raises(InstanceIdInUse, match="one replica"):
            await store.replicas.register(registration("r2", token="b" * 64))
        assert await store.replicas.set_state(Incarnation("r1", 1), "left")
        assert await store.replicas.register(registration("r2", token="b" * 64)) == 1
    finally:
        await store.close()


def settings(work_dir: Path, **extra: object) -> Settings:
    return Settings(work_dir=work_dir, instance_id="r1", replica_heartbeat_s=0.05, replica_lease_s=0.5, **extra)  # type: ignore[arg-type]


async def test_a_replica_registers_renews_and_leaves(store: JobStore, tmp_path: Path) -> None:
    counts: list[dict[str, int]] = []
    replicas = Replicas(settings(tmp_path), store, on_count=counts.append)
    assert await replicas.register() == Incarnation("r1", 1)
    assert counts[-1] == {"live": 1, "draining": 0}
    replicas.start()
    await asyncio.sleep(0.3)
    assert replicas.renewals["ok"] >= 2 and not replicas.fenced
    assert replicas.ready() is None
    await replicas.close()
    assert [(r.state, r.epoch) for r in await store.replicas.all()] == [("left", 1)]
    again = Replicas(settings(tmp_path), store)
    assert (await again.register()).epoch == 2  # the same work dir's token: a restart


async def test_a_replica_whose_incarnation_was_taken_over_fences_itself(store: JobStore, tmp_path: Path) -> None:
    fenced: list[bool] = []
    old = Replicas(settings(tmp_path), store)
    await old.register()
    old.on_fenced.append(lambda: fenced.append(True))
    await Replicas(settings(tmp_path), store).register()  # the same work dir started again: epoch 2
    await old.renew()
    assert old.fenced and fenced == [True] and old.renewals["fenced"] == 1
    assert old.ready() == "this replica lost its lease"
    await old.close()  # a fenced replica does not mark the row: it is no longer its
    assert [(r.state, r.epoch) for r in await store.replicas.all()] == [("live", 2)]


def test_the_work_dir_token_is_made_once_and_private(tmp_path: Path) -> None:
    first = work_dir_token(tmp_path)
    assert work_dir_token(tmp_path) == first and len(first) == 64
    assert (tmp_path / "replica.token").stat().st_mode & 0o777 == 0o600


def test_the_internal_url_comes_from_the_setting_or_the_bound_host(tmp_path: Path) -> None:
    assert internal_url(Settings(work_dir=tmp_path, internal_url="http://10.0.0.5:8080/")) == "http://10.0.0.5:8080"
    assert internal_url(Settings(work_dir=tmp_path, host="10.0.0.7", port=81)) == "http://10.0.0.7:81"
    assert internal_url(Settings(work_dir=tmp_path, host="fd00::1", port=81)) == "http://[fd00::1]:81"


def test_a_lease_shorter_than_three_heartbeats_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="PTC_REPLICA_LEASE_S"):
        Settings(work_dir=tmp_path, replica_heartbeat_s=2, replica_lease_s=5)


# -- two replicas in-process on one PostgreSQL database ---------------------------------------------------------


ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdefgh"


Clients = tuple[FastAPI, httpx.AsyncClient, httpx.AsyncClient]


@pytest.fixture
def short() -> Iterator[Path]:
    """A scratch folder with a short path (the sandboxes' unix sockets live under the work dirs)."""
    path = Path(tempfile.mkdtemp(prefix="ptcr", dir="/tmp"))
    (path / "w1").mkdir()
    (path / "w2").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def replica(
    work_dir: Path, url: str, name: str, heartbeat_s: float = 0.2, internal: str | None = None
) -> AsyncIterator[Clients]:
    """A service (``name``) on ``work_dir`` and the store at ``url``, FakeBackend; clients of alice and bob.
    ``internal``: its internal URL (default: a free port of 127.0.0.1 where nothing listens: the owner of a job
    is then unreachable, and a request for it answers 503; ``tests/unit/test_forwarding.py`` connects them)."""
    keys = f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)}"
    app = create_app(
        Settings(
            api_keys=keys,
            work_dir=work_dir,
            sandbox_folders_tmpfs_mb=0,
            warm_pool_size=0,
            instance_id=name,
            store_url=url,
            store_timeout_s=2,
            internal_secret=INTERNAL_SECRET,
            internal_url=internal or f"http://127.0.0.1:{free_port()}",
            replica_heartbeat_s=heartbeat_s,
            replica_lease_s=5 * heartbeat_s,
        ),
        FakeBackend(),
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60, headers=bearer(ALICE)) as a,
            httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60, headers=bearer(BOB)) as b,
        ):
            yield app, a, b


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def held_until(flag: Path) -> str:
    """A script that prints, then runs until ``flag`` exists (the tests give it a 30 s time limit: a failing test
    does not wait for it at the services' shutdown)."""
    return (
        "import os, time\nprint('started', flush=True)\n"
        f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\nprint('done')\n"
    )


async def test_any_replica_serves_an_ended_job_and_waits_for_a_running_one(postgres_url: str, short: Path) -> None:
    flag = short / "flag"
    async with (
        replica(short / "w1", postgres_url, "t1") as (_, alice1, _bob1),
        replica(short / "w2", postgres_url, "t2") as (app2, alice2, bob2),
    ):
        started = await alice1.post("/execute", json={"script": held_until(flag), "wait_s": 0, "timeout_s": 30})
        assert started.status_code == 202, started.text
        job_id = started.json()["job_id"]
        answer = await alice2.get(f"/jobs/{job_id}")  # running on t1, which cannot be reached
        assert answer.status_code == 503, answer.text
        assert answer.json()["type"].endswith("/owner-unavailable")
        assert 1 <= int(answer.headers["retry-after"]) <= 3
        assert (await bob2.get(f"/jobs/{job_id}")).status_code == 404  # another tenant: as unknown, first
        for method, path in (
            ("GET", f"/jobs/{job_id}/events"),
            ("GET", f"/jobs/{job_id}/output/stdout"),
            ("GET", f"/jobs/{job_id}/files/x.txt"),
            ("POST", f"/jobs/{job_id}/stop"),
        ):
            elsewhere = await alice2.request(method, path)
            assert elsewhere.status_code == 503 and elsewhere.json()["type"].endswith("/owner-unavailable"), path
            assert (await bob2.request(method, path)).status_code == 404, path
        [listed] = (await alice2.get("/jobs")).json()["jobs"]  # the listing: the store's rows of every replica
        assert listed["job_id"] == job_id and listed["status"] in ("queued", "running")  # as last saved
        assert (await bob2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 5})).status_code == 404

        store = app2.state.store
        reads: list[str] = []
        get = store.jobs.get

        async def counted(job: str) -> Any:
            reads.append(job)
            return await get(job)

        store.jobs.get = counted
        waiting = asyncio.create_task(alice2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 30}))
        await asyncio.sleep(0.5)
        before = len(reads)
        await asyncio.sleep(0.5)
        assert len(reads) == before and not waiting.done()  # asleep: no reads while it waits (no polling)
        flag.touch()
        ended = await asyncio.wait_for(waiting, 20)  # woken by t1's final save (NOTIFY)
        assert ended.status_code == 200, ended.text
        view = ended.json()
        assert (view["status"], view["stdout"]) == ("succeeded", "started\ndone\n")
        assert len(reads) <= before + 3  # one read when woken, then the view's
        for client in (alice1, alice2):  # the same view, output and listing from either replica
            again = await client.get(f"/jobs/{job_id}")
            assert again.status_code == 200 and again.json()["stdout"] == view["stdout"]
            output = await client.get(f"/jobs/{job_id}/output/stdout")
            assert output.status_code == 200 and output.content == b"started\ndone\n"
        assert (await bob2.get(f"/jobs/{job_id}")).status_code == 404


async def test_a_wait_elsewhere_times_out_with_the_owner_unavailable(postgres_url: str, short: Path) -> None:
    flag = short / "flag"
    async with (
        replica(short / "w1", postgres_url, "t1") as (_, alice1, _a),
        replica(short / "w2", postgres_url, "t2") as (_, alice2, _b),
    ):
        job_id = (
            await alice1.post("/execute", json={"script": held_until(flag), "wait_s": 0, "timeout_s": 30})
        ).json()["job_id"]
        answer = await alice2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 0.3})
        assert answer.status_code == 503 and answer.json()["type"].endswith("/owner-unavailable")
        flag.touch()
        assert (await alice1.post(f"/jobs/{job_id}/wait", params={"timeout_s": 20})).json()["status"] == "succeeded"


async def test_both_replicas_are_in_the_registry_and_the_gauge(postgres_url: str, short: Path) -> None:
    async with replica(short / "w1", postgres_url, "t1") as (app1, _a, _b):
        async with replica(short / "w2", postgres_url, "t2"):
            await asyncio.sleep(0.5)  # a heartbeat reads the registry again
            rows = {r.instance_id: r for r in await app1.state.store.replicas.all()}
            assert {i: (r.state, r.epoch) for i, r in rows.items()} == {"t1": ("live", 1), "t2": ("live", 1)}
            text = app1.state.metrics.exposition().decode()
            assert 'ptc_replicas{state="live"} 2.0' in text
            assert 'ptc_lease_renewals_total{outcome="fenced"} 0.0' in text
            assert 'ptc_lease_renewals_total{outcome="ok"} 0.0' not in text  # renewed every 0.2 s
            assert "ptc_lease_remaining_seconds 0.0" not in text
        rows = {r.instance_id: r for r in await app1.state.store.replicas.all()}
        assert rows["t2"].state == "left"  # a clean shutdown leaves the registry


async def test_a_fenced_save_fences_the_replica(store: JobStore, tmp_path: Path) -> None:
    old = Replicas(settings(tmp_path), store)
    await old.register()
    await Replicas(settings(tmp_path), store).register()  # epoch 2 took over
    with pytest.raises(LeaseLost):
        await old.save(job("j1"))
    assert old.fenced and await store.jobs.get("j1") is None


async def test_a_re_saved_ended_job_is_dropped_from_the_other_replicas_cache(postgres_url: str, short: Path) -> None:
    async with (
        replica(short / "w1", postgres_url, "t1") as (app1, alice1, _a),
        replica(short / "w2", postgres_url, "t2") as (_, alice2, _b),
    ):
        view = (await alice1.post("/execute", json={"script": "print(1)"})).json()
        assert (await alice2.get(f"/jobs/{view['job_id']}")).json()["metadata"] == {}  # read: cached on t2
        stored = await app1.state.store.jobs.get(view["job_id"])
        changed = stored.view.replace(b'"metadata":{}', b'"metadata":{"re":"saved"}')
        assert changed != stored.view
        await app1.state.store.jobs.put(dataclasses.replace(stored, view=changed))  # as a callback's re-save does
        for _ in range(100):  # the notification arrives after the commit
            if (await alice2.get(f"/jobs/{view['job_id']}")).json()["metadata"]:
                break
            await asyncio.sleep(0.05)
        assert (await alice2.get(f"/jobs/{view['job_id']}")).json()["metadata"] == {"re": "saved"}


async def test_a_fenced_replica_is_not_ready(short: Path) -> None:
    app = create_app(Settings(auth="disabled", work_dir=short / "w1", sandbox_folders_tmpfs_mb=0), FakeBackend())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            assert (await client.get("/readyz")).status_code == 200  # SQLite: registered, epoch 1
            assert app.state.replicas.incarnation.epoch == 1
            app.state.replicas.fence("a test")
            answer = await client.get("/readyz")
            assert answer.status_code == 503 and "lost its lease" in answer.json()["detail"]


async def test_a_job_is_saved_before_its_id_is_answered(short: Path) -> None:
    app = create_app(Settings(auth="disabled", work_dir=short / "w1", sandbox_folders_tmpfs_mb=0), FakeBackend())
    async with app.router.lifespan_context(app):
        store = app.state.store
        save = store.jobs.save

        async def slow(job: StoredJob, incarnation: Incarnation) -> bool:
            await asyncio.sleep(0.2)  # a store farther away than this test's
            return bool(await save(job, incarnation))

        store.jobs.save = slow
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            answer = await client.post("/execute", json={"script": "print(1)", "wait_s": 0})
            assert answer.status_code == 202
            assert await store.jobs.get(answer.json()["job_id"]) is not None  # another replica would find it
            await client.post(f"/jobs/{answer.json()['job_id']}/wait", params={"timeout_s": 20})


async def test_a_new_replica_is_in_the_others_registry_cache_without_a_heartbeat(
    postgres_url: str, short: Path
) -> None:
    async with replica(short / "w1", postgres_url, "t1", heartbeat_s=30) as (app1, _a, _b):
        assert set(app1.state.replicas.registry) == {"t1"}
        async with replica(short / "w2", postgres_url, "t2", heartbeat_s=30):
            for _ in range(100):  # the ptc_replicas notification, well before t1's next heartbeat
                if "t2" in app1.state.replicas.registry:
                    break
                await asyncio.sleep(0.05)
            assert app1.state.replicas.registry["t2"].state == "live"
        for _ in range(100):
            if app1.state.replicas.registry["t2"].state == "left":
                break
            await asyncio.sleep(0.05)
        assert app1.state.replicas.registry["t2"].state == "left"


async def test_the_listener_stops_without_being_cancelled_inside_notifies(postgres_url: str) -> None:
    """``Listener.close`` ends the listening loop between two of psycopg's ``notifies()`` waits, never by
    cancelling its task inside one: psycopg waits there with ``asyncio.wait_for`` in 0.1 s steps, and on Python 3.11
    a cancellation that lands as a step ends is swallowed (the task stays "cancelling" and listens on). That hung a
    service's shutdown in a CI run (the test task waited for the listener task for 30 minutes)."""
    import psycopg

    from service.replicas.notify import STOP_CHECK_S, Listener, Waiters
    from tests import pgstore

    received: list[str] = []
    waiters = Waiters()
    waiters.on_replicas = lambda: received.append("replicas")
    with psycopg.connect(pgstore._libpq(postgres_url), autocommit=True) as sender:
        for round_ in range(5):
            listener = Listener(postgres_url, waiters)
            listener.start()
            task = listener._task
            assert task is not None
            await asyncio.wait_for(listener.listening.wait(), 10)
            sender.execute("NOTIFY ptc_replicas, 'r1 live'")
            await asyncio.sleep(0.05 * round_)
            await asyncio.wait_for(listener.close(), STOP_CHECK_S + 3)
            assert task.done() and not task.cancelled()  # it returned by itself
    assert received  # it did listen
