"""Jobs: one script run, from request to final status, and the job service's facade (``JobManager``).

The package, by stage of one ``POST /execute``:

==============  ===================================================================================================
module          what it does
==============  ===================================================================================================
``model``       statuses, allowed transitions, ``FINAL``/``LIVE``, ``Failure``, the end-of-run rules (no imports)
``live``        a job held in memory (``LiveJob``), its resolved limits, the store's row of a view
``admission``   queue bounds, quotas, script slots; a request becomes a live job (``Intake``) or is refused
``runner``      the run path (save, sandbox, broker, supervise, end-of-run, final save, then tell)
``placement``   one-shot (pooled or cold sandbox, destroyed after) and in-session (the session's turn, kept)
``events``      lifecycle events (status changed, call ended, job ended...): metrics, logs and webhooks subscribe
``views``       views, slices, output ranges, pages and the events stream of live and ended jobs
``webhooks``    completion callbacks, with their own HTTP client
``recovery``    start-up sweep (work-dir lock, sandboxes left behind, lost jobs) and the retention purge
``sessions``    session requests (create, read, end) of the job service
``tasks``       background tasks, held and their failures logged
==============  ===================================================================================================

The parts are built by the app factory (``service.api.build_jobs``, called by ``create_app``), which also
subscribes metrics, logs and webhooks to ``events``. This module imports only ``model`` and ``service.errors`` at
run time, so that ``observability.logs`` and ``observability.metrics`` can import the model without importing the whole
service (and without an import cycle through ``service.tenancy`` or ``service.sessions.manager``, which import logs).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.errors import CallNotPending
from service.jobs.model import FINAL, LIVE, Failure, Job, JobStatus
from service.observability import stages
from service.views.render import FULL, Selection

if TYPE_CHECKING:
    from service.broker import Broker
    from service.jobs.admission import Intake
    from service.jobs.live import LiveJob
    from service.jobs.placement import Sandboxes
    from service.jobs.recovery import Recovery
    from service.jobs.runner import Runner
    from service.jobs.tasks import Tasks
    from service.jobs.webhooks import Webhooks
    from service.output import OutputRange
    from service.sandbox.backend import Stream
    from service.sandbox.folders import SandboxFolders
    from service.sandbox.pool import WarmPools
    from service.schemas import ExecuteRequest, JobSummary, McpServer, SessionRequest
    from service.sessions.manager import SessionManager
    from service.sessions.requests import SessionJobs
    from service.store import JobQuery
    from service.tenancy import Caller
    from service.toolkit.cache import CompiledManifest, ManifestCache
    from service.toolkit.validation import CheckScheduler
    from service.toolsets import Toolsets
    from service.views.read import JobViews
    from service.views.render import Body, EncodedView
    from service.views.resume import Position

__all__ = ["FINAL", "LIVE", "Failure", "Job", "JobManager", "JobParts", "JobStatus"]


@dataclass
class JobParts:
    """The parts of the job service and what they own (built by the app factory)."""

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
    pool: WarmPools
    folders: SandboxFolders
    manifests: ManifestCache
    checks: CheckScheduler
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)  # loops run after start


class JobManager:
    """The job service: every request about jobs, sessions and toolsets, each passed to the part that serves it.

    Args:
        parts: the parts, built by the app factory.
    """

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts
        self._intake = parts.intake
        self._runner = parts.runner
        self._views = parts.views
        self._toolsets = parts.toolsets
        self._sessions = parts.sessions

    # -- start-up, shutdown, retention ---------------------------------------------------------

    async def start(self) -> None:
        """Recover what an earlier run left, resume pending callbacks, start the purge, sessions and the pool.

        Raises:
            WorkDirBusy: another running instance holds the work dir.
        """
        parts = self._parts
        await parts.recovery.start()
        await parts.webhooks.resume()
        parts.tasks.spawn(parts.recovery.purge_loop(), "retention purge")
        await parts.session_manager.start()
        await parts.pool.start()
        for loop in parts.background:  # with a shared store: the reaper, progress saves (docs/scaling.md, step 5)
            parts.tasks.spawn(loop(), loop.__qualname__)

    async def close(self) -> None:
        """Stop every job still running (each removes its sandbox and is saved as lost) and background work."""
        parts = self._parts
        await parts.tasks.close()
        if parts.sandboxes.removals:
            await asyncio.gather(*parts.sandboxes.removals, return_exceptions=True)
        await parts.session_manager.close()
        await parts.pool.close()
        await parts.recovery.sweep("still there at shutdown")
        await asyncio.to_thread(parts.folders.close)
        await parts.webhooks.close()
        parts.checks.close()
        parts.manifests.close()
        parts.recovery.release()

    async def purge_expired(self) -> int:
        """Delete ended jobs older than the retention, with their output files; returns how many."""
        return await self._parts.recovery.purge_expired()

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

        Returns once the job's first save is done (or its run ended without one).
        """
        if request.session_id is not None:
            from service.tenancy import Caller

            await self._sessions.locate_open(request.session_id, Caller(owner, admin, internal))
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
        """
        await self._settle(job_id, caller, call_id, lambda broker: broker.paused.answer_client_call(call_id, ok, value))
        return await self._views.view(job_id, caller, selection=selection)

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
        """
        await self._settle(
            job_id,
            caller,
            call_id,
            lambda broker: broker.paused.decide_approval(call_id, approved, caller.owner, reason),
        )
        return await self._views.view(job_id, caller, selection=selection)

    async def _settle(self, job_id: str, caller: Caller, call_id: str, act: Callable[[Broker], None]) -> None:
        """Do ``act`` (an answer or a decision about ``call_id``) to a live job's broker, then let the job's task
        record it before its view is taken: wait for the job to change, at most 1 s.

        Raises:
            JobNotFound: no such job, or another owner's.
            CallNotPending: the job has ended, or ``act`` found no such call waiting (the broker's refusal).
        """
        job = self._views.live(job_id, caller)
        if job is None:
            await self._views.stored_view(job_id, caller)
            raise CallNotPending(call_id)
        if job.broker is None:
            raise CallNotPending(call_id)
        changed = job.changed()
        act(job.broker)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), 1.0)

    async def stop(self, job_id: str, caller: Caller, selection: Selection = FULL) -> Body:
        """Stop the job (SIGTERM to its processes, SIGKILL after the grace); returns its view.

        Idempotent: on an ended job it only returns the final view. The answer is the saved final view (the one
        ``GET`` and ``wait`` serve), whatever ended the job: the script may have exited by itself first. It waits
        for the grace and the SIGKILL's confirmation; only a sandbox slower than that gets the live view.
        Raises JobNotFound (another owner's too).
        """
        job = self._views.live(job_id, caller)
        if job is not None:
            await self._runner.stop(job)
        return await self._views.view(job_id, caller, selection=selection)

    # -- toolsets ------------------------------------------------------------------------------

    async def manifest(self, tools: list[dict[str, Any]], toolset: str | None, caller: Caller) -> CompiledManifest:
        """The compiled manifest of ``tools`` or the registered ``toolset`` (``Toolsets.manifest``)."""
        return await self._toolsets.manifest(tools, toolset, caller)

    async def register_toolset(
        self, tools: list[dict[str, Any]], servers: list[McpServer], owner: str
    ) -> CompiledManifest:
        """Check a manifest and keep it for ``owner`` (``Toolsets.register``)."""
        return await self._toolsets.register(tools, servers, owner)

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, request: SessionRequest, owner: str, *, admin: bool = False) -> dict[str, Any]:
        """Start a session's sandbox, owned by ``owner``, and return its view (``SessionJobs.create_session``)."""
        return await self._sessions.create_session(request, owner, admin=admin)

    async def session_view(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """A session's view; raises SessionNotFound (for another owner's session too), OwnerElsewhere."""
        return await self._sessions.session_view(session_id, caller)

    async def sessions(self, caller: Caller) -> list[dict[str, Any]]:
        """Views of the open sessions ``caller`` may access (the admin role: all; other replicas' from the
        store), oldest first."""
        return await self._sessions.sessions(caller)

    async def delete_session(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """End a session (idempotent); raises SessionNotFound (another owner's too)."""
        return await self._sessions.delete_session(session_id, caller)

    async def put_session_file(self, session_id: str, caller: Caller, path: str, data: bytes) -> dict[str, Any]:
        """Write a file under the session's /tmp (``SessionJobs.put_file``)."""
        return await self._sessions.put_file(session_id, caller, path, data)

    async def get_session_file(self, session_id: str, caller: Caller, path: str) -> OutputRange:
        """A file under the session's /tmp (``SessionJobs.get_file``)."""
        return await self._sessions.get_file(session_id, caller, path)

    async def list_session_files(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """What is under the session's /tmp (``SessionJobs.list_files``)."""
        return await self._sessions.list_files(session_id, caller)

    # -- reading and waiting (``JobViews``) ----------------------------------------------------

    async def output_file(self, job_id: str, caller: Caller, path: str) -> tuple[Path | OutputRange, dict[str, Any]]:
        """(host file, or its range in the shared store, entry) of an output file of the job
        (``JobViews.output_file``); raises JobNotFound, NoSuchFile."""
        return await self._views.output_file(job_id, caller, path)

    def live(self, job_id: str, caller: Caller) -> LiveJob | None:
        """The job if it has not been saved as ended yet; raises JobNotFound when it is another owner's."""
        return self._views.live(job_id, caller)

    async def stored_view(self, job_id: str, caller: Caller) -> bytes:
        """The saved view (JSON bytes) of a job that is not live; raises JobNotFound (another owner's too)."""
        return await self._views.stored_view(job_id, caller)

    async def final(self, job_id: str, caller: Caller) -> EncodedView:
        """The encoded view of a job that is not live; raises JobNotFound (another owner's too)."""
        return await self._views.final(job_id, caller)

    def live_view(self, job: LiveJob, selection: Selection = FULL) -> Body:
        """A live job's view, rendered a batch of records at a time as it is sent."""
        return self._views.live_view(job, selection)

    async def view(
        self,
        job_id: str,
        caller: Caller,
        offsets: dict[Stream, int | None] | None = None,
        selection: Selection = FULL,
    ) -> Body:
        """The job's view, with ``offsets`` a slice of a stream's retained bytes, ``selection`` its parts;
        raises JobNotFound."""
        return await self._views.view(job_id, caller, offsets, selection)

    async def ended_view(self, job_id: str, caller: Caller, selection: Selection = FULL) -> Body:
        """The saved view of a job that is not live, as ``selection`` says; raises JobNotFound."""
        return await self._views.view(job_id, caller, selection=selection)

    async def read_output(self, job_id: str, caller: Caller, stream: Stream, offset: int, length: int) -> bytes:
        """Raw retained bytes of a stream (at most ``SLICE_BYTES``); raises JobNotFound."""
        return await self._views.read_output(job_id, caller, stream, offset, length)

    async def output_range(self, job_id: str, caller: Caller, stream: Stream, offset: int, length: int) -> OutputRange:
        """The retained bytes of a stream from ``offset``, as an open ``OutputRange``; raises JobNotFound."""
        return await self._views.output_range(job_id, caller, stream, offset, length)

    async def wait(self, job_id: str, caller: Caller, timeout_s: float, selection: Selection = FULL) -> Body:
        """Block until the job ends, waits for the client, or ``timeout_s`` passes; returns its view then."""
        return await self._views.wait(job_id, caller, timeout_s, selection)

    async def page(self, query: JobQuery) -> tuple[list[JobSummary], str | None]:
        """A page of jobs (newest first) and the next cursor; raises InvalidCursor."""
        return await self._views.page(query)

    async def count(self) -> int:
        """Jobs in the store."""
        return await self._views.count()

    async def resume_point(self, job_id: str, caller: Caller, event_id: str, loc: tuple[str, ...]) -> Position:
        """Where a follower that last received event ``event_id`` resumes; raises JobNotFound, InvalidField."""
        return await self._views.resume_point(job_id, caller, event_id, loc)

    def events(
        self, job_id: str, caller: Caller, selection: Selection = FULL, start: Position | None = None
    ) -> AsyncIterator[tuple[str, Any, str]]:
        """Follow a job: ``(event, data, id)`` triples until it has ended (``JobViews.events``)."""
        return self._views.events(job_id, caller, selection, start)
