"""Progress saves: with a shared (PostgreSQL) store, what a running job produced is saved while it runs, so that a
job whose replica dies is marked ``lost`` with its output and call records as of its last save, not as of its
start (docs/scaling.md, step 5; ``PTC_PROGRESS_SAVE_S``).

Every ``PTC_PROGRESS_SAVE_S`` each ``running`` or ``waiting`` job of this replica that wrote output or changed a
call record since its last progress save gets:

1. its new retained output bytes appended to the store as **chunks**: ``job_blobs`` rows named
   ``<stream>@<start>`` (``chunk_name``: the stream, then the byte offset of the chunk's first byte, 16 digits so
   that names sort by offset), at most ``SLICE_BYTES`` each, read from the retained file off the event loop;
2. then its view saved (``Runner.save``, fenced: a replica whose lease was lost writes no view; ``LeaseLost``
   ends the saver).

The chunks go with their job (``JobRecords.purge`` deletes every blob of a purged job). A job that ends normally
keeps them beside its ``stdout``/``stderr`` blobs until purged; a job marked lost has them joined into those
blobs by the reaper (``service.replicas.reaper``), so every replica serves its output as any ended job's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from service.errors import LeaseLost, StoreUnavailable
from service.jobs.live import SLICE_BYTES, STREAMS, LiveJob, LiveJobs
from service.jobs.model import JobStatus
from service.output import read_range
from service.store import JobStore

log = logging.getLogger(__name__)

SAVED_WHILE = (JobStatus.RUNNING, JobStatus.WAITING)
"""The statuses in which a job's progress is saved (queued jobs have none; ended ones have their final save)."""


def chunk_name(stream: str, start: int) -> str:
    """The blob name of a stream's chunk starting at byte ``start``: ``stdout@0000000000000000``."""
    return f"{stream}@{start:016d}"


def chunk_start(stream: str, name: str) -> int | None:
    """The start offset of ``name`` if it is one of ``stream``'s chunks, else None."""
    prefix = f"{stream}@"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])


@dataclass
class _Saved:
    """What the last progress save of one job held."""

    retained: dict[str, int]  # retained bytes per stream already in chunks
    mark: tuple[int, ...] = ()  # output totals and call records' state at that save


def _mark(job: LiveJob) -> tuple[int, ...]:
    """A job's progress as numbers that only grow: bytes written per stream, calls, calls that ended."""
    ended = sum(1 for call in job.calls if call.get("status") != "pending")
    return (job.stdout.inline.total_bytes, job.stderr.inline.total_bytes, len(job.calls), ended)


class ProgressSaver:
    """Saves this replica's running jobs' progress every ``interval_s`` (see the module's docstring).

    Args:
        store: the shared job store (the chunks' ``put_blobs``).
        live: this replica's live jobs (job id -> job).
        save: the fenced save of a job's view (``Runner.save``).
        interval_s: ``PTC_PROGRESS_SAVE_S`` (s).
    """

    def __init__(
        self,
        store: JobStore,
        live: LiveJobs,
        save: Callable[[LiveJob], Awaitable[None]],
        interval_s: float,
    ) -> None:
        self._store = store
        self._live = live
        self._save = save
        self._interval_s = interval_s
        self._saved: dict[str, _Saved] = {}

    async def loop(self) -> None:
        """Save progress every ``interval_s`` until this replica is fenced (``LeaseLost``) or the task is cancelled;
        a store that does not answer is logged and tried again at the next interval."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.save_all()
            except LeaseLost:
                return
            except StoreUnavailable as exc:
                log.warning("progress saves skipped: %s", exc)
            except Exception:
                log.exception("progress saves failed")

    async def save_all(self) -> int:
        """One round: save every running job with new progress; returns how many were saved.

        Raises:
            LeaseLost: a fenced save matched no row (this replica is fenced).
            StoreUnavailable: the store did not answer.
        """
        saved = 0
        for job_id in [j for j in self._saved if j not in self._live]:
            del self._saved[job_id]  # ended: its final save holds everything
        for job in list(self._live.values()):
            if job.status in SAVED_WHILE and job.stored.is_set() and await self.save_one(job):
                saved += 1
        return saved

    async def save_one(self, job: LiveJob) -> bool:
        """Append the job's new retained output as chunks, then save its view, when it has new progress; returns
        whether it was saved (not when it had none, or ended meanwhile).

        Raises:
            LeaseLost: the view's save matched no row.
            StoreUnavailable: the store did not answer (the chunks written stay: a later save continues after them).
        """
        saved = self._saved.setdefault(job.id, _Saved(dict.fromkeys(STREAMS, 0)))
        mark = _mark(job)
        if mark == saved.mark:
            return False
        for stream in STREAMS:
            output = job.stdout if stream == "stdout" else job.stderr
            while saved.retained[stream] < output.retained_bytes:
                start = saved.retained[stream]
                most = min(SLICE_BYTES, output.retained_bytes - start)
                data = await asyncio.to_thread(read_range, output.path, start, most)
                if not data:
                    break  # the file is gone (the job ended and was purged meanwhile)
                await self._store.blobs.put(job.id, {chunk_name(stream, start): data})
                saved.retained[stream] = start + len(data)
        if job.status not in SAVED_WHILE:  # it ended meanwhile: its final save follows (a running view must not)
            return False
        await self._save(job)  # from here on no await before the view is taken: it is a running job's view
        saved.mark = mark
        return True
