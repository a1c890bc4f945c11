"""The contract of ``ReplicaRegistry`` (``store.replicas``), run against both stores (``store_kind``:
SQLite, PostgreSQL): epochs, leases, states.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio

import pytest

from service.errors import InstanceIdInUse
from service.store import Incarnation, JobStore
from tests.unit.store.rows import registration


async def test_a_new_instance_registers_at_epoch_one_and_each_start_adds_one(store: JobStore) -> None:
    assert await store.replicas.register(registration()) == 1
    assert await store.replicas.register(registration()) == 2  # the same work dir, its lease holding: a restart
    (row,) = await store.replicas.all()
    assert (row.instance_id, row.epoch, row.state, row.version) == ("r1", 2, "live", "0.test")
    assert row.holds_lease and 0 < row.lease_left_s <= 10


async def test_a_live_instance_id_of_another_work_dir_is_refused(store: JobStore) -> None:
    await store.replicas.register(registration(token="a" * 64))
    with pytest.raises(InstanceIdInUse, match="PTC_INSTANCE_ID"):
        await store.replicas.register(registration(token="b" * 64))
    assert [r.epoch for r in await store.replicas.all()] == [1]  # nothing changed


async def test_a_left_or_lapsed_instance_id_may_start_from_another_work_dir(store: JobStore) -> None:
    await store.replicas.register(registration(token="a" * 64))
    assert await store.replicas.set_state(Incarnation("r1", 1), "left")
    assert await store.replicas.register(registration(token="b" * 64)) == 2
    assert await store.replicas.renew(Incarnation("r1", 2), 0.05)
    await asyncio.sleep(0.2)  # its lease passes (an expired replica, not marked yet)
    assert await store.replicas.register(registration(token="c" * 64)) == 3


async def test_renewals_and_state_changes_match_only_the_current_live_incarnation(store: JobStore) -> None:
    await store.replicas.register(registration())
    await store.replicas.register(registration())  # epoch 2: epoch 1 is fenced
    assert not await store.replicas.renew(Incarnation("r1", 1), 10)
    assert await store.replicas.renew(Incarnation("r1", 2), 10)
    assert not await store.replicas.set_state(Incarnation("r1", 1), "left")
    assert await store.replicas.set_state(Incarnation("r1", 2), "draining")
    assert await store.replicas.renew(Incarnation("r1", 2), 10)  # a draining replica keeps its lease
    assert await store.replicas.set_state(Incarnation("r1", 2), "left")
    assert not await store.replicas.renew(Incarnation("r1", 2), 10)  # it left: no renewal brings it back
    (row,) = await store.replicas.all()
    assert (row.state, row.holds_lease) == ("left", False)


async def test_a_lapsed_lease_is_expired_once_where_replicas_share_the_store(store: JobStore, store_kind: str) -> None:
    await store.replicas.register(registration("r1", lease_s=0.05))
    if store_kind == "postgresql":  # SQLite refuses a second live replica
        await store.replicas.register(registration("r2", lease_s=30.0))
    await asyncio.sleep(0.2)  # r1's lease passes
    expired = await store.replicas.expire("r2")
    if store_kind == "sqlite":  # one replica per file: nothing to expire
        assert expired == {}
        return
    assert list(expired) == [Incarnation("r1", 1)] and expired[Incarnation("r1", 1)] >= 0
    assert await store.replicas.expire("r2") == {}  # once
    states = {r.instance_id: r.state for r in await store.replicas.all()}
    assert states == {"r1": "expired", "r2": "live"}
    assert not await store.replicas.renew(Incarnation("r1", 1), 10)  # an expired replica is fenced
