"""The contract of ``ToolsetManifests`` (``store.toolsets``), run against both stores (``store_kind``:
SQLite, PostgreSQL).

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

from service.store import JobStore


async def test_toolsets_belong_to_the_owners_that_registered_them(store: JobStore) -> None:
    await store.toolsets.put("ts_1", b'{"tools": []}', "alice")
    await store.toolsets.put("ts_1", b'{"other": 1}', "bob")  # same id: same manifest, a second owner
    assert await store.toolsets.get("ts_1", "alice") == b'{"tools": []}'
    assert await store.toolsets.get("ts_1", "bob") == b'{"tools": []}'
    assert await store.toolsets.get("ts_1", "carol") is None
    assert await store.toolsets.get("ts_1", None) == b'{"tools": []}'
    assert await store.toolsets.get("ts_2", None) is None
