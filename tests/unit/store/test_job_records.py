"""The contract of ``JobRecords`` (``store.jobs``), run against both stores (``store_kind``: SQLite,
PostgreSQL): rows kept and replaced, pages and cursors, the fenced save, the purge and what goes with it.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from service.store import Incarnation, InvalidCursor, JobQuery, JobStore, StoredJob
from service.store.job_records import encode_cursor
from tests.unit.store.rows import T0, callback_job, fenced_job, job, key, register, registration


async def test_a_job_is_kept_and_replaced_whole(store: JobStore) -> None:
    first = job("job_a", 0, None, status="running")
    await store.jobs.put(first)
    assert await store.jobs.get("job_a") == first
    ended = job("job_a", 0, 5, status="failed", pending=True)
    await store.jobs.put(ended)
    assert await store.jobs.get("job_a") == ended
    assert await store.jobs.get("job_b") is None
    assert await store.jobs.count() == 1


async def test_bytes_and_owners_round_trip(store: JobStore) -> None:
    legacy = StoredJob("job_l", "lost", "i", T0, T0, bytes(range(256)), b"\x00\xff", False, None)
    await store.jobs.put(legacy)
    assert await store.jobs.get("job_l") == legacy


async def test_pages_are_newest_first_with_cursors_and_no_view(store: JobStore) -> None:
    for i in range(7):
        await store.jobs.put(job(f"job_{i}", i, i + 1))
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = await store.jobs.page(JobQuery(limit=3, cursor=cursor))
        assert all(row.view == b"" and row.summary for row in page)
        seen += [row.job_id for row in page]
        if cursor is None:
            break
    assert seen == [f"job_{i}" for i in reversed(range(7))]


async def test_same_creation_time_orders_by_id(store: JobStore) -> None:
    for name in ("job_b", "job_a", "job_c"):
        await store.jobs.put(job(name, 0))
    first, cursor = await store.jobs.page(JobQuery(limit=2))
    assert [row.job_id for row in first] == ["job_c", "job_b"]
    rest, end = await store.jobs.page(JobQuery(limit=2, cursor=cursor))
    assert [row.job_id for row in rest] == ["job_a"] and end is None


async def test_pages_filter_by_owner_status_and_time(store: JobStore) -> None:
    await store.jobs.put(job("job_1", 1, 2, owner="alice"))
    await store.jobs.put(job("job_2", 2, None, status="running", owner="bob"))
    await store.jobs.put(job("job_3", 3, 4, status="failed", owner="alice"))
    await store.jobs.put(job("job_4", 4, 5, owner=None))

    async def ids(**query: Any) -> list[str]:
        return [row.job_id for row in (await store.jobs.page(JobQuery(**query)))[0]]

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
        await store.jobs.page(JobQuery(cursor="not-a-cursor"))


async def test_unfinished_jobs_are_per_instance(store: JobStore) -> None:
    await store.jobs.put(job("job_run", 0, None, status="running", instance="i1"))
    await store.jobs.put(job("job_other", 0, None, status="running", instance="i2"))
    await store.jobs.put(job("job_cb", 0, 1, instance="i1", pending=True))
    await store.jobs.put(job("job_done", 0, 1, instance="i1"))
    assert [row.job_id for row in await store.jobs.unfinished("i1")] == ["job_run"]
    assert [row.job_id for row in await store.jobs.unfinished("i2")] == ["job_other"]
    assert (await store.jobs.unfinished("i1"))[0].view  # whole rows: recovery rebuilds from the view


async def test_purge_takes_jobs_their_keys_and_blobs(store: JobStore) -> None:
    await store.jobs.put(job("job_old", 0, 10))
    await store.jobs.put(job("job_new", 0, 120))
    await store.jobs.put(job("job_running", 0, None, status="running"))
    await store.keys.bind(key("alice", "old", "job_old"))
    await store.keys.bind(key("alice", "new", "job_new"))
    await store.keys.bind(key("alice", "orphan", "job_never_saved"))
    await store.keys.bind(key("alice", "ses", "ses_1", "session", T0 + timedelta(minutes=30)))
    await store.blobs.put("job_old", {"stdout": b"out"})
    await store.blobs.put("job_new", {"stdout": b"kept"})
    assert await store.jobs.purge(T0 + timedelta(hours=1)) == ["job_old"]
    assert await store.jobs.get("job_old") is None
    assert await store.blobs.read("job_old", "stdout") is None
    assert await store.blobs.read("job_new", "stdout") == b"kept"
    assert await store.keys.get("alice", "old") is None
    assert await store.keys.get("alice", "orphan") is None
    assert await store.keys.get("alice", "ses") is None
    assert await store.keys.get("alice", "new") is not None
    assert await store.jobs.count() == 2


async def test_a_purge_for_one_instance_takes_only_its_jobs(store: JobStore) -> None:
    await store.jobs.put(job("job_mine", 0, 10, instance="i1"))
    await store.jobs.put(job("job_theirs", 0, 10, instance="i2"))
    await store.keys.bind(key("alice", "theirs", "job_theirs"))
    await store.blobs.put("job_theirs", {"stdout": b"kept"})
    assert await store.jobs.purge(T0 + timedelta(hours=1), "i1") == ["job_mine"]
    assert await store.jobs.get("job_theirs") is not None
    assert await store.keys.get("alice", "theirs") is not None
    assert await store.blobs.read("job_theirs", "stdout") == b"kept"
    assert await store.jobs.purge(T0 + timedelta(hours=1)) == ["job_theirs"]  # every instance's (no instance given)


async def test_what_is_stored_survives_reopening(make_store: Callable[[], JobStore]) -> None:
    first = make_store()
    await first.open()
    await first.jobs.put(job("job_1", 0, 1))
    await first.keys.bind(key("alice", "k", "job_1"))
    await first.close()
    second = make_store()
    await second.open()
    try:
        assert await second.jobs.get("job_1") == job("job_1", 0, 1)
        assert await second.keys.get("alice", "k") == key("alice", "k", "job_1")
    finally:
        await second.close()


async def test_concurrent_puts_and_reads(store: JobStore) -> None:
    await asyncio.gather(*(store.jobs.put(job(f"job_{i}", i, i)) for i in range(40)))
    rows = await asyncio.gather(*(store.jobs.get(f"job_{i}") for i in range(40)))
    assert all(row is not None for row in rows)
    assert await store.jobs.count() == 40


@pytest.mark.parametrize("odd", ["job_\x00x", "job_\ud800"])
async def test_a_value_no_row_can_hold_finds_nothing(store: JobStore, odd: str) -> None:
    """User-controlled text (a job id in a path, an id in a cursor, a toolset id, an idempotency key) that no
    text column can hold (NUL, a lone surrogate) is simply not found, on both stores: never a driver error."""
    await store.jobs.put(job("job_1", 0, 1))
    assert await store.jobs.get(odd) is None
    assert await store.toolsets.get(odd, "alice") is None
    assert await store.toolsets.get(odd, None) is None
    assert await store.keys.get("alice", odd) is None
    assert await store.blobs.read(odd, "stdout") is None
    assert await store.blobs.sizes(odd) == {}
    if "\x00" in odd:  # a cursor decodes as strict UTF-8: only NUL can be in it
        with pytest.raises(InvalidCursor):
            await store.jobs.page(JobQuery(cursor=encode_cursor(T0, odd)))


async def test_job_saves_are_fenced_by_incarnation(store: JobStore) -> None:
    await store.replicas.register(registration())
    first = Incarnation("r1", 1)
    assert await store.jobs.save(fenced_job("j1"), first)
    assert await store.jobs.save(fenced_job("j1", status="waiting"), first)
    assert (await store.jobs.get("j1")).status == "waiting"  # type: ignore[union-attr]
    await store.replicas.register(registration())  # a restart: epoch 2 (the previous process is dead)
    assert not await store.jobs.save(fenced_job("j1", ended=True), first)  # the old incarnation writes nothing more
    assert not await store.jobs.save(fenced_job("j2"), first)  # nor a new job
    assert await store.jobs.get("j2") is None
    second = Incarnation("r1", 2)
    assert not await store.jobs.save(fenced_job("j1", ended=True), second)  # another incarnation's job: not this one's
    assert await store.jobs.save(fenced_job("j3"), second)
    assert await store.jobs.save(fenced_job("j3", ended=True), second)
    assert not await store.jobs.save(fenced_job("j3", status="running"), second)  # an ended row never changes again
    stored = await store.jobs.get("j3")
    assert stored is not None and stored.status == "succeeded"


async def test_the_save_records_the_owner_of_the_incarnation(store: JobStore) -> None:
    await store.replicas.register(registration())
    assert await store.jobs.save(fenced_job("j1", instance="someone-else"), Incarnation("r1", 1))
    stored = await store.jobs.get("j1")
    assert stored is not None and stored.instance_id == "r1"
    assert [j.job_id for j in await store.jobs.unfinished("r1")] == ["j1"]


async def test_a_save_lost_never_ends_a_job_its_owner_ended(store: JobStore) -> None:
    """The owner's final save came first: the marker's update finds ``ended_at`` set and writes nothing (the
    owner's view and its claim kept)."""
    me = await register(store)
    assert await store.jobs.save(callback_job("job_a"), me)
    owners = dataclasses.replace(callback_job("job_a", ended=True), status="succeeded")
    assert await store.jobs.save(owners, me)
    assert not await store.jobs.save_lost(callback_job("job_a", ended=True))
    kept = await store.jobs.get("job_a")
    assert kept is not None and kept.status == "succeeded"
    row = await store.callbacks.get("job_a")
    assert row is not None and (row.state, row.claimed_by) == ("delivering", me)
