"""Copying ended jobs' output into a shared store (``service.jobs.shared``, issue 17 point 1): the bytes held at
once stay bounded however many jobs end together, and a store that refuses is not asked again and again."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from service.errors import StoreUnavailable
from service.jobs import shared
from service.store import JobBlobs
from service.store.sqlite import SQLiteJobStore

MIB = 1024 * 1024


class CountingBlobs(JobBlobs):
    """Blobs that count the bytes handed to them and not yet stored, and the largest such count."""

    def __init__(self, blobs: JobBlobs, refuse: bool = False) -> None:
        self.blobs = blobs
        self.in_flight = 0
        self.most = 0
        self.calls = 0
        self.refuse = refuse

    async def put(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        self.calls += 1
        size = sum(len(data) for data in blobs.values())
        self.in_flight += size
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # the statement takes a while: other jobs' copies overlap it
            if self.refuse:
                raise StoreUnavailable("put_blobs")
            await self.blobs.put(job_id, blobs)
        finally:
            self.in_flight -= size

    async def read(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        return await self.blobs.read(job_id, name, offset, length)

    async def sizes(self, job_id: str) -> dict[str, int]:
        return await self.blobs.sizes(job_id)


class CountingStore(SQLiteJobStore):
    """A SQLite store whose blobs count (``CountingBlobs``)."""

    def __init__(self, path: Path, refuse: bool = False) -> None:
        super().__init__(path)
        self.blobs = self.counting = CountingBlobs(self.blobs, refuse)


def job_folder(root: Path, name: str, files: int) -> tuple[Path, list[dict[str, Any]]]:
    folder = root / name
    (folder / "files").mkdir(parents=True)
    (folder / "stdout").write_bytes(b"o" * MIB)
    (folder / "stderr").write_bytes(b"e" * MIB)
    for index in range(files):
        (folder / "files" / str(index)).write_bytes(b"f" * MIB)
    return folder, [{"path": f"f{index}"} for index in range(files)]


async def test_many_jobs_ending_together_hold_a_bounded_number_of_bytes(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "jobs.sqlite3")
    await store.open()
    try:
        slots = asyncio.Semaphore(shared.SHARE_AT_ONCE)
        jobs = [job_folder(tmp_path / "output", f"job_{n}", files=4) for n in range(12)]  # 6 MiB each, 72 in all
        await asyncio.gather(*(shared.share(store, folder, listed, folder.name, slots) for folder, listed in jobs))
        assert store.counting.most <= shared.SHARE_AT_ONCE * MIB  # one blob per slot, not every job's whole output
        for folder, _ in jobs:
            assert await store.blobs.sizes(folder.name) == {
                "stdout": MIB,
                "stderr": MIB,
                **{f"files/{i}": MIB for i in range(4)},
            }
    finally:
        await store.close()


async def test_a_store_that_refuses_is_asked_once_per_job(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "jobs.sqlite3", refuse=True)
    await store.open()
    try:
        folder, listed = job_folder(tmp_path / "output", "job_1", files=20)
        with pytest.raises(StoreUnavailable):
            await shared.share(store, folder, listed, "job_1", asyncio.Semaphore(shared.SHARE_AT_ONCE))
        assert store.counting.calls == 1  # not 22 waits of PTC_STORE_TIMEOUT_S before the job's final view is saved
    finally:
        await store.close()
