"""The contract of ``KeyBindings`` (``store.keys``), run against both stores (``store_kind``: SQLite,
PostgreSQL); the claims as the service makes them are in ``tests/unit/test_idempotency.py``.

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

from service.store import JobStore
from tests.unit.store.rows import key


async def test_a_key_keeps_its_first_binding_per_owner(store: JobStore) -> None:
    first = key("alice", "k", "job_1")
    assert await store.keys.bind(first) == first
    assert await store.keys.bind(key("alice", "k", "job_2")) == first
    bobs = key("bob", "k", "job_3")
    assert await store.keys.bind(bobs) == bobs
    assert await store.keys.get("alice", "k") == first
    assert await store.keys.get("carol", "k") is None
