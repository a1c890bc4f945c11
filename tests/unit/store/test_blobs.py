"""The contract of ``JobBlobs`` (``store.blobs``), run against both stores (``store_kind``: SQLite,
PostgreSQL).

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio

from service.store import JobStore


async def test_blobs_are_read_by_range(store: JobStore) -> None:
    data = bytes(range(256)) * 4
    await store.blobs.put("job_1", {"stdout": data, "stderr": b"", "files/0": b"\x00png"})
    assert await store.blobs.read("job_1", "stdout") == data
    assert await store.blobs.read("job_1", "stdout", 10, 5) == data[10:15]
    assert await store.blobs.read("job_1", "stdout", 1000) == data[1000:]
    assert await store.blobs.read("job_1", "stdout", 5000, 10) == b""
    assert await store.blobs.read("job_1", "stderr") == b""
    assert await store.blobs.read("job_1", "files/1") is None
    assert await store.blobs.read("job_2", "stdout") is None
    assert await store.blobs.sizes("job_1") == {"stdout": 1024, "stderr": 0, "files/0": 4}
    await store.blobs.put("job_1", {"stdout": b"again"})
    assert await store.blobs.read("job_1", "stdout") == b"again"


async def test_concurrent_blob_writes(store: JobStore) -> None:
    """``put_blobs`` from many tasks at once (jobs ending together), as every method: safe concurrently."""
    for round_ in range(5):
        await asyncio.gather(*(store.blobs.put(f"job_{round_}_{n}", {"stdout": b"x" * n}) for n in range(12)))
    assert await store.blobs.sizes("job_4_11") == {"stdout": 11}
