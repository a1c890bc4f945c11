"""Where a job's script runs: the two placements of the one run path (``service.jobs.runner``).

- ``OneShot``: a script slot, then a sandbox of the job's engine (``Engine.take``: for the container engine a
  sandbox of the warm pool, ``warm``, or a new one, ``cold``, room committed on the host first); destroyed once
  the job's final view is saved.
- ``InSession``: the session's turn, then a script slot, in the session's sandbox (``session``), which is kept
  for the session's next script; a sandbox found broken ends its session.

Both end a job that was stopped (or whose session ended) before it started, and set why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

from service.broker import Broker
from service.engines import Engine, Engines, Sandbox
from service.jobs.admission import Admission, Ticket
from service.jobs.live import LiveJob, now
from service.jobs.model import JobStatus, session_closed, stopped_before_start
from service.jobs.tasks import Tasks
from service.sessions.manager import Session, SessionManager
from service.slots import OwnerSlot

log = logging.getLogger(__name__)


class Acquirable(Protocol):
    """A script slot or a session's turn: ``asyncio.Lock`` or ``quotas.OwnerSlot``."""

    async def acquire(self) -> bool: ...

    def release(self) -> None: ...


async def acquire(job: LiveJob, slots: Acquirable) -> bool:
    """Wait for a script slot (or the session's turn); False (and nothing held) if the job was stopped first."""
    if job.stop_requested.is_set():
        return False
    take_now = getattr(slots, "take_now", None)  # ``OwnerSlot``: a free slot taken with no task made
    if take_now is not None and take_now():
        return True
    acquiring = asyncio.ensure_future(slots.acquire())
    stopped = asyncio.ensure_future(job.stop_requested.wait())
    try:
        await asyncio.wait({acquiring, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled, perhaps just as the slot was granted: a slot granted is given back
        stopped.cancel()
        if await _settled(acquiring):
            slots.release()
        raise
    stopped.cancel()
    got = await _settled(acquiring)
    if got and job.stop_requested.is_set():
        slots.release()
        return False
    return got


async def _settled(acquiring: asyncio.Future[bool]) -> bool:
    """Whether ``acquiring`` holds the slot, once it is done (cancelled first if it is still waiting)."""
    if not acquiring.done():
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquiring
    return not acquiring.cancelled() and acquiring.exception() is None


@dataclass
class Sandboxes:
    """What placements take sandboxes and slots from: the engines (``Engine.take``), the script slots and the
    sessions; ``removals`` the removals of one-shot sandboxes under way (awaited at shutdown)."""

    engines: Engines
    admission: Admission
    sessions: SessionManager
    removals: set[asyncio.Future[None]]


class Placement(Protocol):
    """Where one job runs; ``mode`` is its ``sandbox_start`` once ``enter`` gave a sandbox."""

    mode: str | None

    async def enter(self) -> Sandbox | None:
        """Wait for the job's turn and sandbox; None when it ended first (its status and error are set)."""
        ...

    async def ready(self) -> None:
        """Start the sandbox if it is not started yet (the job is ``running`` by then)."""
        ...

    def stubs(self, stubs: str | None) -> str | None:
        """The stubs to lay out (the engine's, ``Engine.stubs``), None when the sandbox holds these already."""
        ...

    async def leave(self, broker: Broker) -> None:
        """Give back the slot and turn (the script has ended, or never started). Never raises."""
        ...

    def dispose(self, status: str) -> None:
        """After the final save: remove a one-shot sandbox (in the background); keep a session's."""
        ...


class OneShot:
    """A sandbox of its own from the job's engine (pooled or cold for the container engine), destroyed after the
    job."""

    def __init__(self, sandboxes: Sandboxes, engine: Engine, job: LiveJob) -> None:
        self._sandboxes = sandboxes
        self._engine = engine
        self._job = job
        self._slot: OwnerSlot | None = None
        self._sandbox: Sandbox | None = None
        self.mode: str | None = None

    async def enter(self) -> Sandbox | None:
        """A script slot and a sandbox (``Engine.take``: started already, ``warm``, or not yet, ``cold``).

        When the engine has no room for it, the job gives its slot back and waits (still ``queued``) for room to
        be released (``Engine.room_released``), so that a job waiting for room never holds a slot a session's
        script would need to end. When ``take`` raises, the slot is given back before the error goes on (the run
        then ends the job ``failed``: ``live.end_by_failure``); the engine holds nothing for the job then.
        """
        job, engine = self._job, self._engine
        slot = self._sandboxes.admission.slot(job.owner)
        while await acquire(job, slot):
            try:
                sandbox = engine.take(job.id, job.owner, job.limits, job.image, job.hash_seed)
            except BaseException:
                slot.release()  # not ours yet (``leave`` gives back ``_slot`` only): else it is never given back
                raise
            if sandbox is not None:
                self._slot, self._sandbox = slot, sandbox
                self.mode = "warm" if sandbox.started else "cold"
                return sandbox
            slot.release()
            await engine.room_released(job.stop_requested)
        job.end(JobStatus.STOPPED, stopped_before_start(job.stop_reason))
        return None

    async def ready(self) -> None:
        if self._sandbox is not None and not self._sandbox.started:
            await self._sandbox.start()

    def stubs(self, stubs: str | None) -> str | None:
        return stubs

    async def leave(self, broker: Broker) -> None:
        if self._slot is not None:
            self._slot.release()
            self._slot = None

    def dispose(self, status: str) -> None:
        sandbox, removals = self._sandbox, self._sandboxes.removals
        if sandbox is None:
            return
        sandbox.stop_reason = status  # its removal never fails loudly; the start-up sweep catches what it misses
        removal = asyncio.ensure_future(sandbox.destroy())
        removals.add(removal)
        removal.add_done_callback(_removed)
        removal.add_done_callback(removals.discard)


def _removed(removal: asyncio.Future[None]) -> None:
    if not removal.cancelled() and removal.exception() is not None:
        log.error("removing a job's sandbox failed", exc_info=removal.exception())


class InSession:
    """The session's sandbox at the session's turn (one script at a time, in order of arrival)."""

    def __init__(self, session: Session, sandboxes: Sandboxes, ticket: Ticket, job: LiveJob, tasks: Tasks) -> None:
        self._session = session
        self._sandboxes = sandboxes
        self._ticket = ticket
        self._job = job
        self._tasks = tasks
        self._turn = False
        self._slot: OwnerSlot | None = None
        self.mode: str | None = "session"

    async def enter(self) -> Sandbox | None:
        job, session = self._job, self._session
        self._turn = await acquire(job, session.turn)
        self._ticket.leave_queue()
        if not self._turn:
            job.end(JobStatus.STOPPED, stopped_before_start())
            return None
        if session.ended:
            job.end(JobStatus.STOPPED, session_closed(session.status, before_turn=True))
            return None
        session.current_job_id = job.id  # busy from now on; a session that ends stops it
        slot = self._sandboxes.admission.slot(job.owner)
        if not await acquire(job, slot):
            job.end(JobStatus.STOPPED, stopped_before_start(job.stop_reason))
            return None
        self._slot = slot
        if session.ended:
            job.end(JobStatus.STOPPED, session_closed(session.status, before_turn=False))
            return None
        return session.sandbox

    async def ready(self) -> None:
        pass

    def stubs(self, stubs: str | None) -> str | None:
        laid_out = None if self._session.stub_source == stubs else stubs
        self._session.stub_source = stubs
        return laid_out

    async def leave(self, broker: Broker) -> None:
        session, job = self._session, self._job
        if self._slot is not None:
            self._slot.release()
            self._slot = None
        if not self._turn:
            return
        try:
            await broker.close()  # before the next script's broker listens on the same path
        except Exception:
            log.exception("job %s: closing its broker failed", job.id)
        if session.current_job_id == job.id:
            session.current_job_id = None
            session.executions += 1
        session.last_used_at = now()
        session.turn.release()
        self._turn = False
        if session.sandbox.broken is not None and not session.ended:
            end = self._sandboxes.sessions.end(session, "broken", session.sandbox.broken)
            self._tasks.spawn(end, f"end {session.id}")

    def dispose(self, status: str) -> None:
        pass
