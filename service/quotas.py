"""Admission: quotas per API key and the host's capacity.

Two ledgers, all kept in this process's memory and changed only on the event loop (the output
budget has a lock of its own besides, so that an output sink may take from it on any thread):

``Quotas``
    what each owner (an API key's name, or ``IMPLICIT_OWNER`` without authentication) has: jobs not
    ended, jobs admitted in the last 60 s, open sessions with the memory and CPUs they asked for, and
    output bytes its jobs retain on disk. A request past a quota raises ``QuotaExceeded`` naming it.
    The quotas of a key are ``PTC_KEY_QUOTAS[key]`` where given, else the ``PTC_QUOTA_*`` defaults.
    Those not set are derived from the global limits: with several keys, a share of them (a half or a
    quarter, ``SHARES``) so that one key cannot take all of them; with one tenant (authentication
    disabled, or keys of one name: ``auth.single_tenant``) the whole of them, and no ``jobs_per_minute``
    limit (the queue bound and the concurrency still hold).

``HostCapacity``
    memory (MiB) and CPUs committed by sandboxes that exist: one-shot jobs' (from their start until
    their removal), sessions' (for their whole life) and the warm pool's. A sandbox commits its limits
    before it starts; the total may not pass the host's memory and CPU count (``PTC_HOST_MEMORY_MB``,
    ``PTC_HOST_CPUS``, default the machine's) times their overcommit factors. A session that does not
    fit is refused (``QuotaExceeded``, reason ``host_memory_mb`` or ``host_cpus``); a one-shot job
    waits in the queue until it fits; the warm pool only fills room nobody waits for, and gives its
    idle sandboxes up to whoever needs the room.

The third ledger, the script slots every running script takes, is ``service.slots``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TypeVar

from service.errors import HostCapacityExceeded, QuotaExceeded
from service.settings import KeyQuotas, Settings

QUOTA_NAMES = (
    "running_jobs",
    "queued_jobs",
    "sessions",
    "session_memory_mb",
    "session_cpus",
    "output_bytes",
    "jobs_per_minute",
)
HOST_REASONS = ("host_memory_mb", "host_cpus")
GLOBAL_REASONS = ("queue_full", "max_sessions")
READ_REASONS = ("concurrent_reads",)  # a key's answers under way (api.reads.ReadSlots)
REJECTION_REASONS = QUOTA_NAMES + HOST_REASONS + GLOBAL_REASONS + READ_REASONS
"""Every value of the ``reason`` label of ``ptc_rejections_total``."""
RATE_WINDOW_S = 60.0
SHARES = {"running_jobs": 2, "queued_jobs": 4, "sessions": 4, "session_memory_mb": 4, "session_cpus": 4}
"""With several keys, the default of each quota is its global limit divided by this (at least 1)."""
JOBS_PER_MINUTE = 600
"""With several keys, the default ``jobs_per_minute``; with one tenant, none."""
SESSION_RETRY_AFTER_S = 30  # room for a session comes back when one ends: not within seconds
EPSILON = 1e-9
_T = TypeVar("_T", int, float)


@dataclass(frozen=True)
class Quota:
    """One owner's quotas, resolved (see ``settings.KeyQuotas`` for the fields' meaning and units)."""

    running_jobs: int
    queued_jobs: int
    sessions: int
    session_memory_mb: int
    session_cpus: float
    output_bytes: int
    jobs_per_minute: int | None  # None: no limit


def machine_memory_mb() -> int:
    """The machine's physical memory (MiB), from ``sysconf``; 0 when it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))
    except (ValueError, OSError):
        return 0


class HostCapacity:
    """Memory (MiB) and CPUs that existing sandboxes may commit, and how much they have.

    Args:
        memory_mb: the capacity for memory, overcommit included.
        cpus: the capacity for CPUs, overcommit included.
    """

    def __init__(self, memory_mb: float, cpus: float) -> None:
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.committed_memory_mb = 0.0
        self.committed_cpus = 0.0
        self.waiting = 0  # jobs waiting for room (the warm pool leaves the room to them)
        self._changed = asyncio.Event()

    @classmethod
    def from_settings(cls, settings: Settings) -> HostCapacity:
        """``PTC_HOST_MEMORY_MB`` x ``PTC_MEMORY_OVERCOMMIT`` and ``PTC_HOST_CPUS`` x ``PTC_CPU_OVERCOMMIT``,
        each host figure defaulting to the machine's."""
        memory = settings.host_memory_mb or machine_memory_mb() or 1024
        cpus = settings.host_cpus or os.cpu_count() or 1
        return cls(memory * settings.memory_overcommit, cpus * settings.cpu_overcommit)

    def shortfall(self, memory_mb: float, cpus: float) -> str | None:
        """None when a sandbox of ``memory_mb`` and ``cpus`` fits now, else the reason (``host_memory_mb``,
        ``host_cpus``)."""
        if self.committed_memory_mb + memory_mb > self.memory_mb + EPSILON:
            return "host_memory_mb"
        if self.committed_cpus + cpus > self.cpus + EPSILON:
            return "host_cpus"
        return None

    def commit(self, memory_mb: float, cpus: float) -> Commitment | None:
        """Commit room for one sandbox; None (nothing committed) when it does not fit."""
        if self.shortfall(memory_mb, cpus) is not None:
            return None
        self.committed_memory_mb += memory_mb
        self.committed_cpus += cpus
        return Commitment(self, memory_mb, cpus)

    def _release(self, memory_mb: float, cpus: float) -> None:
        self.committed_memory_mb = max(self.committed_memory_mb - memory_mb, 0.0)
        self.committed_cpus = max(self.committed_cpus - cpus, 0.0)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def changed(self) -> asyncio.Event:
        """An event set at the next release after this call."""
        return self._changed

    def refusal(self, memory_mb: float, cpus: float, reason: str) -> HostCapacityExceeded:
        """The 429 of a session that does not fit (``reason`` from ``shortfall``)."""
        if reason == "host_memory_mb":
            have, used, asked, unit = self.memory_mb, self.committed_memory_mb, memory_mb, " MiB"
        else:
            have, used, asked, unit = self.cpus, self.committed_cpus, cpus, " CPUs"
        return HostCapacityExceeded(
            f"the host cannot take a sandbox of {asked:g}{unit}: {used:g}{unit} of its {have:g}{unit} are "
            "committed to sandboxes (PTC_HOST_MEMORY_MB, PTC_HOST_CPUS and their overcommit)",
            reason,
            have,
            SESSION_RETRY_AFTER_S,
        )


class Commitment:
    """Room committed for one sandbox; ``release`` gives it back (once, whoever calls it how often)."""

    def __init__(self, capacity: HostCapacity, memory_mb: float, cpus: float) -> None:
        self._capacity = capacity
        self.memory_mb = memory_mb
        self.cpus = cpus
        self._released = False

    def release(self) -> None:
        """Give the room back (idempotent)."""
        if not self._released:
            self._released = True
            self._capacity._release(self.memory_mb, self.cpus)


class OutputBudget:
    """Bytes an owner's jobs may still make the service keep: retained output and output files on disk, the
    arguments and results of call records in the store (thread-safe: its jobs' output sinks take from it).

    Args:
        limit: the owner's ``output_bytes`` quota.
        used: bytes its jobs retain already (found at start-up).
    """

    def __init__(self, limit: int, used: int = 0) -> None:
        self.limit = limit
        self.used = used
        self._refused = False  # a ``take_all`` did not fit: at the quota, until bytes are given back
        self._lock = threading.Lock()

    def take(self, wanted: int) -> int:
        """Of ``wanted`` bytes, how many may be retained (now counted as used)."""
        with self._lock:
            granted = max(min(wanted, self.limit - self.used), 0)
            self.used += granted
            return granted

    def take_all(self, wanted: int) -> bool:
        """Whether all ``wanted`` bytes may be kept (then counted as used). When not, none are taken and the budget
        counts as ``exhausted`` until bytes are given back (what was refused is what the owner wanted to keep)."""
        with self._lock:
            if self.used + wanted > self.limit:
                self._refused = True
                return False
            self.used += wanted
            return True

    def charge(self, count: int) -> None:
        """Count ``count`` bytes kept whatever the quota (an ended job's row in the store: a finished result is
        never dropped); past the quota, the owner's next job is refused until a purge gives bytes back."""
        with self._lock:
            self.used += max(count, 0)

    def give_back(self, count: int) -> None:
        """``count`` retained bytes were deleted (their job was purged)."""
        with self._lock:
            self.used = max(self.used - count, 0)
            self._refused = False

    @property
    def exhausted(self) -> bool:
        """Whether nothing more may be retained (or the last ``take_all`` was refused)."""
        return self.used >= self.limit or self._refused


@dataclass
class Usage:
    """What one owner holds now."""

    jobs: int = 0  # admitted, not ended (one-shot and session scripts)
    admitted_at: collections.deque[float] = field(default_factory=collections.deque)  # monotonic s, last 60 s
    sessions: int = 0
    session_memory_mb: float = 0.0
    session_cpus: float = 0.0


class Quotas:
    """The per-owner quotas and what each owner uses of them (see the module docstring).

    Args:
        settings: the ``PTC_QUOTA_*`` defaults, ``PTC_KEY_QUOTAS``, and the global limits the defaults
            derive from.
        capacity: the host capacity the default session memory and CPU quotas derive from.
        single_tenant: one tenant (``auth.single_tenant``): the defaults are the whole of the global limits
            and the host capacity, not a share of them; explicit settings still win.
    """

    def __init__(self, settings: Settings, capacity: HostCapacity, *, single_tenant: bool = False) -> None:
        self._settings = settings
        self.single_tenant = single_tenant

        def part(name: str) -> int:  # what the default is a 1/part of
            return 1 if single_tenant else SHARES[name]

        rate = settings.quota_jobs_per_minute
        self._default = Quota(
            running_jobs=_or(settings.quota_running_jobs, max(1, settings.concurrency() // part("running_jobs"))),
            queued_jobs=_or(settings.quota_queued_jobs, max(1, settings.max_queue // part("queued_jobs"))),
            sessions=_or(settings.quota_sessions, max(1, settings.max_sessions // part("sessions"))),
            session_memory_mb=_or(
                settings.quota_session_memory_mb, int(capacity.memory_mb // part("session_memory_mb"))
            ),
            session_cpus=_or(settings.quota_session_cpus, capacity.cpus / part("session_cpus")),
            output_bytes=settings.quota_output_bytes,
            jobs_per_minute=rate if rate is not None or single_tenant else JOBS_PER_MINUTE,
        )
        self._quotas = {name: self._resolve(q) for name, q in settings.key_quotas.items()}
        self._usage: dict[str, Usage] = {}
        self._output: dict[str, OutputBudget] = {}
        self._output_lock = threading.Lock()

    def _resolve(self, overrides: KeyQuotas) -> Quota:
        given = {name: value for name, value in overrides.model_dump().items() if value is not None}
        return Quota(**{**self._default.__dict__, **given})

    def of(self, owner: str) -> Quota:
        """The quotas of ``owner``."""
        return self._quotas.get(owner, self._default)

    def usage(self, owner: str) -> Usage:
        """What ``owner`` holds now (created empty on first use)."""
        usage = self._usage.get(owner)
        if usage is None:
            usage = self._usage[owner] = Usage()
        return usage

    def output(self, owner: str) -> OutputBudget:
        """The budget of retained output bytes of ``owner``'s jobs."""
        with self._output_lock:
            budget = self._output.get(owner)
            if budget is None:
                budget = self._output[owner] = OutputBudget(self.of(owner).output_bytes)
            return budget

    # -- jobs ----------------------------------------------------------------------------------

    def admit_job(self, owner: str) -> None:
        """Count a new job of ``owner`` (one-shot or session script), or refuse it.

        A key may hold ``running_jobs + queued_jobs`` jobs that have not ended; submit at most
        ``jobs_per_minute`` in any 60 s; and submit none while its retained output is at ``output_bytes``.

        Raises:
            QuotaExceeded: reason ``queued_jobs`` (``running_jobs`` when the key may queue none),
                ``jobs_per_minute`` or ``output_bytes``.
        """
        quota, usage, now = self.of(owner), self.usage(owner), time.monotonic()
        self.room_for_job(owner)
        window = usage.admitted_at
        while window and now - window[0] >= RATE_WINDOW_S:
            window.popleft()
        if quota.jobs_per_minute is not None and len(window) >= quota.jobs_per_minute:
            wait = RATE_WINDOW_S - (now - window[0]) if window else RATE_WINDOW_S
            raise QuotaExceeded(
                f"key {owner!r} has submitted {len(window)} jobs in the last 60 s, its jobs_per_minute quota",
                "jobs_per_minute",
                quota.jobs_per_minute,
                math.ceil(wait),
            )
        if self.output(owner).exhausted:
            raise QuotaExceeded(
                f"the jobs of key {owner!r} retain {quota.output_bytes} bytes of output, its output_bytes quota; "
                "new jobs are admitted once older jobs are purged (PTC_JOB_RETENTION_S)",
                "output_bytes",
                quota.output_bytes,
                math.ceil(self._settings.purge_interval_s),
            )
        usage.jobs += 1
        if quota.jobs_per_minute is not None:  # no limit: nothing to remember
            window.append(now)

    def room_for_job(self, owner: str) -> None:
        """Raise QuotaExceeded (reason ``queued_jobs``, or ``running_jobs`` when the key may queue none) when
        ``owner`` holds ``running_jobs + queued_jobs`` jobs that have not ended (parked ones are not counted)."""
        quota, usage = self.of(owner), self.usage(owner)
        held = quota.running_jobs + quota.queued_jobs
        if usage.jobs >= held:
            reason = "queued_jobs" if quota.queued_jobs else "running_jobs"
            raise QuotaExceeded(
                f"key {owner!r} has {usage.jobs} jobs running or waiting, its quota "
                f"(running_jobs {quota.running_jobs} + queued_jobs {quota.queued_jobs}); retry when one has ended",
                reason,
                held,
                self._settings.retry_after_s,
            )

    def count_job(self, owner: str) -> None:
        """Count a job of ``owner`` without any check (a durable job resumed: it was admitted once)."""
        self.usage(owner).jobs += 1

    def job_ended(self, owner: str) -> None:
        """A job ``admit_job`` counted has ended (or was never started)."""
        usage = self.usage(owner)
        usage.jobs = max(usage.jobs - 1, 0)

    # -- sessions ------------------------------------------------------------------------------

    def admit_session(self, owner: str, memory_mb: float, cpus: float) -> None:
        """Count a new session of ``owner`` with these sandbox limits, or refuse it.

        Raises:
            QuotaExceeded: reason ``sessions``, ``session_memory_mb`` or ``session_cpus``.
        """
        quota, usage = self.of(owner), self.usage(owner)
        if usage.sessions >= quota.sessions:
            raise QuotaExceeded(
                f"key {owner!r} has {usage.sessions} sessions open, its sessions quota; delete one or retry later",
                "sessions",
                quota.sessions,
                SESSION_RETRY_AFTER_S,
            )
        for reason, held, asked, limit, unit in (
            ("session_memory_mb", usage.session_memory_mb, memory_mb, quota.session_memory_mb, " MiB"),
            ("session_cpus", usage.session_cpus, cpus, quota.session_cpus, " CPUs"),
        ):
            if held + asked > limit + EPSILON:
                raise QuotaExceeded(
                    f"key {owner!r} has {held:g}{unit} in open sessions; another {asked:g}{unit} would pass its "
                    f"{reason} quota of {limit:g}{unit}",
                    reason,
                    limit,
                    SESSION_RETRY_AFTER_S,
                )
        usage.sessions += 1
        usage.session_memory_mb += memory_mb
        usage.session_cpus += cpus

    def session_ended(self, owner: str, memory_mb: float, cpus: float) -> None:
        """A session ``admit_session`` counted has ended (or failed to start)."""
        usage = self.usage(owner)
        usage.sessions = max(usage.sessions - 1, 0)
        usage.session_memory_mb = max(usage.session_memory_mb - memory_mb, 0.0)
        usage.session_cpus = max(usage.session_cpus - cpus, 0.0)


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value
