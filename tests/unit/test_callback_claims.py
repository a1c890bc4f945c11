"""Completion callbacks delivered once across replicas (docs/scaling.md, Callbacks, exactly once; issue 17, step 6):
the ``callbacks`` rows on both stores (written with the job's end, claimed, taken over, outcomes fenced by the
claim), two claimers on one PostgreSQL database, and two in-process services on one database where a callback
left by a replica that stopped mid-delivery is delivered by the other, once, with the same ``webhook-id``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest

from service.store import CallbackClaim, Incarnation, JobStore, Registration, StoredJob, choose_claims
from service.store_pg import PostgresJobStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
async def store(make_store: Callable[[], JobStore]) -> AsyncIterator[JobStore]:
    opened = make_store()
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def registration(instance: str, token: str = "a" * 64) -> Registration:
    return Registration(instance, f"http://127.0.0.1:80{len(instance)}", token, "0.test", 10.0)


async def register(store: JobStore, instance: str = "r1") -> Incarnation:
    return Incarnation(instance, await store.register(registration(instance)))


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


async def test_the_owners_final_save_writes_its_callback_delivering_claimed_by_itself(store: JobStore) -> None:
    me = await register(store)
    for job_id in ("job_cb", "job_plain"):
        assert await store.save(job(job_id), me)
    assert await store.callback("job_cb") is None  # no row before the end
    assert await store.save(job("job_cb", ended=True), me)
    assert await store.save(job("job_plain", ended=True, callback=False), me)
    row = await store.callback("job_cb")
    assert row is not None and (row.state, row.claimed_by, row.attempts) == ("delivering", me, 0)
    assert await store.callback("job_plain") is None
    assert await store.claim_callbacks(me, 10, anyone) == []  # its own live claim: nothing to take
    assert await store.end_callback("job_cb", me, "delivered", 2)
    row = await store.callback("job_cb")
    assert row is not None and (row.state, row.attempts) == ("delivered", 2)
    assert not await store.end_callback("job_cb", me, "failed", 3)  # an outcome is written once


async def test_a_lost_jobs_callback_is_pending_and_claimed_once(store: JobStore) -> None:
    me = await register(store)
    assert await store.save(job("job_lost"), me)
    assert await store.save(job("job_quiet"), me)
    assert await store.save_lost(job("job_lost", ended=True))
    assert await store.save_lost(job("job_quiet", ended=True, callback=False))
    assert not await store.save_lost(job("job_lost", ended=True))  # ended already: the second marker writes nothing
    ended = await store.get("job_lost")
    assert ended is not None and ended.status == "lost" and ended.ended_at is not None
    row = await store.callback("job_lost")
    assert row is not None and (row.state, row.claimed_by) == ("pending", None)
    assert await store.callback("job_quiet") is None
    assert await store.claim_callbacks(me, 10, anyone) == [CallbackClaim("job_lost", "alice", 0, False)]
    assert await store.claim_callbacks(me, 10, anyone) == []
    row = await store.callback("job_lost")
    assert row is not None and (row.state, row.claimed_by) == ("delivering", me)


async def test_a_save_lost_never_ends_a_job_its_owner_ended(store: JobStore) -> None:
    """The owner's final save came first: the marker's update finds ``ended_at`` set and writes nothing (the
    owner's view and its claim kept)."""
    me = await register(store)
    assert await store.save(job("job_a"), me)
    owners = dataclasses.replace(job("job_a", ended=True), status="succeeded")
    assert await store.save(owners, me)
    assert not await store.save_lost(job("job_a", ended=True))
    kept = await store.get("job_a")
    assert kept is not None and kept.status == "succeeded"
    row = await store.callback("job_a")
    assert row is not None and (row.state, row.claimed_by) == ("delivering", me)


async def test_a_claim_of_a_live_incarnation_stays_and_an_ended_ones_is_taken_over(store: JobStore) -> None:
    first = await register(store)
    assert await store.save(job("job_a"), first)
    assert await store.save(job("job_a", ended=True), first)  # delivering, claimed by the first incarnation
    assert await store.claim_callbacks(first, 10, anyone) == []
    second = await register(store)  # the same instance started again (same work dir): the first is over
    assert second.epoch == first.epoch + 1
    assert await store.claim_callbacks(second, 10, anyone) == [CallbackClaim("job_a", "alice", 0, True)]
    assert not await store.end_callback("job_a", first, "delivered", 1)  # the stale claim's outcome: no row
    row = await store.callback("job_a")
    assert row is not None and (row.state, row.claimed_by) == ("delivering", second)
    assert await store.end_callback("job_a", second, "failed", 5)
    assert await store.claim_callbacks(second, 10, anyone) == []  # an outcome is never claimed again


async def test_nothing_is_claimed_by_an_incarnation_that_is_not_live(store: JobStore) -> None:
    me = await register(store)
    assert await store.save(job("job_a"), me)
    assert await store.save_lost(job("job_a", ended=True))
    assert await store.set_replica_state(me, "left")
    assert await store.claim_callbacks(me, 10, anyone) == []


async def test_a_purged_job_takes_its_callback_row_with_it(store: JobStore) -> None:
    me = await register(store)
    assert await store.save(job("job_a"), me)
    assert await store.save(job("job_a", ended=True), me)
    assert await store.purge(T0 + timedelta(days=1)) == ["job_a"]
    assert await store.callback("job_a") is None


async def test_claims_keep_to_the_limit_and_to_each_owners_room(store: JobStore) -> None:
    me = await register(store)
    for n in range(6):
        owner = "alice" if n < 4 else "bob"
        assert await store.save(job(f"job_{n}", owner=owner), me)
        assert await store.save_lost(job(f"job_{n}", ended=True, owner=owner))
    room = {"alice": 1, "bob": 2}
    claimed = await store.claim_callbacks(me, 10, lambda owner: room[owner or ""])
    assert sorted(c.job_id for c in claimed) == ["job_0", "job_4", "job_5"]  # alice's oldest, and both of bob's
    assert len(await store.claim_callbacks(me, 2, anyone)) == 2
    assert len(await store.claim_callbacks(me, 0, anyone)) == 0


def test_choosing_skips_owners_without_room() -> None:
    rows = [("j1", "a", 0, "pending"), ("j2", "a", 0, "pending"), ("j3", None, 2, "delivering"), ("j4", "b", 0, "x")]
    room = {"a": 1, None: 1, "b": 0}
    assert [c.job_id for c in choose_claims(rows, 10, room.__getitem__)] == ["j1", "j3"]
    assert choose_claims(rows, 1, room.__getitem__) == [CallbackClaim("j1", "a", 0, False)]


async def test_a_claim_held_by_a_live_replica_is_not_taken_and_an_expired_ones_is(postgres_url: str) -> None:
    one, two = PostgresJobStore(postgres_url), PostgresJobStore(postgres_url)
    await one.open()
    await two.open()
    try:
        r1 = await register(one, "r1")
        r2 = await register(two, "r2")
        assert await one.save(job("job_a"), r1)
        assert await one.save(job("job_a", ended=True), r1)
        assert await two.claim_callbacks(r2, 10, anyone) == []  # r1 is live: its claim holds
        assert await one.set_replica_state(r1, "expired")  # what the reaper does to a replica whose lease passed
        assert await two.claim_callbacks(r2, 10, anyone) == [CallbackClaim("job_a", "alice", 0, True)]
        assert not await one.end_callback("job_a", r1, "delivered", 1)  # r1's late outcome matches no row
        assert await two.end_callback("job_a", r2, "delivered", 1)
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
        await asyncio.gather(*(one.save(job(f"job_{n:03}", owner=f"k{n % 3}"), r1) for n in range(200)))
        await asyncio.gather(*(two.save_lost(job(f"job_{n:03}", ended=True, owner=f"k{n % 3}")) for n in range(200)))

        async def claimer(store: JobStore, me: Incarnation) -> list[str]:
            mine: list[str] = []
            while claimed := await store.claim_callbacks(me, 7, anyone):
                mine += [c.job_id for c in claimed]
                await asyncio.sleep(0)
            return mine

        first, second = await asyncio.gather(claimer(one, r1), claimer(two, r2))
        assert len(first) + len(second) == 200
        assert sorted(first + second) == [f"job_{n:03}" for n in range(200)]  # each once, none twice
        assert all(not c.takeover for c in await one.claim_callbacks(r1, 10, anyone))
        for job_id in first:
            row = await one.callback(job_id)
            assert row is not None and (row.state, row.claimed_by) == ("delivering", r1)
    finally:
        await one.close()
        await two.close()
