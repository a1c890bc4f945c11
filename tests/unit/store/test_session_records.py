"""The contract of ``SessionRecords`` (``store.sessions``), run against both stores (``store_kind``: SQLite,
PostgreSQL): the fenced save, reads by id and by owner, sessions marked ``broken`` for a dead incarnation.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import json

from service.store import Incarnation, JobStore
from service.store.session_records import SESSION_BROKEN
from tests.unit.store.rows import register, session


async def test_a_session_is_kept_and_ended_once(store: JobStore) -> None:
    me = await register(store)
    assert await store.sessions.save(session("ses_a"), me)
    stored = await store.sessions.get("ses_a")
    assert stored is not None and (stored.instance_id, stored.instance_epoch) == ("r1", me.epoch)
    assert stored.view == session("ses_a").view and stored.ended_at is None
    assert await store.sessions.save(session("ses_a", ended=True), me)
    assert not await store.sessions.save(session("ses_a"), me)  # an ended row never changes again
    ended = await store.sessions.get("ses_a")
    assert ended is not None and ended.status == "closed" and ended.ended_at is not None
    assert await store.sessions.get("ses_b") is None
    assert await store.sessions.get("ses_\x00") is None


async def test_session_saves_are_fenced_by_incarnation(store: JobStore) -> None:
    first = await register(store)
    assert await store.sessions.save(session("ses_a"), first)
    second = await register(store)  # a restart: the first incarnation is over
    assert not await store.sessions.save(session("ses_a", ended=True), first)
    assert not await store.sessions.save(session("ses_b"), first)
    assert await store.sessions.get("ses_b") is None
    assert not await store.sessions.save(session("ses_a", ended=True), second)  # the first one's session
    assert await store.sessions.save(session("ses_c"), second)


async def test_unended_sessions_are_listed_oldest_first_by_owner(store: JobStore) -> None:
    me = await register(store)
    assert await store.sessions.save(session("ses_b", minutes=2), me)
    assert await store.sessions.save(session("ses_a", minutes=1), me)
    assert await store.sessions.save(session("ses_x", owner="bob"), me)
    assert await store.sessions.save(session("ses_done", ended=True), me)
    assert [s.session_id for s in await store.sessions.unended("alice")] == ["ses_a", "ses_b"]
    assert [s.session_id for s in await store.sessions.unended(None)] == ["ses_x", "ses_a", "ses_b"]
    assert await store.sessions.unended("carol") == []


async def test_a_dead_incarnations_sessions_are_marked_broken(store: JobStore) -> None:
    first = await register(store)
    assert await store.sessions.save(session("ses_a"), first)
    assert await store.sessions.save(session("ses_done", ended=True), first)
    assert await store.sessions.mark_broken(Incarnation("r1", first.epoch + 1)) == []  # not its sessions
    assert await store.sessions.mark_broken(first) == ["ses_a"]
    broken = await store.sessions.get("ses_a")
    assert broken is not None and broken.status == "broken" and broken.ended_at is not None
    assert json.loads(broken.view)["error"] == {"type": "session_broken", "message": SESSION_BROKEN}
    assert await store.sessions.mark_broken(first) == []  # once
    assert await store.sessions.orphan_holders() == []  # nothing left unended
