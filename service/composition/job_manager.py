"""The job service as the fronts use it (``JobManager``): its parts (``JobParts``, built by ``assembly.build_jobs``)
started and closed in order, and what touches more than one part: submitting a job, the answers and decisions
about a paused call, stop. Reads, sessions and toolsets are the parts themselves (``views``, ``sessions``,
``toolsets``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from service.broker import Broker
from service.broker.paused import approval_decision, client_answer
from service.engines import Engines
from service.errors import CallNotPending, Draining, JobNotFound, QueueFull, QuotaExceeded
from service.jobs.admission import Intake, Ticket
from service.jobs.live import LiveJob, now
from service.jobs.parking import TIMEOUT_ANSWER, ParkedJob, ParkedJobs, store_answer
from service.jobs.placement import Sandboxes
from service.jobs.recovery import Recovery
from service.jobs.runner import Runner
from service.jobs.tasks import Tasks
from service.jobs.webhooks import Webhooks
from service.observability import stages
from service.sandbox.folders import SandboxFolders
from service.schemas.job_models import ExecuteRequest
from service.sessions.manager import SessionManager
from service.sessions.requests import SessionJobs
from service.store import JobStore, StoredJob
from service.tenancy import Caller
from service.toolkit.cache import ManifestCache
from service.toolkit.validation import CheckScheduler
from service.toolsets import Toolsets
from service.views.read import JobViews
from service.views.render import FULL, Body, Selection

log = logging.getLogger(__name__)

EXPIRY_RETRY_S = 5.0  # an expiry that could not resume its job (its key at its quota, the store failing): retried


@dataclass
class JobParts:
    """The parts of the job service and what they own (built by ``assembly.build_jobs``)."""

    intake: Intake
    runner: Runner
    views: JobViews
    toolsets: Toolsets
    sessions: SessionJobs
    recovery: Recovery
    webhooks: Webhooks
    tasks: Tasks
    sandboxes: Sandboxes
    session_manager: SessionManager
    engines: Engines
    folders: SandboxFolders
    manifests: ManifestCache
    checks: CheckScheduler
    parked: ParkedJobs
    store: JobStore
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)  # loops run after start


class JobManager:
    """The job service: its start and close in order, and what touches more than one part (submitting a job, the
    answers and decisions about a paused call, stop). Reads, sessions and toolsets are the parts themselves.

    Args:
        parts: the parts, built by ``assembly.build_jobs``.

    Attributes:
        views: reading jobs (``JobViews``): views, output, pages, ``wait``, the event stream.
        sessions: session requests (``SessionJobs``).
        toolsets: registered manifests (``Toolsets``).
        recovery: start-up recovery and the retention purge (``Recovery.purge_expired``).
        engines: the script engines (``engines.Engines``; ``GET /readyz`` asks them).
    """

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts
        self._intake = parts.intake
        self._runner = parts.runner
        self.views = parts.views
        self.sessions = parts.sessions
        self.toolsets = parts.toolsets
        self.recovery = parts.recovery
        self.engines = parts.engines
        self._parked = parts.parked
        self._store = parts.store
        self.draining: int | None = None  # set by ``drain``: the Retry-After (s) new jobs and sessions are refused with

    # -- start-up, shutdown, retention ---------------------------------------------------------

    async def start(self) -> None:
        """Recover what an earlier run left, resume pending callbacks, start the purge, sessions and the pool, then
        resume the durable jobs an earlier run left unfinished.

        Raises:
            WorkDirBusy: another running instance holds the work dir.
        """
        parts = self._parts
        await parts.recovery.start()
        await parts.webhooks.resume()
        parts.tasks.spawn(parts.recovery.purge_loop(), "retention purge")
        await parts.session_manager.start()
        await parts.engines.start()
        await parts.recovery.resume(parts.intake, parts.runner.start)  # durable jobs left unfinished, by replay
        parts.tasks.spawn(self._parked.expiry_loop(self._expire_parked), "parked calls' expiry")
        for loop in parts.background:  # with a shared store: the reaper, progress saves (docs/scaling.md, step 5)
            parts.tasks.spawn(loop(), loop.__qualname__)

    async def drain(self, within_s: float, retry_after_s: int) -> int:
        """Take no new job or session (``Draining``: 503 with ``Retry-After: retry_after_s``), then wait up to
        ``within_s`` seconds for the live jobs to end (on SIGTERM, before the server stops: ``close`` then parks the
        durable ones still running). Returns how many are still live."""
        self.draining = self.sessions.draining = retry_after_s
        live = self._intake.live
        deadline = asyncio.get_running_loop().time() + within_s
        while len(live) and (left := deadline - asyncio.get_running_loop().time()) > 0:
            waiting = [asyncio.ensure_future(live[job_id].done.wait()) for job_id in list(live)]
            try:
                await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiting:
                    waiter.cancel()
        return len(live)

    async def close(self) -> None:
        """Stop every job still running: each removes its sandbox and is saved lost, but a durable one-shot job is
        parked (left unfinished in the store for a resume by replay: ``durability.park``); then background work."""
        parts = self._parts
        live = self._intake.live
        for job_id in list(live):
            job = live[job_id]
            job.parking = job.durable and job.session_id is None and not job.ended
        await parts.tasks.close()
        if parts.sandboxes.removals:
            await asyncio.gather(*parts.sandboxes.removals, return_exceptions=True)
        await parts.session_manager.close()
        await parts.engines.close()
        await parts.recovery.sweep("still there at shutdown")
        await asyncio.to_thread(parts.folders.close)
        await parts.webhooks.close()
        parts.checks.close()
        parts.manifests.close()
        parts.recovery.release()

    # -- submission and the run ----------------------------------------------------------------

    async def submit(
        self, request: ExecuteRequest, owner: str, *, admin: bool = False, internal: bool = False
    ) -> LiveJob:
        """Check and admit ``request``, and start its job, owned by ``owner`` (the API key's name).

        Its ``session_id`` and ``toolset`` must be ``owner``'s own, unless ``admin`` (the admin role). A session
        open on another replica raises ``OwnerElsewhere`` (the request is relayed there), unless ``internal`` (a
        request relayed already: ``OwnerUnavailable``).

        Raises:
            ManifestError: a tool entry is unusable (names the entry and field).
            RequestLimitError: a limit exceeds its server maximum.
            InvalidField: an unknown toolset (another owner's included).
            SessionNotFound: an unknown session (another owner's included). SessionClosed: it ended.
            QueueFull: ``concurrency`` jobs run and ``max_queue`` wait already.
            QuotaExceeded: the owner is at one of its job quotas (``Quotas.admit_job``).
            Draining: the service is shutting down (``drain``).

        Returns once the job's first save is done (or its run ended without one).
        """
        if self.draining is not None:
            raise Draining(self.draining)
        if request.session_id is not None:
            await self.sessions.locate_open(request.session_id, Caller(owner, admin, internal))
        admitted = await self._intake.admit(request, owner, admin)
        stages.mark("admitted")
        job = admitted.job
        self._runner.start(admitted).add_done_callback(lambda _: job.stored.set())
        await job.stored.wait()  # saved before it is answered: any replica finds the job its id names
        return job

    async def answer_call(
        self, job_id: str, caller: Caller, call_id: str, ok: bool, value: Any, selection: Selection = FULL
    ) -> Body:
        """Answer a client-executed call of a running job; returns the job's view after it.

        Raises:
            JobNotFound: no such job, or another owner's (only the job's owner answers its calls).
            CallNotPending: the job has ended, or that call is not waiting for an answer.
            QueueFull, QuotaExceeded, PayloadTooLarge: a parked job's answer refused for now (``_settle``).
        """
        answer = client_answer(ok, value)

        def act(broker: Broker) -> bool:
            return broker.paused.answer_client_call(call_id, ok, value)

        await self._settle(job_id, caller, call_id, ("client", answer), act)
        return await self.views.view(job_id, caller, selection=selection)

    async def decide_approval(
        self,
        job_id: str,
        caller: Caller,
        call_id: str,
        approved: bool,
        reason: str | None,
        selection: Selection = FULL,
    ) -> Body:
        """Approve (the call goes on to its endpoint) or deny a call awaiting approval; returns the job's view.
        The record's ``approval.by`` is the caller's key name.

        Raises:
            JobNotFound: no such job, or another owner's (only the job's owner, or the admin role, decides).
            CallNotPending: the job has ended, or that call does not await approval (decided, timed out, unknown).
            QueueFull, QuotaExceeded: a parked job's decision refused for now (``_settle``).
        """
        decision = approval_decision(approved, caller.owner, reason)
        answer = {"kind": "approval", "approval": {**decision, "at": decision["at"].isoformat()}}
        await self._settle(
            job_id,
            caller,
            call_id,
            ("approval", answer),
            lambda broker: broker.paused.decide_approval(call_id, approved, caller.owner, reason),
        )
        return await self.views.view(job_id, caller, selection=selection)

    async def _settle(
        self,
        job_id: str,
        caller: Caller,
        call_id: str,
        parked_answer: tuple[str, dict[str, Any]],
        act: Callable[[Broker], bool],
    ) -> None:
        """Do ``act`` (an answer or a decision about ``call_id``) to a live job's broker, then let the job's task
        record it before its view is taken: wait for the job to change, at most 1 s. A parked job gets the same
        answer (``parked_answer``: what the call awaits, and the answer) stored instead, and is resumed by replay
        (``_answer_parked``); so does a resumed job's call its replay has not made again yet (``act`` says so: the
        answer is kept for it, and stored, so that a crash meanwhile does not lose it).

        Raises:
            JobNotFound: no such job, or another owner's.
            CallNotPending: the job has ended, or ``act`` found no such call waiting (the broker's refusal).
            QueueFull, QuotaExceeded: a parked job could not be admitted again now (``_answer_parked``).
            PayloadTooLarge: the answers kept for calls a resumed job has not made again would pass their bound.
        """
        job = self.views.live(job_id, caller)
        if job is not None and job.parking:  # being parked: answered as a parked job once it is
            await job.done.wait()
            job = self.views.live(job_id, caller)
        if job is None:
            parked = self._parked.get(job_id)
            if parked is not None:
                if not caller.may_access(parked.owner):
                    raise JobNotFound(job_id)
                if await self._answer_parked(parked, call_id, *parked_answer):
                    return
                job = self.views.live(job_id, caller)  # resumed meanwhile: answered live
        if job is None:
            await self.views.stored_view(job_id, caller)
            raise CallNotPending(call_id)
        if job.broker is None:
            raise CallNotPending(call_id)
        changed = job.changed()
        if act(job.broker) and job.durable:  # kept for a call its replay has not made again: in its log too
            await store_answer(self._store, job_id, call_id, parked_answer[1])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), 1.0)

    async def _answer_parked(self, parked: ParkedJob, call_id: str, awaiting: str, answer: dict[str, Any]) -> bool:
        """Store ``answer`` to the call ``call_id`` (awaiting ``awaiting``) of a parked job and resume the job by
        replay (``Recovery.resume_job``, reason ``answered``); False if it is parked here no more (resumed
        meanwhile: answer it live; taken over by another replica, or ended: its stored view says).

        Raises:
            CallNotPending: the job waits for no such call (unknown, answered, or awaiting the other kind of answer).
            QueueFull, QuotaExceeded: the job could not be admitted again now (``Admission.take_resume``);
                nothing is stored.
        """
        async with parked.lock:
            if self._parked.get(parked.job_id) is not parked:
                return False
            waits = parked.calls.get(call_id)
            if waits is None or waits[0] != awaiting:
                raise CallNotPending(call_id)
            ticket = self._parts.sandboxes.admission.take_resume(parked.owner)  # else 429 (the harness retries)
            try:
                stored = await self._claim(parked)
                if stored is None:
                    ticket.release()
                    return False
                if not await store_answer(self._store, parked.job_id, call_id, answer):
                    raise CallNotPending(call_id)
                await self._resume_parked(parked, stored, "answered", ticket)  # failing, it stays parked
            except BaseException:  # its answer may be stored: a new one replaces it, an expiry does not
                ticket.release()
                raise
        return True

    async def _expire_parked(self, parked: ParkedJob, call_id: str) -> None:
        """A call a parked job waits for has reached its ``expires_at``: store its timeout and resume the job
        (reason ``expired``) so that its script sees it, counted as an answer's resume is (``take_resume``). Never
        raises: a job whose key is at its quota, or whose store failed (logged), is tried again ``EXPIRY_RETRY_S``
        later."""
        async with parked.lock:
            if self._parked.get(parked.job_id) is not parked or call_id not in parked.calls:
                return
            try:  # counted as an answer's resume is: one key's expiries cannot crowd out the others' jobs
                ticket = self._parts.sandboxes.admission.take_resume(parked.owner)
            except (QueueFull, QuotaExceeded):
                self._retry_expiry(parked, call_id)
                return
            try:
                stored = await self._claim(parked)
                if stored is None:
                    ticket.release()
                    return
                # not over an answer stored already (its resume failed): the script gets the answer
                await store_answer(self._store, parked.job_id, call_id, TIMEOUT_ANSWER, over=False)
                await self._resume_parked(parked, stored, "expired", ticket)
            except Exception:
                ticket.release()
                log.exception("job %s: its parked call %s expired; it could not be resumed", parked.job_id, call_id)
                self._retry_expiry(parked, call_id)

    def _retry_expiry(self, parked: ParkedJob, call_id: str) -> None:
        """Hold a parked job whose expiry could not resume it again, that expiry ``EXPIRY_RETRY_S`` later."""
        self._parked.take(parked.job_id)
        parked.calls[call_id] = (parked.calls[call_id][0], now() + timedelta(seconds=EXPIRY_RETRY_S))
        self._parked.add(parked)

    async def _claim(self, parked: ParkedJob) -> StoredJob | None:
        """The stored row of a job parked here, read now, if it is still this replica's to act on
        (``Recovery.holds``); else None, and it leaves the parked jobs (it ended, or another replica took it over:
        a request about it goes there). Raises what the store raises."""
        stored = await self._store.jobs.get(parked.job_id)
        if stored is not None and self.recovery.holds(stored):
            return stored
        self._parked.take(parked.job_id)
        return None

    async def _resume_parked(self, parked: ParkedJob, stored: StoredJob, reason: str, ticket: Ticket) -> None:
        """Resume a parked job (``stored``: its row, ``_claim``'s) by replay, with the calls it still waits for
        (``Recovery.resume_job``; ``ticket``: its admission, taken already, given back if it is not resumed). It
        leaves the parked jobs once it is live (an answer or a stop meanwhile waits for ``parked.lock``, then finds
        it live), or once it could not be resumed (then it is marked lost, or another replica took it). Raises what
        the store raises: then it stays parked."""
        spec = await self.recovery.spec_of(stored)
        if spec is None:
            ticket.release()
            await self.recovery.mark_lost(stored, "its run spec cannot be read")
        else:
            await self.recovery.resume_job(spec, reason, self._intake, self._runner.start, parked, ticket)
        self._parked.take(parked.job_id)

    async def adopt_orphan(self, stored: StoredJob) -> bool:
        """Take over a durable job a dead replica left (the reaper's ``adopt``): resumed here by replay (reason
        ``replica_lost``), or, parked waiting for the harness there, held parked here. Returns True when it was taken
        over, by this replica or another first; False for a job that is not durable (the reaper marks it lost).
        Raises what the store raises."""
        spec = await self.recovery.spec_of(stored)
        if spec is None:
            return False
        if spec.waits is None:
            await self.recovery.resume_job(spec, "replica_lost", self._intake, self._runner.start)
        elif (answered := await self.recovery.hold_parked(spec)) is not None:
            try:
                await self.recovery.resume_job(answered, "answered", self._intake, self._runner.start, spec.waits)
            except Exception:
                self.recovery.failed_resume(answered)
        elif self._parked.get(stored.job_id) is not None:
            log.warning("job %s, parked on replica %s, which died: parked here", stored.job_id, stored.instance_id)
        return True

    async def stop(self, job_id: str, caller: Caller, selection: Selection = FULL) -> Body:
        """Stop the job (SIGTERM to its processes, SIGKILL after the grace); returns its view.

        Idempotent: on an ended job it only returns the final view. The answer is the saved final view (the one
        ``GET`` and ``wait`` serve), whatever ended the job: the script may have exited by itself first. It waits
        for the grace and the SIGKILL's confirmation; only a sandbox slower than that gets the live view.
        Raises JobNotFound (another owner's too).
        """
        job = self.views.live(job_id, caller)
        if job is not None and job.parking:  # being parked: stopped as a parked job once it is
            await job.done.wait()
            job = self.views.live(job_id, caller)
        parked = self._parked.get(job_id) if job is None else None
        if parked is not None and caller.may_access(parked.owner):  # ended from its saved view, not run again
            async with parked.lock:
                if self._parked.get(job_id) is parked and (stored := await self._claim(parked)) is not None:
                    await self.recovery.stop_parked(stored)  # failing, it stays parked
                    self._parked.take(job_id)
            job = self.views.live(job_id, caller)  # resumed by an answer first: stopped as a live job
        if job is not None:
            await self._runner.stop(job)
        return await self.views.view(job_id, caller, selection=selection)
