"""Parked jobs: durable one-shot jobs that wait for the harness (a client-executed call, an approval) without a
sandbox (docs/durability.md, Parking).

A durable one-shot job whose calls have all waited ``PTC_PARK_AFTER_S`` for the harness, with no other call in
flight, is parked by its runner: its script is killed, its sandbox, script slot and memory are given back, and its
view is saved unfinished with ``parked_at`` and the calls it waits for (``pending_calls``, each with its
``expires_at``). What it costs from then on is its rows in the store and one entry here (``ParkedJobs``: its owner,
the calls it waits for and when each expires, and the time its runs have taken).

An answer (``POST /jobs/{id}/calls/{call_id}``, ``.../approve``, ``.../deny``) to a parked job is stored in its
call log in the call's place (``durable.encode_answer``), and the job is resumed by replay (``Recovery.resume_job``):
the replay makes the call again under its id and takes the answer, as if it had come while the job ran. A call
that is not answered by its ``expires_at`` gets its timeout stored the same way, and its job is resumed so that
its script sees the timeout. The entries are rebuilt from the store's unfinished jobs at start-up
(``Recovery.start``).

Bounded: at most ``PTC_MAX_PARKED_JOBS`` jobs are parked on a service, and, with several keys, a quarter of that
per key (``room``); a job past that waits in its sandbox as before. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from service.broker import Broker
from service.broker.durable import ANSWER, encode_answer
from service.jobs.live import LiveJob, now
from service.store import JobStore

PARKED_SHARE = 4  # with several keys, each may park 1/PARKED_SHARE of PTC_MAX_PARKED_JOBS
TIMEOUT_ANSWER: dict[str, Any] = {"kind": "timeout"}


@dataclass
class ParkedJob:
    """One parked job: its owner, the calls it waits for (call id -> what each awaits, ``client`` or ``approval``,
    and when it expires), the seconds its runs have taken (what its ``timeout_s`` counts)."""

    job_id: str
    owner: str
    calls: dict[str, tuple[str, datetime]]
    active_s: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one answer (and its resume) at a time


class ParkedJobs:
    """The jobs parked on this service (see the module).

    Args:
        max_jobs: ``PTC_MAX_PARKED_JOBS``.
        shared: whether several keys share the service (then each parks at most a quarter of ``max_jobs``).
    """

    def __init__(self, max_jobs: int, shared: bool) -> None:
        self._max = max_jobs
        self._per_owner = max(max_jobs // PARKED_SHARE, 1) if shared else max_jobs
        self._jobs: dict[str, ParkedJob] = {}
        self._by_owner: Counter[str] = Counter()
        self._reserved: Counter[str] = Counter()  # places taken by jobs being parked (``reserve``), by owner
        self._expiries: list[tuple[datetime, str, str]] = []  # (expires_at, job id, call id), a heap
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: str) -> ParkedJob | None:
        """The parked job ``job_id``, or None (not parked here, or resumed)."""
        return self._jobs.get(job_id)

    def count(self, owner: str) -> int:
        """How many of ``owner``'s jobs are parked."""
        return self._by_owner[owner]

    def room(self, owner: str) -> bool:
        """Whether a job of ``owner`` may be parked now (``PTC_MAX_PARKED_JOBS`` and the key's share), counting the
        places reserved by jobs being parked."""
        held = len(self._jobs) + self._reserved.total()
        return held < self._max and self._by_owner[owner] + self._reserved[owner] < self._per_owner

    def reserve(self, owner: str) -> bool:
        """Take a place for a job of ``owner`` about to be parked (``room``); False when there is none. The place is
        ``add``'s (``reserved``) or given back (``release``)."""
        if not self.room(owner):
            return False
        self._reserved[owner] += 1
        return True

    def release(self, owner: str) -> None:
        """Give back a place ``reserve`` took (the job was not parked after all)."""
        self._reserved[owner] -= 1
        if self._reserved[owner] <= 0:
            del self._reserved[owner]

    def add(self, parked: ParkedJob, reserved: bool = False) -> None:
        """Hold a job that has just been parked (``reserved``: in the place it reserved) or found parked at
        start-up, or taken over from a dead replica."""
        if reserved:
            self.release(parked.owner)
        if parked.job_id in self._jobs:
            return
        self._jobs[parked.job_id] = parked
        self._by_owner[parked.owner] += 1
        for call_id, (_, expires_at) in parked.calls.items():
            heapq.heappush(self._expiries, (expires_at, parked.job_id, call_id))
        self._changed.set()

    def take(self, job_id: str) -> ParkedJob | None:
        """Remove ``job_id`` (it is being resumed); None if it is not here."""
        parked = self._jobs.pop(job_id, None)
        if parked is not None:
            self._by_owner[parked.owner] -= 1
            if not self._by_owner[parked.owner]:
                del self._by_owner[parked.owner]
        return parked

    def _next_expired(self) -> tuple[ParkedJob, str] | None:
        """The first parked call whose expiry has passed (stale heap entries dropped), or None."""
        while self._expiries:
            expires_at, job_id, call_id = self._expiries[0]
            parked = self._jobs.get(job_id)
            if parked is None or call_id not in parked.calls or parked.calls[call_id][1] != expires_at:
                heapq.heappop(self._expiries)  # resumed, answered, or given another expiry since
                continue
            if expires_at > now():
                return None
            heapq.heappop(self._expiries)
            return parked, call_id
        return None

    async def expiry_loop(self, expire: Callable[[ParkedJob, str], Awaitable[None]]) -> None:
        """For ever (cancel it): at each parked call's expiry, ``expire(job, call_id)`` (stores the timeout and
        resumes the job: ``JobManager``); a failure is ``expire``'s to log."""
        while True:
            found = self._next_expired()
            if found is not None:
                await expire(*found)
                continue
            self._changed.clear()
            delay = (self._expiries[0][0] - now()).total_seconds() if self._expiries else 3600.0
            try:
                await asyncio.wait_for(self._changed.wait(), max(delay, 0.0) + 0.001)
            except TimeoutError:
                pass


def only_waits(broker: Broker) -> bool:
    """Whether every call the job has in flight (a ``pending`` record) waits for the harness (``PausedCalls``)."""
    in_flight: int = sum(record["status"] == "pending" for record in broker.records.calls)
    return in_flight == broker.paused.waiting


async def park_due(job: LiveJob, broker: Broker, after_s: float, parked: ParkedJobs) -> None:
    """Return once ``job`` should be parked: every call it has in flight has waited for the harness
    (``PausedCalls``) for ``after_s`` (``PTC_PARK_AFTER_S``) without a break, it is still durable, and a place was
    reserved for it (``ParkedJobs.reserve``: ``job.park_reserved``); checked at most once a second after that.
    ``job.parking`` is set, and what it waits for taken (``job.parked_calls``), in the same step: an answer that
    comes before the runner acts on it is given to the parked job (``JobManager._settle`` waits for the park), not
    to the script about to be killed, and a wait that times out or a call the script makes meanwhile does not
    leave it parked waiting for nothing."""
    paused, loop = broker.paused, asyncio.get_running_loop()
    while True:
        since = paused.waiting_since
        due = after_s if since is None else since + after_s - loop.time()
        if due > 0:
            await asyncio.sleep(min(due, after_s))
            continue
        if job.durable and only_waits(broker) and parked.reserve(job.owner):
            job.park_reserved = job.parking = True
            job.parked_calls = broker.paused.pending_calls
            return
        await asyncio.sleep(1.0)


async def store_answer(store: JobStore, job_id: str, call_id: str, answer: dict[str, Any], over: bool = True) -> bool:
    """Store ``answer`` in the place of the call ``call_id`` of ``job_id``'s call log (``durable.encode_answer``),
    over an earlier answer too unless not ``over`` (an expiry's timeout never replaces an answer); False when the
    log holds no intent of that call without an outcome (or, not ``over``, with an answer already). One row is
    written, none read. Raises what the store raises."""
    return await store.runs.settle(job_id, call_id, encode_answer(answer), ANSWER if over else None)
