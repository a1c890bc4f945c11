"""Quotas per API key, host capacity and the script slots (``service/quotas.py``).

Unit tests of the ledgers need no engine. The integration tests share one service with several keys,
each with one tight quota (``KEY_QUOTAS``): a key that reaches its quota gets 429 problem+json with
``Retry-After`` and ``ptc_rejections_total{reason}`` counts it, while another key is still served.
The service runs no warm pool and at most ``CONCURRENCY`` scripts at once, so that sandbox starts stay
few and the concurrency of session scripts can be measured from inside them.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from service.errors import QuotaExceeded
from service.observability.metrics import Metrics
from service.output import OutputLog
from service.quotas import REJECTION_REASONS, HostCapacity, OutputBudget, Quotas, machine_memory_mb
from service.sandbox.backend import SandboxBackend, SandboxSpec
from service.sandbox.pool import PooledSandbox, PoolSettings, WarmPool, WarmPools
from service.sandbox.resident import ResidentSandbox
from service.settings import Settings
from service.slots import Slots
from service.tenancy import IMPLICIT_OWNER


def settings(**values: Any) -> Settings:
    return Settings(max_concurrent_sandboxes=4, max_queue=100, max_sessions=32, **values)


def test_default_quotas_are_smaller_than_the_global_limits() -> None:
    capacity = HostCapacity(24 * 1024, 2 * 8)
    quota = Quotas(settings(), capacity).of("anyone")
    assert (quota.running_jobs, quota.queued_jobs, quota.sessions) == (2, 25, 8)
    assert quota.running_jobs < 4 and quota.running_jobs + quota.queued_jobs < 4 + 100 and quota.sessions < 32
    assert quota.session_memory_mb == 6 * 1024 and quota.session_cpus == 4
    assert quota.output_bytes == 1024**3 and quota.jobs_per_minute == 600


def test_one_tenant_has_the_whole_host_by_default_and_explicit_settings_still_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    capacity = HostCapacity(24 * 1024, 2 * 8)
    whole = Quotas(settings(), capacity, single_tenant=True).of(IMPLICIT_OWNER)
    assert (whole.running_jobs, whole.queued_jobs, whole.sessions) == (4, 100, 32)  # the global limits
    assert (whole.session_memory_mb, whole.session_cpus) == (capacity.memory_mb, capacity.cpus)
    assert whole.jobs_per_minute is None and whole.output_bytes == 1024**3
    quotas = Quotas(settings(), capacity, single_tenant=True)
    for _ in range(16):  # the load: sessions of 1 CPU up to the host's capacity, not a quarter of it
        quotas.admit_session(IMPLICIT_OWNER, 64, 1)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_session(IMPLICIT_OWNER, 64, 1)
    assert (refused.value.reason, refused.value.limit) == ("session_cpus", 16)
    for _ in range(2000):  # no jobs_per_minute limit
        quotas.admit_job(IMPLICIT_OWNER)
        quotas.job_ended(IMPLICIT_OWNER)
    monkeypatch.setenv("PTC_KEY_QUOTAS", json.dumps({IMPLICIT_OWNER: {"sessions": 2}}))
    explicit = Quotas(settings(quota_jobs_per_minute=5, quota_session_cpus=3), capacity, single_tenant=True)
    assert (explicit.of(IMPLICIT_OWNER).sessions, explicit.of(IMPLICIT_OWNER).running_jobs) == (2, 4)
    assert (explicit.of(IMPLICIT_OWNER).jobs_per_minute, explicit.of(IMPLICIT_OWNER).session_cpus) == (5, 3)


@pytest.mark.parametrize(
    ("keys", "single"),
    [
        (None, True),  # authentication disabled: the implicit owner alone
        ("solo", True),
        ("solo,solo", True),  # two tokens of one name (a rotation): one tenant
        ("a,b", False),
    ],
)
def test_single_tenant_is_authentication_disabled_or_one_key_name(
    tmp_path: Path, keys: str | None, single: bool
) -> None:
    from service.tenancy import configure, hash_token, single_tenant

    if keys is None:
        configured = Settings(work_dir=tmp_path, auth="disabled")
    else:
        entries = ",".join(f"{name}:{hash_token(f'{name}-{i}')}" for i, name in enumerate(keys.split(",")))
        configured = Settings(work_dir=tmp_path, auth="required", api_keys=entries)
    assert single_tenant(configure(configured)) is single


def test_key_quotas_override_only_what_they_name_and_the_implicit_owner_gets_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PTC_KEY_QUOTAS", json.dumps({"agent-a": {"running_jobs": 8, "sessions": 0}}))
    monkeypatch.setenv("PTC_QUOTA_QUEUED_JOBS", "3")
    quotas = Quotas(settings(), HostCapacity(8192, 16))
    a, default = quotas.of("agent-a"), quotas.of("agent-b")
    assert (a.running_jobs, a.sessions, a.queued_jobs) == (8, 0, 3)
    assert (default.running_jobs, default.sessions, default.queued_jobs) == (2, 8, 3)
    assert quotas.of(IMPLICIT_OWNER) == default  # auth disabled: the one implicit owner has the quotas too
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_session("agent-a", 256, 1)
    assert refused.value.reason == "sessions"
    with pytest.raises(ValueError):
        Settings(key_quotas={"x": {"runing_jobs": 1}})  # a typo is refused


def test_a_key_holds_at_most_running_plus_queued_jobs_and_others_are_not_affected() -> None:
    quotas = Quotas(settings(quota_running_jobs=1, quota_queued_jobs=2), HostCapacity(8192, 16))
    for _ in range(3):
        quotas.admit_job("a")
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_job("a")
    assert refused.value.reason == "queued_jobs" and refused.value.retry_after_s >= 1
    quotas.admit_job("b")
    quotas.job_ended("a")
    quotas.admit_job("a")
    no_queue = Quotas(settings(quota_running_jobs=1, quota_queued_jobs=0), HostCapacity(8192, 16))
    no_queue.admit_job("a")
    with pytest.raises(QuotaExceeded) as refused:
        no_queue.admit_job("a")
    assert refused.value.reason == "running_jobs"


def test_jobs_per_minute_is_a_sliding_window(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    quotas = Quotas(settings(quota_jobs_per_minute=2), HostCapacity(8192, 16))
    quotas.admit_job("a")
    now[0] += 20
    quotas.admit_job("a")
    quotas.job_ended("a")
    quotas.job_ended("a")
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_job("a")
    assert refused.value.reason == "jobs_per_minute" and refused.value.retry_after_s == 40
    quotas.admit_job("b")
    now[0] += 40
    quotas.admit_job("a")


def test_retained_output_is_capped_per_key_and_the_inline_output_stays_whole(tmp_path: Path) -> None:
    quotas = Quotas(settings(quota_output_bytes=1500), HostCapacity(8192, 16))
    budget = quotas.output("a")
    first = OutputLog(tmp_path / "1", 256, 1000, budget)
    second = OutputLog(tmp_path / "2", 256, 1000, budget)
    first.write(b"a" * 900)
    second.write(b"b" * 400)
    second.write(b"c" * 400)  # the job's own cap (1000) leaves room, the key's (1500) does not
    first.write(b"d" * 400)
    for log in (first, second):
        log.close()
    assert (first.retained_bytes, second.retained_bytes) == (900, 600)
    assert (tmp_path / "1").stat().st_size + (tmp_path / "2").stat().st_size == 1500
    rendered = second.inline.render()
    assert rendered.total_bytes == 800 and rendered.text.startswith("b" * 128) and rendered.text.endswith("c" * 128)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_job("a")
    assert refused.value.reason == "output_bytes"
    quotas.admit_job("b")
    budget.give_back(900)  # the first job was purged
    quotas.admit_job("a")


def test_a_refused_take_all_takes_nothing_and_holds_the_owner_at_its_quota_until_bytes_come_back() -> None:
    budget = OutputBudget(1000)
    assert budget.take_all(600) and budget.used == 600 and not budget.exhausted
    assert not budget.take_all(500)  # a call record's 500 bytes of arguments: not kept, and nothing taken
    assert budget.used == 600 and budget.exhausted  # new jobs of the owner are refused (output_bytes)
    budget.give_back(600)  # its job was purged
    assert not budget.exhausted and budget.take_all(1000) and budget.exhausted


def test_output_budget_is_exact_under_threads() -> None:
    budget = OutputBudget(10_000)

    def take() -> int:
        return sum(budget.take(7) for _ in range(1000))

    async def main() -> list[int]:
        return await asyncio.gather(*(asyncio.to_thread(take) for _ in range(8)))

    assert sum(asyncio.run(main())) == 10_000 and budget.exhausted


def test_sessions_are_admitted_by_count_memory_and_cpus() -> None:
    quotas = Quotas(settings(quota_sessions=2, quota_session_memory_mb=400, quota_session_cpus=1.5), HostCapacity(1, 1))
    quotas.admit_session("a", 256, 1)
    reasons = []
    for memory, cpus in ((128, 1), (200, 0.5)):
        with pytest.raises(QuotaExceeded) as refused:
            quotas.admit_session("a", memory, cpus)
        reasons.append(refused.value.reason)
    assert reasons == ["session_cpus", "session_memory_mb"]
    quotas.admit_session("a", 64, 0.5)
    with pytest.raises(QuotaExceeded) as refused:
        quotas.admit_session("a", 16, 0)
    assert refused.value.reason == "sessions"
    quotas.session_ended("a", 256, 1)
    quotas.admit_session("a", 256, 1)


async def test_host_capacity_refuses_32_sessions_of_4_gib_and_2_cpus_on_a_2_cpu_24_gib_machine() -> None:
    capacity = HostCapacity.from_settings(Settings(host_memory_mb=24 * 1024, host_cpus=2))
    assert (capacity.memory_mb, capacity.cpus) == (24 * 1024, 16)
    held = []
    for _ in range(32):
        commitment = capacity.commit(4096, 2)
        if commitment is None:
            break
        held.append(commitment)
    assert len(held) == 6 and capacity.shortfall(4096, 2) == "host_memory_mb"
    assert capacity.refusal(4096, 2, "host_memory_mb").reason == "host_memory_mb"
    changed = capacity.changed()
    held[0].release()
    held[0].release()  # once only
    assert changed.is_set() and (capacity.committed_memory_mb, capacity.committed_cpus) == (5 * 4096, 10)
    assert capacity.shortfall(256, 7) == "host_cpus"
    assert capacity.commit(4096, 2) is not None


def test_host_capacity_defaults_to_the_machine() -> None:
    capacity = HostCapacity.from_settings(Settings())
    assert capacity.memory_mb == machine_memory_mb() > 0
    assert capacity.cpus == 8 * (os.cpu_count() or 1)


async def test_slots_bound_the_total_and_each_owner_without_one_owner_holding_up_another() -> None:
    slots = Slots(2)
    order: list[str] = []

    async def job(owner: str, cap: int, hold: asyncio.Event) -> None:
        slot = slots.of(owner, cap)
        await slot.acquire()
        order.append(owner)
        try:
            await hold.wait()
        finally:
            slot.release()

    hold = asyncio.Event()
    tasks = [asyncio.create_task(job(owner, 1, hold)) for owner in ("a", "a", "a", "b")]
    await asyncio.sleep(0.01)
    assert order == ["a", "b"] and slots.in_use == 2  # a's later jobs wait for a's cap; b is not behind them
    waiting = asyncio.create_task(job("c", 1, hold))
    await asyncio.sleep(0.01)
    waiting.cancel()  # a waiter that gives up holds nothing
    await asyncio.gather(waiting, return_exceptions=True)
    hold.set()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "a", "a"] and slots.in_use == 0 and slots.held("a") == 0


async def test_pooled_sandboxes_commit_room_and_give_it_up_to_whoever_needs_it(tmp_path: Path) -> None:
    capacity = HostCapacity(1024, 16)
    backend = cast(SandboxBackend, object())  # never called: these sandboxes were never started
    spec = SandboxSpec("x", tmp_path, memory_mb=256, cpus=1, pids=64, tmp_mb=8, file_size_mb=8, open_files=64)
    pools = WarmPools(backend, spec, tmp_path / "pool", PoolSettings(2, 600, 2), capacity=capacity)
    for name in ("default", "other"):
        pool = WarmPool(backend, spec, tmp_path / name, PoolSettings(2, 600, 2), name, capacity)
        pools._pools[(name,)] = pool
        for i in range(2):
            sandbox = ResidentSandbox(backend, replace(spec, job_dir=tmp_path / name / str(i)))
            sandbox.commitment = capacity.commit(spec.memory_mb, spec.cpus)
            pool._ready.append(PooledSandbox(sandbox))
    assert capacity.committed_memory_mb == 1024 and capacity.shortfall(512, 1) == "host_memory_mb"
    assert pools.evict(lambda: capacity.shortfall(512, 1) is None)
    assert pools.sizes() == {"default": 2, "other": 0}  # other profiles give up theirs first
    assert capacity.commit(512, 1) is not None
    assert not pools.evict(lambda: capacity.shortfall(1024, 1) is None)  # all given up, still not enough
    assert pools.sizes() == {"default": 0, "other": 0} and capacity.committed_memory_mb == 512
    await asyncio.sleep(0.1)  # their removal runs in the background


def test_rejection_reasons_are_bounded_and_present_from_the_start() -> None:
    metrics = Metrics(Settings())
    metrics.rejection("not-a-reason")
    text = metrics.exposition().decode()
    for reason in REJECTION_REASONS:
        assert f'ptc_rejections_total{{reason="{reason}"}} 0.0' in text
    assert 'ptc_rejections_total{reason="other"} 1.0' in text
