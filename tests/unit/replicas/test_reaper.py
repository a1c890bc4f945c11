"""A dead replica's jobs (docs/scaling.md, step 5; issue 17, point 5), without an engine: on one PostgreSQL
database, two reapers racing mark each orphan ``lost`` once (``replica_lost``) and expire the dead incarnation
once; a fenced incarnation's writes match no row; progress saves append output chunks and a lost job keeps its
output and records as of its last save (and nothing after it); the broker refuses every call once the lease is
lost; a fenced replica removes its sandboxes, cancels its callback deliveries and exits with status 75."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from service.broker import Broker, BrokerConfig, BrokerHooks, BrokerShared
from service.egress import EgressPolicy
from service.errors import LeaseLost
from service.jobs.events import Events, JobLost
from service.jobs.live import LiveJob, LiveJobs, stored_job
from service.jobs.model import JobStatus
from service.jobs.state import JobState
from service.jobs.tasks import Tasks
from service.replicas.fencing import EXIT_FENCED, SelfFence
from service.replicas.progress import ProgressSaver, chunk_name
from service.replicas.reaper import Reaper
from service.replicas.registration import Replicas
from service.settings import Settings
from service.store import Incarnation, Registration, StoredJob
from service.store.pg import PostgresJobStore
from service.toolkit.cache import ManifestCache
from service.toolkit.endpoints import EndpointClients
from service.views import render
from service.views.render import render_head
from tests.unit.jobs.conftest import Parts

DEAD, ALIVE, OTHER = Incarnation("r1", 1), Incarnation("r2", 1), Incarnation("r3", 1)


@pytest.fixture(autouse=True)
def closes_outputs(parts: Parts) -> Iterator[None]:
    yield
    for job in parts.live.values():
        job.stdout.close()
        job.stderr.close()


def registration(instance: str, lease_s: float) -> Registration:
    return Registration(instance, f"http://127.0.0.1:1/{instance}", instance * 32, "0.test", lease_s)


async def row(job: LiveJob, instance: str) -> StoredJob:
    view = job.view_dict()
    encoded = await render.encode(render_head(view), render.snapshot(view["calls"]))
    return stored_job(encoded.head, len(view["calls"]), encoded.body, instance)


@asynccontextmanager
async def stores(url: str, n: int) -> AsyncIterator[list[PostgresJobStore]]:
    opened = [PostgresJobStore(url, timeout_s=5.0) for _ in range(n)]
    for store in opened:
        await store.open()
    try:
        yield opened
    finally:
        for store in opened:
            await store.close()


def reaper(store: PostgresJobStore, incarnation: Incarnation, tmp_path: Path, lost: list[str]) -> Reaper:
    settings = Settings(work_dir=tmp_path, instance_id=incarnation.instance_id)
    events = Events()
    events.subscribe(JobLost, lambda event: lost.append(event.job_id))
    return Reaper(store, Replicas.adopted(settings, store, incarnation), events, 0.5, 1 << 20)


async def dead_replica_with_jobs(store: PostgresJobStore, parts: Parts, n: int) -> list[str]:
    """r1 (a lease of 0.3 s, never renewed) saves ``n`` running jobs; r2 and r3 stay live."""
    assert await store.replicas.register(registration("r1", 0.3)) == 1
    for instance in ("r2", "r3"):
        await store.replicas.register(registration(instance, 60))
    ids = []
    for _ in range(n):
        job = parts.new_job("alice")
        job.move(JobStatus.RUNNING)
        assert await store.jobs.save(await row(job, "r1"), DEAD)
        ids.append(job.id)
    return ids


async def test_two_racing_reapers_mark_each_orphan_once(postgres_url: str, parts: Parts, tmp_path: Path) -> None:
    async with stores(postgres_url, 2) as (one, two):
        ids = await dead_replica_with_jobs(one, parts, 120)  # more than two batches of ORPHAN_BATCH
        alive = parts.new_job("alice")
        alive.move(JobStatus.RUNNING)
        assert await one.jobs.save(await row(alive, "r2"), ALIVE)
        await asyncio.sleep(0.5)  # r1's lease passes
        lost_a: list[str] = []
        lost_b: list[str] = []
        a = reaper(one, ALIVE, tmp_path / "a", lost_a)
        b = reaper(two, OTHER, tmp_path / "b", lost_b)
        ended = await asyncio.gather(a.scan(), b.scan())
        assert sum(ended) == 120 and sorted(lost_a + lost_b) == sorted(ids)  # each once, by one reaper
        assert not set(lost_a) & set(lost_b)
        for job_id in ids:
            stored = await one.jobs.get(job_id)
            assert stored is not None and stored.status == "lost" and stored.ended_at is not None
            assert orjson.loads(stored.view)["error"]["type"] == "replica_lost"
        still = await one.jobs.get(alive.id)
        assert still is not None and still.status == "running"  # a live replica's job is left alone
        states = {r.instance_id: r.state for r in await one.replicas.all()}
        assert states == {"r1": "expired", "r2": "live", "r3": "live"}
        assert list(await asyncio.gather(a.scan(), b.scan())) == [0, 0]  # nothing left


async def test_a_fenced_incarnation_writes_no_row(postgres_url: str, parts: Parts, tmp_path: Path) -> None:
    async with stores(postgres_url, 1) as (store,):
        (job_id,) = await dead_replica_with_jobs(store, parts, 1)
        await asyncio.sleep(0.5)
        assert list(await store.replicas.expire("r2")) == [DEAD]
        assert await store.replicas.expire("r3") == {}  # expired once
        job = parts.live[job_id]
        job.move(JobStatus.SUCCEEDED)
        assert not await store.jobs.save(await row(job, "r1"), DEAD)  # its owner's end: no row matches
        other = parts.new_job("alice")
        assert not await store.jobs.save(await row(other, "r1"), DEAD)  # nor a new job
        assert await store.jobs.get(other.id) is None
        replicas = Replicas.adopted(Settings(work_dir=tmp_path, instance_id="r1"), store, DEAD)
        with pytest.raises(LeaseLost):
            await replicas.save(await row(job, "r1"))
        assert replicas.fenced and not replicas.holds_lease()
        assert await reaper(store, ALIVE, tmp_path, []).scan() == 1
        stored = await store.jobs.get(job_id)
        assert stored is not None and stored.status == "lost"
        assert not await store.jobs.save_lost(stored)  # an ended row is never ended again


async def test_progress_saves_chunks_and_a_lost_job_keeps_them(postgres_url: str, parts: Parts, tmp_path: Path) -> None:
    async with stores(postgres_url, 1) as (store,):
        (job_id,) = await dead_replica_with_jobs(store, parts, 1)
        await store.replicas.renew(DEAD, 60)  # alive while it saves progress
        job = parts.live[job_id]
        job.stored.set()

        async def save(live: LiveJob) -> None:
            assert await store.jobs.save(await row(live, "r1"), DEAD)

        saver = ProgressSaver(store, parts.live, save, 0.5)
        job.stdout.write(b"a" * 10)
        assert await saver.save_all() == 1
        assert await saver.save_all() == 0  # nothing new: no write
        job.stdout.write(b"b" * 5)
        job.stderr.write(b"err")
        job.calls.append({"seq": 1, "call_id": "call_1", "tool": "t", "args": None, "status": "pending",
                          "started_at": job.created_at})  # fmt: skip
        assert await saver.save_all() == 1
        sizes = await store.blobs.sizes(job_id)
        assert sizes == {chunk_name("stdout", 0): 10, chunk_name("stdout", 10): 5, chunk_name("stderr", 0): 3}
        job.stdout.write(b"c" * 7)  # after the last progress save: lost with the replica
        await store.replicas.renew(DEAD, 0.1)
        await asyncio.sleep(0.3)
        assert await reaper(store, ALIVE, tmp_path, []).scan() == 1
        stored = await store.jobs.get(job_id)
        assert stored is not None
        view = orjson.loads(stored.view)
        assert (view["status"], view["error"]["type"]) == ("lost", "replica_lost")
        assert (view["stdout"], view["stdout_retained_bytes"], view["stderr"]) == ("a" * 10 + "b" * 5, 15, "err")
        assert [(c["seq"], c["status"], c["error"]["type"]) for c in view["calls"]] == [(1, "error", "cancelled")]
        assert await store.blobs.read(job_id, "stdout") == b"a" * 10 + b"b" * 5  # served as any ended job's
        assert await store.blobs.read(job_id, "stdout", 12, 2) == b"bb"


async def test_the_broker_forwards_no_call_once_the_lease_is_lost(tmp_path: Path) -> None:
    manifest = await ManifestCache(b"k" * 32).compile(
        [{"name": "e", "parameters": {"type": "object", "additionalProperties": True}, "endpoint": {"kind": "echo"}}],
        "pytest",
    )
    endpoints = EndpointClients(5.0, 1 << 20, EgressPolicy())
    holds = [True]
    broker = Broker(
        manifest.tools,
        BrokerShared(endpoints),
        BrokerConfig(100, 1 << 20, 1 << 20),
        hooks=BrokerHooks(lease=lambda: holds[0]),
    )
    await broker.start(tmp_path / "tools.sock")
    sock = socket.socket(socket.AF_UNIX)
    try:
        await asyncio.to_thread(sock.connect, str(tmp_path / "tools.sock"))
        lines = sock.makefile("rb")

        async def call(n: int) -> dict[str, Any]:
            await asyncio.to_thread(sock.sendall, b'{"id":%d,"tool":"e","args":{"x":1}}\n' % n)
            reply: dict[str, Any] = orjson.loads(await asyncio.to_thread(lines.readline))
            return reply

        first = await call(1)
        assert first["ok"] is True, first
        holds[0] = False  # fenced, or its local deadline passed
        refused = await call(2)
        assert refused["ok"] is False and refused["error"]["type"] == "replica_lost", refused
        assert [r["status"] for r in broker.records.calls] == ["ok", "error"]
        lines.close()
    finally:
        sock.close()
        await broker.close()
        await endpoints.aclose()


async def test_a_fenced_replica_sweeps_cancels_its_callbacks_and_exits_75() -> None:
    tasks = Tasks()
    delivery = tasks.spawn(asyncio.sleep(60), "callback job_1")
    other = tasks.spawn(asyncio.sleep(60), "retention purge")
    swept: list[str] = []
    exits: list[int] = []

    async def sweep(which: str) -> int:
        swept.append(which)
        return 2

    fence = SelfFence(sweep, tasks, exits.append)
    fence()
    fence()  # once
    assert fence.task is not None
    await fence.task
    await asyncio.sleep(0)
    assert delivery.cancelled() and not other.done()
    assert swept == ["of a fenced replica"] and exits == [EXIT_FENCED] == [75]
    await tasks.close()


async def test_the_lease_is_renewed_while_the_start_up_sweep_runs(tmp_path: Path) -> None:
    """A restarted replica with many sandboxes left sweeps longer than its lease: its heartbeat must already run
    (before: it started after the sweep, and the other replica expired the new incarnation, which then fenced)."""
    from service.jobs.recovery import Recovery
    from service.quotas import HostCapacity, Quotas
    from service.sandbox.folders import SandboxFolders
    from service.store.sqlite import SQLiteJobStore

    class SlowSweep:
        async def sweep(self) -> int:
            await asyncio.sleep(0.6)
            return 8

    work_dir = tmp_path / "work"
    work_dir.mkdir()
    settings = Settings(
        work_dir=work_dir, instance_id="r1", replica_heartbeat_s=0.05, replica_lease_s=0.2, sandbox_folders_tmpfs_mb=0
    )
    store = SQLiteJobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    replicas = Replicas(settings, store)
    recovery = Recovery(
        settings,
        cast(Any, SlowSweep()),
        store,
        SandboxFolders(work_dir / "run", 0),
        Quotas(settings, HostCapacity(1024, 1)),
        JobState(LiveJobs(), Events(), Tasks(), render.ViewCache(1 << 20)),
        replicas,
    )
    try:
        await recovery.start()
        assert replicas.renewals["ok"] >= 3 and replicas.lease_left_s() > 0  # renewed during the 0.6 s sweep
    finally:
        recovery.release()
        await replicas.close()
        await store.close()


async def test_sessions_of_a_dead_replica_are_broken_by_a_reaper_even_after_another_expired_it(
    postgres_url: str, parts: Parts, tmp_path: Path
) -> None:
    from tests.unit.test_forwarding import stored_session

    async with stores(postgres_url, 1) as (store,):
        await dead_replica_with_jobs(store, parts, 0)
        assert await store.sessions.save(stored_session("ses_a"), DEAD)
        assert await store.sessions.save(stored_session("ses_b"), DEAD)
        await asyncio.sleep(0.5)  # r1's lease passes
        assert list(await store.replicas.expire("r3")) == [DEAD]  # r3 expired it, then stopped before the rest
        assert {s.session_id for s in await store.sessions.unended(None)} == {"ses_a", "ses_b"}
        assert await store.sessions.orphan_holders() == [DEAD]
        await reaper(store, ALIVE, tmp_path, []).scan()  # r2's next scan finds them
        assert await store.sessions.unended(None) == []
        for session_id in ("ses_a", "ses_b"):
            broken = await store.sessions.get(session_id)
            assert broken is not None and broken.status == "broken"
        assert await store.sessions.orphan_holders() == []
