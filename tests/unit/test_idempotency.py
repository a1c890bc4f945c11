"""Idempotency keys (issue 14, point 1), engine-free: the header's values, the fingerprint, the store's table
and its expiry, the in-memory claims under concurrency (``service/idempotency.py``, ``service/store.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest

from service.errors import IdempotencyKeyInFlight, IdempotencyKeyReused, InvalidField
from service.idempotency import (
    MAX_KEY_LENGTH,
    Claim,
    IdempotencyKeys,
    canonical_digest,
    canonical_json,
    fingerprint,
    parse_key,
)
from service.store import IdempotencyRecord, JobStore, StoredJob

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


# -- the header ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["k", "a" * MAX_KEY_LENGTH, "8e03978e-40d5-43e8-bc93-6894a57f9324", " ~!\"#$%&'()"])
def test_keys_of_1_to_255_printable_ascii_characters_are_taken(value: str) -> None:
    assert parse_key(value) == value


def test_no_header_is_no_key() -> None:
    assert parse_key(None) is None


@pytest.mark.parametrize("value", ["", "a" * (MAX_KEY_LENGTH + 1), "clé", "tab\there", "nul\x00", "del\x7f"])
def test_other_values_are_refused_naming_the_header(value: str) -> None:
    with pytest.raises(InvalidField) as refused:
        parse_key(value)
    assert refused.value.loc == ("header", "Idempotency-Key")


# -- the fingerprint -------------------------------------------------------------------------------


def test_the_body_digest_ignores_key_order_and_whitespace() -> None:
    one = {"script": "print(1)", "limits": {"memory_mb": 256, "cpus": 1}, "tools": []}
    two = {"tools": [], "limits": {"cpus": 1, "memory_mb": 256}, "script": "print(1)"}
    assert canonical_json(one) == canonical_json(two) == canonical_json(dict(sorted(two.items())))
    assert canonical_digest(one) == canonical_digest(two)
    assert canonical_digest(one) != canonical_digest({**one, "script": "print(2)"})
    assert canonical_digest([1, 2]) != canonical_digest([2, 1])  # arrays keep their order


def test_the_body_digest_keeps_integers_past_64_bits_exact() -> None:
    big = 2**70
    assert canonical_json({"b": big, "a": 1}) == b'{"a":1,"b":1180591620717411303424}'
    assert canonical_digest({"n": big}) != canonical_digest({"n": big + 1})
    assert canonical_digest({"n": 1}) != canonical_digest({"n": 1.0})  # JSON's 1 and 1.0 are written apart


def test_the_fingerprint_covers_route_query_and_body() -> None:
    body = canonical_digest({"script": "x"})
    base = fingerprint("POST /execute", [], body)
    assert base == fingerprint("POST /execute", [], canonical_digest({"script": "x"}))
    assert len(base) == 64
    assert base != fingerprint("POST /sessions", [], body)
    assert base != fingerprint("POST /execute", [("mode", "x")], body)
    assert fingerprint("POST /execute", [("a", "1"), ("b", "2")], body) == fingerprint(
        "POST /execute", [("b", "2"), ("a", "1")], body
    )


# -- the store's table -----------------------------------------------------------------------------


@pytest.fixture
async def store(make_store: Callable[[], JobStore]) -> AsyncIterator[JobStore]:
    """Each job store kind in turn (SQLite, PostgreSQL: ``tests/conftest.py``'s ``make_store``)."""
    opened = make_store()
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def job(job_id: str, ended_at: datetime | None) -> StoredJob:
    return StoredJob(job_id, "succeeded", "i", T0, ended_at, b"{}", b"{}", owner="alice")


def record(
    owner: str, key: str, resource_id: str, kind: str = "job", ends_by: datetime | None = None
) -> IdempotencyRecord:
    return IdempotencyRecord(owner, key, "f" * 64, kind, resource_id, T0, ends_by)


async def test_a_binding_is_found_by_owner_and_key_only(store: JobStore) -> None:
    bound = record("alice", "k1", "job_a")
    assert await store.bind_idempotency_key(bound) == bound
    assert await store.idempotency_key("alice", "k1") == bound
    assert await store.idempotency_key("bob", "k1") is None  # another owner's same key: nothing
    assert await store.idempotency_key("alice", "K1") is None
    bobs = record("bob", "k1", "job_b")
    assert await store.bind_idempotency_key(bobs) == bobs  # bob's own binding, beside alice's


async def test_a_key_keeps_its_first_binding(store: JobStore) -> None:
    first = record("alice", "k", "job_first")
    await store.bind_idempotency_key(first)
    assert await store.bind_idempotency_key(record("alice", "k", "job_second")) == first
    assert await store.idempotency_key("alice", "k") == first


async def test_bindings_survive_reopening_the_store(make_store: Callable[[], JobStore]) -> None:
    first = make_store()
    await first.open()
    bound = record("alice", "k", "ses_1", "session", T0 + timedelta(hours=1))
    await first.bind_idempotency_key(bound)
    await first.close()
    second = make_store()
    await second.open()
    try:
        assert await second.idempotency_key("alice", "k") == bound
    finally:
        await second.close()


async def test_a_job_key_expires_with_the_job(store: JobStore) -> None:
    await store.put(job("job_old", T0))
    await store.put(job("job_new", T0 + timedelta(hours=2)))
    await store.put(job("job_running", None))
    for key, job_id in (("old", "job_old"), ("new", "job_new"), ("running", "job_running")):
        await store.bind_idempotency_key(record("alice", key, job_id))
    assert await store.purge(T0 + timedelta(hours=1)) == ["job_old"]
    assert await store.idempotency_key("alice", "old") is None
    assert (await store.idempotency_key("alice", "new")) is not None
    assert (await store.idempotency_key("alice", "running")) is not None


async def test_a_session_key_expires_a_retention_after_its_session_can_last(store: JobStore) -> None:
    await store.bind_idempotency_key(record("alice", "s1", "ses_1", "session", T0 + timedelta(hours=1)))
    await store.bind_idempotency_key(record("alice", "s2", "ses_2", "session", T0 + timedelta(hours=3)))
    await store.purge(T0 + timedelta(hours=2))
    assert await store.idempotency_key("alice", "s1") is None
    assert await store.idempotency_key("alice", "s2") is not None


async def test_a_key_whose_job_was_never_saved_expires_after_the_retention(store: JobStore) -> None:
    await store.bind_idempotency_key(record("alice", "orphan", "job_never_saved"))  # created at T0
    await store.purge(T0 - timedelta(seconds=1))
    assert await store.idempotency_key("alice", "orphan") is not None  # younger than the cutoff: kept
    await store.purge(T0 + timedelta(seconds=1))
    assert await store.idempotency_key("alice", "orphan") is None


# -- claims ----------------------------------------------------------------------------------------

FP = "a" * 64


async def test_concurrent_claims_of_one_key_give_one_claim_then_its_binding(store: JobStore) -> None:
    keys = IdempotencyKeys(store)
    results = await asyncio.gather(*(keys.claim("alice", "k", FP, "job") for _ in range(10)), return_exceptions=True)
    claims = [r for r in results if isinstance(r, Claim)]
    assert len(claims) == 1, results
    # the other nine wait: nothing is returned to them before the claim is bound
    waiting = [asyncio.ensure_future(keys.claim("alice", "k", FP, "job")) for _ in range(9)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiting)
    await claims[0].bind("job", "job_1", T0)
    replays = await asyncio.gather(*waiting)
    assert {r.resource_id for r in replays if isinstance(r, IdempotencyRecord)} == {"job_1"}
    assert len(replays) == 9 and all(isinstance(r, IdempotencyRecord) for r in replays)
    assert keys.in_flight == {}


async def test_a_released_claim_lets_a_waiting_repeat_claim_the_key(store: JobStore) -> None:
    keys = IdempotencyKeys(store)
    first = await keys.claim("alice", "k", FP, "job")
    assert isinstance(first, Claim)
    waiting = asyncio.ensure_future(keys.claim("alice", "k", FP, "job"))
    await asyncio.sleep(0.01)
    first.release()  # the first request failed before creating anything
    second = await waiting
    assert isinstance(second, Claim)
    second.release()
    assert await store.idempotency_key("alice", "k") is None


async def test_a_repeat_past_the_wait_answers_in_flight(store: JobStore) -> None:
    keys = IdempotencyKeys(store, wait_s=0.05)
    first = await keys.claim("alice", "k", FP, "job")
    with pytest.raises(IdempotencyKeyInFlight) as busy:
        await keys.claim("alice", "k", FP, "job")
    assert busy.value.retry_after_s >= 1
    assert isinstance(first, Claim)
    first.release()


async def test_another_owners_claim_of_the_same_key_does_not_wait(store: JobStore) -> None:
    keys = IdempotencyKeys(store, wait_s=0.05)
    alices = await keys.claim("alice", "k", FP, "job")
    bobs = await keys.claim("bob", "k", FP, "job")
    assert isinstance(alices, Claim) and isinstance(bobs, Claim)
    await bobs.bind("job", "job_b", T0)
    await alices.bind("job", "job_a", T0)
    assert (await store.idempotency_key("alice", "k")) is not None
    assert {(await keys.claim(o, "k", FP, "job")).resource_id for o in ("alice", "bob")} == {"job_a", "job_b"}  # type: ignore[union-attr]


async def test_a_bound_key_with_another_fingerprint_or_kind_is_refused(store: JobStore) -> None:
    keys = IdempotencyKeys(store)
    claim = await keys.claim("alice", "k", FP, "job")
    assert isinstance(claim, Claim)
    await claim.bind("job", "job_1", T0)
    with pytest.raises(IdempotencyKeyReused):
        await keys.claim("alice", "k", "b" * 64, "job")
    with pytest.raises(IdempotencyKeyReused):
        await keys.claim("alice", "k", FP, "session")
    assert keys.in_flight == {}


def test_the_body_digest_keeps_nan_and_infinities_apart_from_null() -> None:
    # The stdlib's reader (the fallback for what orjson cannot read) takes NaN and Infinity; orjson writes them null
    nan, inf = float("nan"), float("inf")
    written = {canonical_json(v) for v in ({"a": None}, {"a": nan}, {"a": inf}, {"a": -inf})}
    assert len(written) == 4
    assert canonical_json({"a": [1.5, None], "b": "null"}) == b'{"a":[1.5,null],"b":"null"}'  # no NaN: orjson's
    # an integer past 64 bits beside a NaN: written, not refused (was a ValueError, a 500 with an Idempotency-Key)
    assert canonical_json({"b": 2**70, "a": nan}) == b'{"a":NaN,"b":1180591620717411303424}'
