"""The reaper: what a dead replica left is ended by a live one (docs/scaling.md, Detection; issue 17, point 5).

Every ``PTC_REPLICA_SCAN_S`` (jittered by ±20%, so that replicas started together do not scan together) every
live replica of a shared store:

1. **expires** each incarnation whose lease passed (``ReplicaRegistry.expire``: ``FOR UPDATE SKIP LOCKED``,
   each by one replica, ``NOTIFY ptc_replicas``), logs ``replica expired`` and breaks its sessions
   (``SessionRecords.mark_broken``), and those of any other incarnation that is not live
   (``SessionRecords.orphan_holders``);
2. **takes over or ends its orphans**, ``ORPHAN_BATCH`` at a time: unended jobs whose incarnation is not live or
   draining (``JobRecords.orphans``). A durable one (a run spec in the store) is taken over by this replica
   (``adopt``: resumed by replay here, or held parked here when it was parked waiting for the harness); any other
   is saved ``lost`` with the error type ``replica_lost``, their pending calls cancelled,
   their output and call records as of their owner's last progress save (``service.replicas.progress``): the
   chunks are joined into the job's ``stdout``/``stderr`` blobs, served by every replica as an ended job's.
   ``JobRecords.save_lost`` writes only an unended row (``NOTIFY <job_id> ended``): of two reapers racing, or of an
   owner saving its end while a survivor marks it, exactly one write counts, and only that replica publishes
   ``JobLost`` (metrics and logs count it once).

A replica that is fenced scans no more (its own jobs are others' to mark). With SQLite nothing runs: one replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import datetime

from service import exactjson
from service.errors import StoreUnavailable
from service.jobs.events import Events, JobLost
from service.jobs.live import SLICE_BYTES, STREAMS, ms, now, stored_job
from service.jobs.model import ErrorType, Failure, JobStatus
from service.observability import logs
from service.observability.metrics import Metrics
from service.output import CappedStream
from service.replicas.progress import chunk_name, chunk_start
from service.replicas.registration import Replicas
from service.store import Incarnation, JobStore, StoredJob
from service.views import render
from service.views.render import render_head

log = logging.getLogger(__name__)

ORPHAN_BATCH = 50
"""Orphans read and ended per query."""
MAX_BATCHES = 20
"""Batches per scan at most (the rest wait for the next scan: one scan never holds the loop's turn for long)."""
JITTER = 0.2
"""The scan interval's relative jitter."""

Replay = Callable[[str, CappedStream, int], Awaitable[int]]
"""``(stream, inline, limit) -> bytes``: writes a lost job's retained bytes of ``stream`` (at most ``limit``) into
``inline`` and returns how many it found."""


async def lost_row(
    stored: StoredJob, error: Failure, cancelled: str, replay: Replay, limit: int, status: JobStatus = JobStatus.LOST
) -> StoredJob:
    """The ended row of an unfinished job (``lost``, or ``status``): ``error``, its pending calls ended
    ``cancelled`` (a message), its inline output and byte counts from ``replay`` (at most ``limit`` bytes a stream,
    the retention)."""
    view = exactjson.loads(stored.view)  # its records may hold integers past 64 bits
    ended = now()
    started = datetime.fromisoformat(view["started_at"]) if view.get("started_at") else None
    for stream in STREAMS:
        inline = CappedStream(max(len(view[stream].encode()), 64 * 1024))
        size = await replay(stream, inline, limit)
        rendered = inline.render()
        view.update(
            {
                stream: rendered.text,
                f"{stream}_truncated": rendered.truncated,
                f"{stream}_invalid_utf8": rendered.invalid_utf8,
                f"{stream}_bytes": max(view[f"{stream}_bytes"], size),
                f"{stream}_retained_bytes": size,
                f"{stream}_next_offset": max(view[f"{stream}_bytes"], size),
            }
        )
    calls = [  # in arrival order, as every view keeps them: a record's seq tells its place
        {**c, "status": "error", "error": Failure(ErrorType.CANCELLED, cancelled).as_dict()}
        if c["status"] == "pending"
        else c
        for c in view["calls"]
    ]
    view.update(
        status=status.value,
        ended_at=ended,
        error=error.as_dict(),
        duration_ms=ms(started, ended),
        queue_ms=ms(datetime.fromisoformat(view["created_at"]), started or ended),
        calls=calls,
        calls_total=len(calls),
        calls_by_status=dict(Counter(c["status"] for c in calls)),  # its pending calls ended
        pending_calls=[],
    )
    body = b"".join([part async for part in render.stream(render_head(view), [], view["calls"])])
    return dataclasses.replace(
        stored_job(view, len(view["calls"]), body, stored.instance_id), instance_epoch=stored.instance_epoch
    )


class Reaper:
    """Expires dead replicas and ends the jobs they left (see the module's docstring).

    Args:
        store: the shared job store.
        replicas: this replica (its instance id, whether it is fenced; the registry is read again after an expiry).
        events: ``JobLost`` is published for each job this replica ended.
        scan_s: ``PTC_REPLICA_SCAN_S`` (s).
        retention_bytes: ``PTC_OUTPUT_RETENTION_BYTES``: the most bytes of a stream a lost job keeps.
        metrics: counts expiries, the jobs marked lost and the sessions marked broken (``Metrics.replica_expired``).

    Attributes:
        adopt: takes over an orphan that is durable (the job service's, set once it is built: ``JobManager``);
            True when it was taken over (by this replica, or by another first): it is not marked lost then.
    """

    def __init__(
        self,
        store: JobStore,
        replicas: Replicas,
        events: Events,
        scan_s: float,
        retention_bytes: int,
        metrics: Metrics | None = None,
    ) -> None:
        self._store = store
        self._replicas = replicas
        self._events = events
        self._metrics = metrics
        self._scan_s = scan_s
        self._retention = retention_bytes
        self.adopt: Callable[[StoredJob], Awaitable[bool]] | None = None

    async def loop(self) -> None:
        """Scan every ``scan_s`` (jittered) until this replica is fenced or the task is cancelled; a store that does
        not answer is logged and tried at the next scan."""
        while not self._replicas.fenced:
            await asyncio.sleep(self._scan_s * random.uniform(1 - JITTER, 1 + JITTER))
            try:
                await self.scan()
            except StoreUnavailable as exc:
                log.warning("the reaper's scan failed: %s", exc)
            except Exception:
                log.exception("the reaper's scan failed")

    async def scan(self) -> int:
        """One scan: expire passed leases, then end orphans; returns how many jobs this replica ended.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        if self._replicas.fenced:
            return 0
        me = self._replicas.incarnation.instance_id
        expired = await self._store.replicas.expire(me)
        broken = {incarnation: await self.break_sessions(incarnation) for incarnation in expired}
        for incarnation in await self._store.sessions.orphan_holders():  # left by a reaper that stopped half-way
            if incarnation not in broken and (late := await self.break_sessions(incarnation)) and self._metrics:
                self._metrics.lease_expired_sessions.inc(late)
        if expired:
            self._replicas.refresh_soon()
        ended: Counter[Incarnation] = Counter()
        try:
            for _ in range(MAX_BATCHES):
                batch = await self._store.jobs.orphans(ORPHAN_BATCH)
                for stored in batch:
                    if self._replicas.fenced:
                        return ended.total()
                    if self.adopt is not None and await self.adopt(stored):
                        continue
                    if await self.end(stored):
                        ended[Incarnation(stored.instance_id, stored.instance_epoch or 0)] += 1
                if len(batch) < ORPHAN_BATCH:
                    break
        finally:
            self._count(expired, broken, ended)
        return ended.total()

    def _count(
        self, expired: dict[Incarnation, float], broken: dict[Incarnation, int], ended: Counter[Incarnation]
    ) -> None:
        """Log each incarnation this scan expired (``replica`` ``expired``) and count the expiries, the jobs marked
        ``lost`` (also those of incarnations expired earlier) and the sessions marked ``broken``."""
        earlier = ended.total()  # jobs of incarnations expired by an earlier scan (or another replica)
        for incarnation, silent_s in expired.items():
            jobs = ended.get(incarnation, 0)
            earlier -= jobs
            logs.replica_expired(incarnation.instance_id, incarnation.epoch, silent_s, jobs, broken[incarnation])
            if self._metrics is not None:
                self._metrics.replica_expired(jobs, broken[incarnation])
        if self._metrics is not None and earlier:
            self._metrics.lease_expired_jobs.inc(earlier)

    async def break_sessions(self, incarnation: Incarnation) -> int:
        """Mark the open sessions of a dead incarnation ``broken`` (``SessionRecords.mark_broken``); how many this
        replica marked (a racing end by their owner wins)."""
        return len(await self._store.sessions.mark_broken(incarnation))

    async def end(self, stored: StoredJob) -> bool:
        """Mark one orphan ``lost`` (``replica_lost``) from its last progress save; whether this replica did.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        joined: dict[str, bytes] = {}

        async def replay(stream: str, inline: CappedStream, limit: int) -> int:
            data = await self._joined_chunks(stored.job_id, stream, limit)
            for offset in range(0, len(data), SLICE_BYTES):
                inline.write(data[offset : offset + SLICE_BYTES])
            joined[stream] = data
            return len(data)

        row = await lost_row(
            stored,
            Failure(
                ErrorType.REPLICA_LOST,
                f"replica {stored.instance_id} stopped renewing its lease while the job was {stored.status}; its "
                "output and calls are as of their last progress save",
            ),
            "the replica running the job was lost",
            replay,
            self._retention,
        )
        # The joined output first: a reader that finds the job ended finds its output too.
        await self._store.blobs.put(stored.job_id, {s: d for s, d in joined.items() if d})
        ended = await self._store.jobs.save_lost(row)
        await self._store.runs.forget(stored.job_id)  # a durable job's run spec and call log: nothing resumes it
        if not ended:
            return False  # another replica (or its owner) ended it first
        self._events.publish(JobLost(stored.job_id, stored.status))
        log.warning("job %s of replica %s was %s when its lease passed: marked lost", stored.job_id,
                    stored.instance_id, stored.status)  # fmt: skip
        return True

    async def _joined_chunks(self, job_id: str, stream: str, limit: int) -> bytes:
        """A stream's progress-saved chunks joined from offset 0 while they are contiguous, at most ``limit``."""
        starts = sorted(
            (start, size)
            for name, size in (await self._store.blobs.sizes(job_id)).items()
            if (start := chunk_start(stream, name)) is not None
        )
        parts: list[bytes] = []
        position = 0
        for start, size in starts:
            if start != position or position >= limit:
                break
            data = await self._store.blobs.read(job_id, chunk_name(stream, start)) or b""
            parts.append(data[: limit - position])
            position += len(parts[-1])
            if len(data) != size:
                break
        return b"".join(parts)
