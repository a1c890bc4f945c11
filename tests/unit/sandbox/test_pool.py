"""The warm pool on the fake backend: it waits for an engine that is down, stays off for an image that cannot serve
it, and hands each sandbox out once."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.sandbox import pool as pool_module
from service.sandbox.backend import SandboxHandle, SandboxSpec
from service.sandbox.fake import RUNTIME_LABELS, FakeBackend
from service.sandbox.pool import PoolSettings, WarmPools


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ptcp", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def spec(folder: Path, image: str = "ptc-fake:1", memory_mb: int = 128) -> SandboxSpec:
    return SandboxSpec(
        image=image,
        job_dir=folder / "jobs",
        memory_mb=memory_mb,
        cpus=1,
        pids=64,
        tmp_mb=8,
        file_size_mb=8,
        open_files=64,
        labels={"io.ptc-sandbox.test": "pool"},
    )


async def ready(pools: WarmPools, name: str, count: int) -> None:
    for _ in range(500):
        if pools.sizes().get(name, 0) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"pool {name} has {pools.sizes()} after 10 s")


async def test_an_engine_down_at_start_delays_the_pool_until_it_answers(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pool_module, "REFILL_BACKOFF_S", 0.05)
    backend = FakeBackend(images={"ptc-fake:1": RUNTIME_LABELS})
    backend.engine_down = True
    pools = WarmPools(backend, spec(folder), folder / "pool", PoolSettings(1, 600, 2))
    try:
        await pools.start()
        assert not pools.enabled
        assert pools.take(spec(folder)) is None
        assert pools.sizes() == {}  # nothing was created for a profile meanwhile
        backend.engine_down = False
        await ready(pools, "default", 1)
        assert pools.enabled
        sandbox = pools.take(spec(folder))
        assert sandbox is not None and sandbox.handle is not None and sandbox.broken is None
        assert pools.take(spec(folder)) is None  # handed out once: the next one is not started yet
        await sandbox.destroy()
    finally:
        await pools.close()
        await backend.close()
    assert "warm pool off" not in caplog.text
    assert await backend.labelled({"io.ptc-sandbox.test": "pool"}) == []


async def test_an_image_without_the_session_feature_turns_the_pool_off(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeBackend(images={"ptc-old:1": {}})
    pools = WarmPools(backend, spec(folder, image="ptc-old:1"), folder / "pool", PoolSettings(1, 600, 2))
    with caplog.at_level(logging.WARNING):
        await pools.start()
    try:
        assert not pools.enabled
        assert pools.take(spec(folder, image="ptc-old:1")) is None
        assert "warm pool off" in caplog.text
        assert backend.starts == 0
    finally:
        await pools.close()


async def test_a_profile_of_its_own_gets_a_pool_on_first_demand(folder: Path) -> None:
    backend = FakeBackend()
    pools = WarmPools(backend, spec(folder), folder / "pool", PoolSettings(1, 600, 2))
    await pools.start()
    try:
        await ready(pools, "default", 1)
        other = spec(folder, memory_mb=256)
        assert pools.take(other) is None  # cold this time; its pool starts now
        names = [name for name in pools.sizes() if name != "default"]
        assert len(names) == 1
        await ready(pools, names[0], 1)
        taken = pools.take(other)
        assert taken is not None and taken.spec.memory_mb == 256
        await taken.destroy()
    finally:
        await pools.close()
        await backend.close()
    assert await backend.labelled({}) == []


class SlowRemoval(FakeBackend):
    """Each removal takes 0.3 s: long enough for a close that does not wait for it to return first."""

    async def remove(self, handle: SandboxHandle) -> None:
        await asyncio.sleep(0.3)
        await super().remove(handle)


async def test_close_waits_for_every_removal_begun(folder: Path) -> None:
    """Sandboxes evicted (removed in the background) and a start cut short by ``close`` are all gone when it returns."""
    backend = SlowRemoval()
    pools = WarmPools(backend, spec(folder), folder / "pool", PoolSettings(2, 600, 2))
    await pools.start()
    try:
        await ready(pools, "default", 2)
        assert pools.evict(lambda: False) is False  # both given up; their removals run in the background
        await asyncio.sleep(0)  # the refill begins starting a replacement
    finally:
        await pools.close()
    assert await backend.labelled({}) == []
    await backend.close()


async def test_one_keys_throwaway_profiles_never_keep_another_keys_profile_from_a_pool(folder: Path) -> None:
    """Key a fills every pool beyond the default with profiles nobody else asks for; key b's profile still gets a
    pool (a's least recently used is closed for it), a asking for more closes none of b's nor its own, and a pool
    both keys take from is shared: never closed for another profile."""
    backend = FakeBackend()
    pools = WarmPools(backend, spec(folder), folder / "pool", PoolSettings(1, 600, 4))  # the default + 3
    await pools.start()
    try:
        await ready(pools, "default", 1)
        for memory in (200, 210, 220, 230):  # the fourth finds no room: a holds every pool there is
            assert pools.take(spec(folder, memory_mb=memory), "a") is None
        held = {name for name in pools.sizes() if name != "default"}
        assert len(held) == 3
        data = spec(folder, image="ptc-fake:1", memory_mb=512)
        assert pools.take(data, "b") is None  # cold this time; a pool of a's is closed for it
        names = set(pools.sizes()) - {"default"}
        assert len(names) == 3 and len(names - held) == 1
        b_pool = (names - held).pop()
        await ready(pools, b_pool, 1)
        taken = pools.take(data, "b")
        assert taken is not None and taken.spec.memory_mb == 512  # warm
        await taken.destroy()
        for memory in (240, 250):  # a holds 2, b 1: a closes neither b's pool nor its own
            assert pools.take(spec(folder, memory_mb=memory), "a") is None
        assert set(pools.sizes()) - {"default"} == names
        shared = next(iter(names - {b_pool}))
        a_spec = next(spec(folder, memory_mb=m) for m in (200, 210, 220) if pool_name(pools, m) == shared)
        await ready(pools, shared, 1)
        taken = pools.take(a_spec, "c")  # c takes from one of a's: shared from now on
        assert taken is not None
        await taken.destroy()
        assert pools.take(spec(folder, memory_mb=300), "d") is None  # a holds 1 (not 2 more than d): no pool for d
        assert set(pools.sizes()) - {"default"} == names
    finally:
        await pools.close()
        await backend.close()
    assert await backend.labelled({}) == []


def pool_name(pools: WarmPools, memory_mb: int) -> str | None:
    """The name of the pool of the test profile of ``memory_mb``, if there is one."""
    for key, pool in pools._pools.items():
        if key[2] == memory_mb:
            return pool.name
    return None
