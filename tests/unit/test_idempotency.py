"""Idempotency keys (issue 14, point 1; issue 17, step 7), engine-free: the header's values, the fingerprint, the
store's table and its expiry, the claims in the store under concurrency, on one replica and two, on both stores
(``service/idempotency.py``, ``service/store/``)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from service.errors import IdempotencyKeyInFlight, IdempotencyKeyReused, InvalidField, StoreUnavailable
from service.idempotency import (
    IN_FLIGHT_WAIT_S,
    MAX_KEY_LENGTH,
    Claim,
    IdempotencyKeys,
    canonical_digest,
    canonical_json,
    fingerprint,
    parse_key,
)
from service.store import IdempotencyRecord, Incarnation, JobStore, KeyClaim, Registration, StoredJob
from service.store.pg import PostgresJobStore

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


def job(job_id: str, ended_at: datetime | None) -> StoredJob:
    return StoredJob(job_id, "succeeded", "i", T0, ended_at, b"{}", b"{}", owner="alice")


def record(
    owner: str, key: str, resource_id: str, kind: str = "job", ends_by: datetime | None = None
) -> IdempotencyRecord:
    return IdempotencyRecord(owner, key, "f" * 64, kind, resource_id, T0, ends_by)


async def test_a_binding_is_found_by_owner_and_key_only(store: JobStore) -> None:
    bound = record("alice", "k1", "job_a")
    assert await store.keys.bind(bound) == bound
    assert await store.keys.get("alice", "k1") == bound
    assert await store.keys.get("bob", "k1") is None  # another owner's same key: nothing
    assert await store.keys.get("alice", "K1") is None
    bobs = record("bob", "k1", "job_b")
    assert await store.keys.bind(bobs) == bobs  # bob's own binding, beside alice's


async def test_a_key_keeps_its_first_binding(store: JobStore) -> None:
    first = record("alice", "k", "job_first")
    await store.keys.bind(first)
    assert await store.keys.bind(record("alice", "k", "job_second")) == first
    assert await store.keys.get("alice", "k") == first


async def test_bindings_survive_reopening_the_store(make_store: Callable[[], JobStore]) -> None:
    first = make_store()
    await first.open()
    bound = record("alice", "k", "ses_1", "session", T0 + timedelta(hours=1))
    await first.keys.bind(bound)
    await first.close()
    second = make_store()
    await second.open()
    try:
        assert await second.keys.get("alice", "k") == bound
    finally:
        await second.close()


async def test_a_job_key_expires_with_the_job(store: JobStore) -> None:
    await store.jobs.put(job("job_old", T0))
    await store.jobs.put(job("job_new", T0 + timedelta(hours=2)))
    await store.jobs.put(job("job_running", None))
    for key, job_id in (("old", "job_old"), ("new", "job_new"), ("running", "job_running")):
        await store.keys.bind(record("alice", key, job_id))
    assert await store.jobs.purge(T0 + timedelta(hours=1)) == ["job_old"]
    assert await store.keys.get("alice", "old") is None
    assert (await store.keys.get("alice", "new")) is not None
    assert (await store.keys.get("alice", "running")) is not None


async def test_a_session_key_expires_a_retention_after_its_session_can_last(store: JobStore) -> None:
    await store.keys.bind(record("alice", "s1", "ses_1", "session", T0 + timedelta(hours=1)))
    await store.keys.bind(record("alice", "s2", "ses_2", "session", T0 + timedelta(hours=3)))
    await store.jobs.purge(T0 + timedelta(hours=2))
    assert await store.keys.get("alice", "s1") is None
    assert await store.keys.get("alice", "s2") is not None


async def test_a_key_whose_job_was_never_saved_expires_after_the_retention(store: JobStore) -> None:
    await store.keys.bind(record("alice", "orphan", "job_never_saved"))  # created at T0
    await store.jobs.purge(T0 - timedelta(seconds=1))
    assert await store.keys.get("alice", "orphan") is not None  # younger than the cutoff: kept
    await store.jobs.purge(T0 + timedelta(seconds=1))
    assert await store.keys.get("alice", "orphan") is None


# -- claims ----------------------------------------------------------------------------------------

FP = "a" * 64


def registration(instance: str, lease_s: float = 30.0) -> Registration:
    return Registration(instance, f"http://{instance}:8080", instance * 64, "test", lease_s)


async def keys_of(store: JobStore, instance: str = "r1", wait_s: float = IN_FLIGHT_WAIT_S) -> IdempotencyKeys:
    """The idempotency keys of a replica ``instance`` registered on ``store`` now."""
    epoch = await store.replicas.register(registration(instance))
    return IdempotencyKeys(store, Incarnation(instance, epoch), wait_s=wait_s)


async def test_concurrent_claims_of_one_key_give_one_claim_then_its_binding(store: JobStore) -> None:
    keys = await keys_of(store, wait_s=60)
    first = [asyncio.ensure_future(keys.claim("alice", "k", FP, "job")) for _ in range(10)]
    await asyncio.wait(first, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0.2)
    claims = [f.result() for f in first if f.done()]
    assert len(claims) == 1 and isinstance(claims[0], Claim), claims
    # the other nine wait: nothing is returned to them before the claim is bound
    assert await store.keys.get("alice", "k") is None  # claimed, not bound: no binding to replay
    await claims[0].bind("job", "job_1", T0)
    replayed = [r for r in await asyncio.gather(*first) if isinstance(r, IdempotencyRecord)]
    assert len(replayed) == 9 and {r.resource_id for r in replayed} == {"job_1"}
    assert len(keys) == 0
    assert await store.keys.get("alice", "k") == replayed[0]


async def test_a_released_claim_lets_a_waiting_repeat_claim_the_key(store: JobStore) -> None:
    keys = await keys_of(store)
    first = await keys.claim("alice", "k", FP, "job")
    assert isinstance(first, Claim)
    waiting = asyncio.ensure_future(keys.claim("alice", "k", FP, "job"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    first.release()  # the first request failed before creating anything
    second = await asyncio.wait_for(waiting, 5)
    assert isinstance(second, Claim) and second.token != first.token
    second.release()
    await keys.drain()
    assert await store.keys.get("alice", "k") is None
    assert isinstance(await keys.claim("alice", "k", FP, "job"), Claim)  # released: the row is gone


async def test_a_repeat_past_the_wait_answers_in_flight(store: JobStore) -> None:
    keys = await keys_of(store, wait_s=0.05)
    first = await keys.claim("alice", "k", FP, "job")
    with pytest.raises(IdempotencyKeyInFlight) as busy:
        await keys.claim("alice", "k", FP, "job")
    assert busy.value.retry_after_s >= 1
    assert isinstance(first, Claim)
    first.release()
    await keys.drain()


async def test_another_owners_claim_of_the_same_key_does_not_wait(store: JobStore) -> None:
    keys = await keys_of(store, wait_s=0.05)
    alices = await keys.claim("alice", "k", FP, "job")
    bobs = await keys.claim("bob", "k", FP, "job")  # alice's claim is nothing to bob: no wait, no 409
    assert isinstance(alices, Claim) and isinstance(bobs, Claim)
    await bobs.bind("job", "job_b", T0)
    assert await store.keys.get("alice", "k") is None  # bob's binding is not alice's
    await alices.bind("job", "job_a", T0)
    assert {(await keys.claim(o, "k", FP, "job")).resource_id for o in ("alice", "bob")} == {"job_a", "job_b"}  # type: ignore[union-attr]
    with pytest.raises(IdempotencyKeyReused):  # bob's other request with the key: refused by his own binding
        await keys.claim("bob", "k", "b" * 64, "job")


async def test_a_bound_key_with_another_fingerprint_or_kind_is_refused(store: JobStore) -> None:
    keys = await keys_of(store)
    claim = await keys.claim("alice", "k", FP, "job")
    assert isinstance(claim, Claim)
    await claim.bind("job", "job_1", T0)
    with pytest.raises(IdempotencyKeyReused):
        await keys.claim("alice", "k", "b" * 64, "job")
    with pytest.raises(IdempotencyKeyReused):
        await keys.claim("alice", "k", FP, "session")
    assert len(keys) == 0


async def test_a_claim_of_a_dead_incarnation_is_taken_over(store: JobStore) -> None:
    dead = await keys_of(store, "r1")
    orphan = await dead.claim("alice", "k", FP, "job")  # then its replica dies before binding it
    assert isinstance(orphan, Claim)
    assert await store.replicas.set_state(dead.incarnation, "left")
    keys = await keys_of(store, "r1")  # its next start: a new epoch, the old one not live
    assert keys.incarnation.epoch == dead.incarnation.epoch + 1
    taken = await keys.claim("alice", "k", "b" * 64, "job")  # at once, and with this request's fingerprint
    assert isinstance(taken, Claim)
    await orphan.bind("job", "job_late", T0)  # the dead claim's token binds nothing any more
    assert await store.keys.get("alice", "k") is None
    await taken.bind("job", "job_2", T0)
    bound = await store.keys.get("alice", "k")
    assert bound is not None and (bound.resource_id, bound.fingerprint) == ("job_2", "b" * 64)


async def test_a_request_whose_claimer_died_does_not_wait_forever(store: JobStore) -> None:
    dying = await keys_of(store, "r1", wait_s=30)
    orphan = await dying.claim("alice", "k", FP, "job")
    assert isinstance(orphan, Claim)
    # SQLite holds one replica: the repeat waits on that replica itself, whose lease then passes
    keys = await keys_of(store, "r2", wait_s=30) if isinstance(store, PostgresJobStore) else dying
    keys.poll_s = 0.05
    waiting = asyncio.ensure_future(keys.claim("alice", "k", FP, "job"))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # its claimer lives: the repeat waits
    await store.replicas.set_state(dying.incarnation, "left")  # it dies (no bind, no release, no notification)
    claim = await asyncio.wait_for(waiting, 10)  # its next read of the row takes the claim over
    assert isinstance(claim, Claim)


async def test_an_orphan_claim_of_this_replica_is_taken_over_but_not_one_whose_bind_failed(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = await keys_of(store, wait_s=0.05)
    # a claim this incarnation wrote but no request holds (its write answered past the store's timeout)
    late = KeyClaim("alice", "late", FP, "job", "0" * 32, keys.incarnation)
    assert await store.keys.claim(late, T0) == late
    assert isinstance(await keys.claim("alice", "late", FP, "job"), Claim)  # at once: no wait, no 409

    def unavailable(operation: str) -> Callable[..., Awaitable[bool]]:
        async def fail(*_: object) -> bool:
            raise StoreUnavailable(operation)

        return fail

    failed = await keys.claim("alice", "unreleased", FP, "job")
    assert isinstance(failed, Claim)
    with monkeypatch.context() as patched:
        patched.setattr(store.keys, "release", unavailable("release_claim"))
        failed.release()
        await keys.drain()  # logged; the claim stays in the store
    assert isinstance(await keys.claim("alice", "unreleased", FP, "job"), Claim)  # nothing was made: taken over

    made = await keys.claim("alice", "unbound", FP, "job")
    assert isinstance(made, Claim)
    with monkeypatch.context() as patched:
        patched.setattr(store.keys, "bind_claim", unavailable("bind_claim"))
        with pytest.raises(StoreUnavailable):
            await made.bind("job", "job_1", T0)
    with pytest.raises(IdempotencyKeyInFlight):  # a job exists: a retry must not make a second one
        await keys.claim("alice", "unbound", FP, "job")


async def test_claims_and_bindings_of_jobs_go_with_the_retention(store: JobStore) -> None:
    keys = await keys_of(store)
    old = await keys.claim("alice", "old", FP, "job")
    stale = await keys.claim("alice", "stale", FP, "session")
    assert isinstance(old, Claim) and isinstance(stale, Claim)
    await store.jobs.put(job("job_old", T0))
    await old.bind("job", "job_old", T0)
    assert await store.jobs.purge(datetime.now(UTC) + timedelta(hours=1)) == ["job_old"]
    assert await store.keys.get("alice", "old") is None
    assert isinstance(await keys.claim("alice", "stale", FP, "job"), Claim)  # an ancient claim went too


async def test_the_migration_keeps_bindings_both_ways_and_drops_claims_going_down(
    make_store: Callable[[], JobStore], store_kind: str
) -> None:
    """0007 up from 0003 keeps the bindings (as ``bound``); down again it keeps them and drops the claims."""
    import sqlalchemy as sa
    from alembic import command

    from service.store import migrate
    from service.store.pg_db import async_url

    store = make_store()
    await store.open()
    url = (
        sa.URL.create("sqlite", database=str(store.path))  # type: ignore[attr-defined]
        if store_kind == "sqlite"
        else async_url(store.url)  # type: ignore[attr-defined]
    )
    await store.close()

    def migrate_to(target: str, down: bool) -> None:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            with engine.connect() as connection:
                (command.downgrade if down else command.upgrade)(migrate._config(connection), target)
                connection.commit()
        finally:
            engine.dispose()

    await asyncio.to_thread(migrate_to, "0003", True)
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.begin() as connection:  # a binding made before 0007
        connection.exec_driver_sql(
            "INSERT INTO idempotency_keys (owner, key, fingerprint, kind, resource_id, created_at, ends_by) "
            f"VALUES ('alice', 'old', '{FP}', 'job', 'job_old', '{T0.isoformat()}', NULL)"
        )
    engine.dispose()
    opened = make_store()
    await opened.open()  # upgrades to HEAD
    try:
        assert (await opened.keys.get("alice", "old")) == IdempotencyRecord("alice", "old", FP, "job", "job_old", T0)
        keys = await keys_of(opened)
        assert isinstance(await keys.claim("alice", "new", FP, "job"), Claim)
        assert isinstance(await keys.claim("alice", "old", FP, "job"), IdempotencyRecord)
    finally:
        await opened.close()
    await asyncio.to_thread(migrate_to, "0003", True)
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as connection:
        rows = connection.exec_driver_sql("SELECT key, resource_id FROM idempotency_keys").all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("old", "job_old")]


async def test_two_replicas_given_one_key_at_once_claim_it_once(postgres_url: str) -> None:
    stores = [PostgresJobStore(postgres_url), PostgresJobStore(postgres_url)]
    for opened in stores:
        await opened.open()
    try:
        one, two = await keys_of(stores[0], "t1", wait_s=120), await keys_of(stores[1], "t2", wait_s=120)
        tasks = {
            (i, n): asyncio.ensure_future((one, two)[n % 2].claim("alice", f"k{i}", FP, "job"))
            for i in range(20)
            for n in range(4)
        }
        for i in range(20):  # each key's first claim answered (the others wait: 2 minutes at most)
            await asyncio.wait([t for (k, _), t in tasks.items() if k == i], return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.2)
        for i in range(20):
            done = [t.result() for (k, _), t in tasks.items() if k == i and t.done()]
            assert len(done) == 1 and isinstance(done[0], Claim), (i, done)  # one claim per key, replicas aside
            await done[0].bind("job", f"job_{i}", T0)
        answers = await asyncio.gather(*tasks.values())
        for i in range(20):
            mine = [a for (k, _), a in zip(tasks, answers, strict=True) if k == i]
            replays = [a for a in mine if isinstance(a, IdempotencyRecord)]
            assert len(replays) == 3 and {r.resource_id for r in replays} == {f"job_{i}"}
    finally:
        for opened in stores:
            await opened.close()


def test_the_body_digest_keeps_nan_and_infinities_apart_from_null() -> None:
    # The stdlib's reader (the fallback for what orjson cannot read) takes NaN and Infinity; orjson writes them null
    nan, inf = float("nan"), float("inf")
    written = {canonical_json(v) for v in ({"a": None}, {"a": nan}, {"a": inf}, {"a": -inf})}
    assert len(written) == 4
    assert canonical_json({"a": [1.5, None], "b": "null"}) == b'{"a":[1.5,null],"b":"null"}'  # no NaN: orjson's
    # an integer past 64 bits beside a NaN: written, not refused (was a ValueError, a 500 with an Idempotency-Key)
    assert canonical_json({"b": 2**70, "a": nan}) == b'{"a":NaN,"b":1180591620717411303424}'


async def test_a_repeat_on_another_replica_is_woken_by_the_notification(postgres_url: str) -> None:
    from service.replicas.notify import Listener, Waiters

    stores = [PostgresJobStore(postgres_url), PostgresJobStore(postgres_url)]
    for opened in stores:
        await opened.open()
    waiters = Waiters()
    listener = Listener(postgres_url, waiters)
    try:
        one, two = await keys_of(stores[0], "t1"), await keys_of(stores[1], "t2", wait_s=60)
        two.poll_s = 60  # no reading of the row meanwhile: only ptc_keys can wake it in time
        waiters.on_keys = two.wake_digest
        listener.start()
        await asyncio.wait_for(listener.listening.wait(), 5)
        for name, end in (("released", "release"), ("bound", "bind")):
            held = await one.claim("alice", name, FP, "job")
            assert isinstance(held, Claim)
            waiting = asyncio.ensure_future(two.claim("alice", name, FP, "job"))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            if end == "bind":
                await held.bind("job", "job_1", T0)
                assert isinstance(await asyncio.wait_for(waiting, 10), IdempotencyRecord)
            else:
                held.release()
                got = await asyncio.wait_for(waiting, 10)
                assert isinstance(got, Claim)
                got.release()
        await one.drain()
        await two.drain()
    finally:
        await listener.close()
        for opened in stores:
            await opened.close()


async def test_two_services_given_one_key_at_once_make_one_job_and_one_session(postgres_url: str) -> None:
    from tests.unit.test_replicas import replica  # two in-process services on one database, FakeBackend

    short = Path(tempfile.mkdtemp(prefix="ptci", dir="/tmp"))  # short: the sandboxes' sockets live under it
    try:
        async with (
            replica(short / "w1", postgres_url, "t1") as (app1, alice1, _bob1),
            replica(short / "w2", postgres_url, "t2") as (app2, alice2, bob2),
        ):
            key = {"Idempotency-Key": "retry-1"}
            body = {"script": "print('once')", "wait_s": 20}
            answers = await asyncio.gather(*(c.post("/execute", json=body, headers=key) for c in (alice1, alice2) * 4))
            # A replay on the other replica of a job still running there is relayed to its owner, which these
            # in-process services cannot reach (tests/unit/test_forwarding.py connects them): 503.
            relayed = [a for a in answers if a.status_code == 503]
            assert all(a.json()["type"].endswith("/owner-unavailable") for a in relayed), [a.text for a in relayed]
            first = [a for a in answers if a.status_code != 503 and "idempotent-replayed" not in a.headers]
            assert len(first) == 1 and first[0].status_code == 200, [a.text for a in answers]
            job_id = first[0].json()["job_id"]
            for answer in answers:
                assert answer.status_code in (200, 503), answer.text
                if answer.status_code == 200:
                    assert answer.json()["job_id"] == job_id
            listed = {j["job_id"] for c in (alice1, alice2) for j in (await c.get("/jobs")).json()["jobs"]}
            assert listed == {job_id}  # one job in the store, whichever replica each request reached
            for client in (alice1, alice2):  # ended now: either replica replays it
                again = await client.post("/execute", json=body, headers=key)
                assert again.json()["job_id"] == job_id and again.headers["idempotent-replayed"] == "true"

            bobs = await bob2.post("/execute", json=body, headers=key)  # bob's "retry-1" is not alice's
            assert bobs.status_code == 200 and "idempotent-replayed" not in bobs.headers
            assert bobs.json()["job_id"] != job_id

            session = {"idle_timeout_s": 60}
            created = await asyncio.gather(
                *(c.post("/sessions", json=session, headers={"Idempotency-Key": "s"}) for c in (alice1, alice2) * 3)
            )
            new = [a for a in created if a.status_code != 503 and "idempotent-replayed" not in a.headers]
            assert len(new) == 1 and new[0].status_code == 201, [a.text for a in created]
            session_id = new[0].json()["session_id"]
            for answer in created:  # a replay on the replica without the session is forwarded to its owner, which
                assert answer.status_code in (201, 503), answer.text  # these in-process services cannot reach: 503
                if answer.status_code == 201:
                    assert answer.json()["session_id"] == session_id
                else:
                    assert answer.json()["type"].endswith("/owner-unavailable")
            sessions = [s for c in (alice1, alice2) for s in (await c.get("/sessions")).json()["sessions"]]
            assert {s["session_id"] for s in sessions if s["ended_at"] is None} == {session_id}  # both list it
            deleted = [(await c.delete(f"/sessions/{session_id}")).status_code for c in (alice1, alice2)]
            # by the replica holding its sandbox; the other cannot forward while it runs (503), and serves it ended
            assert deleted in ([200, 200], [503, 200]), deleted
            assert not [s for s in (app1, app2) if len(s.state.idempotency)]  # nobody left waiting
    finally:
        shutil.rmtree(short, ignore_errors=True)
