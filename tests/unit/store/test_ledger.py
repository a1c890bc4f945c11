"""The contract of ``CallbackLedger`` (``store.callbacks``), run against both stores (``store_kind``:
SQLite, PostgreSQL): the rows a job's end writes, claims, takeovers, outcomes fenced by the claim.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

from datetime import timedelta

from service.store import CallbackClaim, JobStore
from service.store.ledger import choose_claims
from tests.unit.store.rows import T0, anyone, callback_job, register


async def test_the_owners_final_save_writes_its_callback_delivering_claimed_by_itself(store: JobStore) -> None:
    me = await register(store)
    for job_id in ("job_cb", "job_plain"):
        assert await store.jobs.save(callback_job(job_id), me)
    assert await store.callbacks.get("job_cb") is None  # no row before the end
    assert await store.jobs.save(callback_job("job_cb", ended=True), me)
    assert await store.jobs.save(callback_job("job_plain", ended=True, callback=False), me)
    row = await store.callbacks.get("job_cb")
    assert row is not None and (row.state, row.claimed_by, row.attempts) == ("delivering", me, 0)
    assert await store.callbacks.get("job_plain") is None
    assert await store.callbacks.claim(me, 10, anyone) == []  # its own live claim: nothing to take
    assert await store.callbacks.end("job_cb", me, "delivered", 2)
    row = await store.callbacks.get("job_cb")
    assert row is not None and (row.state, row.attempts) == ("delivered", 2)
    assert not await store.callbacks.end("job_cb", me, "failed", 3)  # an outcome is written once


async def test_a_lost_jobs_callback_is_pending_and_claimed_once(store: JobStore) -> None:
    me = await register(store)
    assert await store.jobs.save(callback_job("job_lost"), me)
    assert await store.jobs.save(callback_job("job_quiet"), me)
    assert await store.jobs.save_lost(callback_job("job_lost", ended=True))
    assert await store.jobs.save_lost(callback_job("job_quiet", ended=True, callback=False))
    assert not await store.jobs.save_lost(
        callback_job("job_lost", ended=True)
    )  # ended already: the second marker writes nothing
    ended = await store.jobs.get("job_lost")
    assert ended is not None and ended.status == "lost" and ended.ended_at is not None
    row = await store.callbacks.get("job_lost")
    assert row is not None and (row.state, row.claimed_by) == ("pending", None)
    assert await store.callbacks.get("job_quiet") is None
    assert await store.callbacks.claim(me, 10, anyone) == [CallbackClaim("job_lost", "alice", 0, False)]
    assert await store.callbacks.claim(me, 10, anyone) == []
    row = await store.callbacks.get("job_lost")
    assert row is not None and (row.state, row.claimed_by) == ("delivering", me)


async def test_a_claim_of_a_live_incarnation_stays_and_an_ended_ones_is_taken_over(store: JobStore) -> None:
    first = await register(store)
    assert await store.jobs.save(callback_job("job_a"), first)
    assert await store.jobs.save(
        callback_job("job_a", ended=True), first
    )  # delivering, claimed by the first incarnation
    assert await store.callbacks.claim(first, 10, anyone) == []
    second = await register(store)  # the same instance started again (same work dir): the first is over
    assert second.epoch == first.epoch + 1
    assert await store.callbacks.claim(second, 10, anyone) == [CallbackClaim("job_a", "alice", 0, True)]
    assert not await store.callbacks.end("job_a", first, "delivered", 1)  # the stale claim's outcome: no row
    row = await store.callbacks.get("job_a")
    assert row is not None and (row.state, row.claimed_by) == ("delivering", second)
    assert await store.callbacks.end("job_a", second, "failed", 5)
    assert await store.callbacks.claim(second, 10, anyone) == []  # an outcome is never claimed again


async def test_nothing_is_claimed_by_an_incarnation_that_is_not_live(store: JobStore) -> None:
    me = await register(store)
    assert await store.jobs.save(callback_job("job_a"), me)
    assert await store.jobs.save_lost(callback_job("job_a", ended=True))
    assert await store.replicas.set_state(me, "left")
    assert await store.callbacks.claim(me, 10, anyone) == []


async def test_a_purged_job_takes_its_callback_row_with_it(store: JobStore) -> None:
    me = await register(store)
    assert await store.jobs.save(callback_job("job_a"), me)
    assert await store.jobs.save(callback_job("job_a", ended=True), me)
    assert await store.jobs.purge(T0 + timedelta(days=1)) == ["job_a"]
    assert await store.callbacks.get("job_a") is None


async def test_claims_keep_to_the_limit_and_to_each_owners_room(store: JobStore) -> None:
    me = await register(store)
    for n in range(6):
        owner = "alice" if n < 4 else "bob"
        assert await store.jobs.save(callback_job(f"job_{n}", owner=owner), me)
        assert await store.jobs.save_lost(callback_job(f"job_{n}", ended=True, owner=owner))
    room = {"alice": 1, "bob": 2}
    claimed = await store.callbacks.claim(me, 10, lambda owner: room[owner or ""])
    assert sorted(c.job_id for c in claimed) == ["job_0", "job_4", "job_5"]  # alice's oldest, and both of bob's
    assert len(await store.callbacks.claim(me, 2, anyone)) == 2
    assert len(await store.callbacks.claim(me, 0, anyone)) == 0


def test_choosing_skips_owners_without_room() -> None:
    rows = [("j1", "a", 0, "pending"), ("j2", "a", 0, "pending"), ("j3", None, 2, "delivering"), ("j4", "b", 0, "x")]
    room = {"a": 1, None: 1, "b": 0}
    assert [c.job_id for c in choose_claims(rows, 10, room.__getitem__)] == ["j1", "j3"]
    assert choose_claims(rows, 1, room.__getitem__) == [CallbackClaim("j1", "a", 0, False)]
