"""A live job's status saves while its calls wait for the harness (``StatusSaves``): ``waiting`` while some call
waits for a client or an approval, ``running`` again when none does, the flips of a busy job riding on one save."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from service.jobs.live import LiveJob
from service.jobs.model import JobStatus
from service.jobs.tasks import Tasks

STATUS_SAVE_INTERVAL_S = 0.5  # least time between two saves of a live job's status (running / waiting flips)


class StatusSaves:
    """Moves a live job between ``running`` and ``waiting`` and saves the change.

    Args:
        tasks: where the saves run (background tasks).
        save_and_tell: saves a job's status and tells subscribers (``Runner._save_and_tell``).
    """

    def __init__(self, tasks: Tasks, save_and_tell: Callable[[LiveJob], Awaitable[None]]) -> None:
        self._tasks = tasks
        self._save_and_tell = save_and_tell

    def calls_changed(self, job: LiveJob, waiting: int) -> None:
        """``waiting`` while calls wait for the harness (client-executed ones, or approvals), ``running`` again when
        none does (not once it is being parked: its calls still wait, for the harness now)."""
        if job.parking:
            return
        if waiting and job.status == JobStatus.RUNNING:
            job.move(JobStatus.WAITING)
            job.waiting.set()
        elif not waiting and job.status == JobStatus.WAITING:
            job.move(JobStatus.RUNNING)
            job.waiting.clear()
        else:
            job.notify()
            return
        job.notify()
        if not job.status_save_queued:  # else the save already queued takes this status with it
            job.status_save_queued = True
            self._tasks.spawn(self._save(job), f"save {job.id}")

    async def _save(self, job: LiveJob) -> None:
        """Save a live job's status once the saves begun before it have reached the store, with the view as it is
        then: the status changes of that time ride on this one save (a script whose calls wait a millisecond each
        flips ``running``/``waiting`` thousands of times; a save per flip wrote gigabytes for one job). Nothing to
        do once the job has ended: its final save follows. Saves of one job's status are ``STATUS_SAVE_INTERVAL_S``
        apart at least (its live view is never late; its status in the store, which ``GET /jobs?status=`` filters
        by, is at most that late)."""
        async with job.saving:
            pass
        delay = job.status_saved_at + STATUS_SAVE_INTERVAL_S - job.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        job.status_save_queued = False
        if not job.ended:
            job.status_saved_at = job.loop.time()
            await self._save_and_tell(job)
