"""Admission: a request becomes a job, or is refused, before anything waits.

Bounds: at most ``concurrency`` running plus ``max_queue`` queued one-shot jobs, else ``QueueFull``; in a
session at most ``max_queue`` scripts waiting for its turn (and ``max_queue`` over all sessions); then the
owner's quotas (``service.quotas``, else ``QuotaExceeded``). Each admitted job holds a ``Ticket``: its place in
these counts, given back exactly once, whatever ends the job (even a run task cancelled before it began), so
the counts cannot leak. Script slots (one-shot jobs and session scripts share them) come from ``slot``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from service.broker.durable import Logged
from service.callbacks import CallbackPolicy
from service.egress import EgressDenied
from service.engines import PYTHON, Engine, Engines
from service.errors import EngineUnavailable, InvalidField, QueueFull, SessionNotFound
from service.jobs.durability import RunSpec
from service.jobs.live import SANDBOX_LIMITS, LiveJob, LiveJobs, ResolvedLimits, resolve_limits
from service.jobs.marks import mark_owner
from service.normalize import Normalized, count, prepare
from service.output import OutputLog
from service.quotas import Quotas
from service.sandbox.images import image_name
from service.schemas.job_models import ExecuteRequest
from service.sessions.manager import Session, SessionManager
from service.settings import DEFAULT_IMAGE, Settings
from service.slots import OwnerSlot, Slots
from service.tenancy import Caller
from service.toolkit.cache import CompiledManifest
from service.toolsets import Toolsets


def _discard(made: asyncio.Future[tuple[Normalized, OutputLog, OutputLog]], output_dir: Path) -> None:
    """The output files of a job that was never made (its admission was cancelled): closed, their folder removed
    on a worker thread."""
    if not made.cancelled() and made.exception() is None:
        for log in made.result()[1:]:
            log.close()
    asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, output_dir, True)


def find_session(sessions: SessionManager, session_id: str, caller: Caller) -> Session:
    """A live or recently ended session ``caller`` may access; raises SessionNotFound (another owner's too)."""
    session = sessions.get(session_id)
    if not caller.may_access(session.owner):
        raise SessionNotFound(session_id)
    return session


class Queue(Protocol):
    """What holds a count of scripts waiting for their turn (``sessions.Session``)."""

    queued: int


class Ticket:
    """An admitted job's place in the counts: the one-shot bound or its session's queue, and its owner's quota.

    ``leave_queue`` when a session script gets (or gives up waiting for) its turn; ``release`` when the job has
    ended. Both are idempotent, so a path that calls them twice (or a task's done callback after the run's own
    cleanup) never gives back more than was taken.
    """

    def __init__(self, admission: Admission, owner: str, queue: Queue | None) -> None:
        self._admission = admission
        self.owner = owner
        self._queue = queue
        self._queued = queue is not None
        self.released = False

    def leave_queue(self) -> None:
        """The session script left its session's queue (idempotent; nothing for a one-shot job)."""
        if self._queued and self._queue is not None:
            self._queued = False
            self._queue.queued -= 1

    def release(self) -> None:
        """The job ended (or was never started): give back all it counted (idempotent)."""
        if self.released:
            return
        self.released = True
        self.leave_queue()
        if self._queue is None:
            self._admission.admitted -= 1
        self._admission.quotas.job_ended(self.owner)


class Admission:
    """Queue bounds, quotas and script slots.

    Args:
        settings: ``concurrency()``, ``max_queue`` and ``retry_after_s``.
        quotas: per-owner quotas.
        slots: the script slots of the host.
        sessions_queued: scripts waiting for their turn in all sessions (``SessionManager.queued``).
    """

    def __init__(self, settings: Settings, quotas: Quotas, slots: Slots, sessions_queued: Callable[[], int]) -> None:
        self._settings = settings
        self.quotas = quotas
        self._slots = slots
        self._sessions_queued = sessions_queued
        self.admitted = 0  # one-shot jobs queued or running

    def one_shot(self, owner: str) -> Ticket:
        """Count a one-shot job of ``owner``; raises QueueFull or QuotaExceeded (then nothing is counted)."""
        if self.admitted >= self._settings.concurrency() + self._settings.max_queue:
            raise QueueFull(self._settings.retry_after_s)
        self.quotas.admit_job(owner)
        self.admitted += 1  # counted before any await, so admission is exact under concurrency
        return Ticket(self, owner, None)

    def take_resume(self, owner: str) -> Ticket:
        """Count a parked job of ``owner`` resumed by its harness's answer, as a new job would be (``jobs_per_minute``
        aside); raises QueueFull or QuotaExceeded (nothing counted: the answer is refused, the harness retries)."""
        if self.admitted >= self._settings.concurrency() + self._settings.max_queue:
            raise QueueFull(self._settings.retry_after_s)
        self.quotas.room_for_job(owner)
        return self.resumed(owner)

    def resumed(self, owner: str) -> Ticket:
        """Count a durable job resumed by replay as running again; never refused (it was admitted once)."""
        self.quotas.count_job(owner)
        self.admitted += 1
        return Ticket(self, owner, None)

    def in_session(self, queue: Queue, owner: str) -> Ticket:
        """Count a script of ``owner`` queued for its session's turn; raises QueueFull or QuotaExceeded."""
        max_queue = self._settings.max_queue
        if queue.queued >= max_queue or self._sessions_queued() >= max_queue:
            raise QueueFull(self._settings.retry_after_s)  # PTC_MAX_QUEUE per session, and for all sessions
        self.quotas.admit_job(owner)
        queue.queued += 1  # counted before any await, so the session's queue bound is exact
        return Ticket(self, owner, queue)

    def slot(self, owner: str) -> OwnerSlot:
        """The script slot a job of ``owner`` takes while it runs (its ``running_jobs`` quota applies)."""
        return self._slots.of(owner, self.quotas.of(owner).running_jobs)


@dataclass
class Admitted:
    """A job admitted and live: run it with its ``manifest``; ``session`` None for a one-shot job."""

    job: LiveJob
    request: ExecuteRequest
    manifest: CompiledManifest
    ticket: Ticket
    session: Session | None
    replay: list[Logged] = field(default_factory=list)  # a resumed job's call log (``service.broker.durable``)
    resumed: bool = False  # its spec is stored already
    admin: bool = False  # its owner had the admin role (a resume resolves its toolset as then)
    carried: Mapping[str, tuple[str, datetime]] = field(default_factory=dict)  # a parked job's unanswered calls


class Intake:
    """Checks a request, admits it and makes its job (``JobManager.submit`` before the run).

    Args:
        settings: limits and retention; ``work_dir``, under whose ``output`` each job's output folder is made.
        admission: bounds and quotas.
        toolsets: compiles the job's manifest.
        sessions: finds the session a script is for.
        callback_policy: what a ``callback_url`` needs: a callback secret for its owner, and to pass the egress
            rules.
        live: the live jobs (job id -> job): a new job joins it.
        engines: the script engines: a job's is chosen here (``Engines.choose``; a session's script: its
            session's), and a one-shot job's image must be usable by it (``Engine.require_image``); None: the
            default engine's name, images not checked.
    """

    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        toolsets: Toolsets,
        sessions: SessionManager,
        callback_policy: CallbackPolicy,
        live: LiveJobs,
        engines: Engines | None = None,
    ) -> None:
        self._engines = engines
        self._settings = settings
        self._admission = admission
        self._toolsets = toolsets
        self._sessions = sessions
        self._egress = callback_policy.egress
        self._secrets = callback_policy.secrets
        self._output_dir = settings.work_dir / "output"
        self.live = live

    async def admit(self, request: ExecuteRequest, owner: str, admin: bool) -> Admitted:
        """Check and admit ``request`` of ``owner`` (``admin``: the admin role) and make its job (live from now on).

        Raises:
            ManifestError: a tool entry is unusable (names the entry and field).
            RequestLimitError: a limit exceeds its server maximum.
            InvalidField: an unknown toolset (another owner's included), a callback that cannot be sent.
            SessionNotFound: an unknown session (another owner's included).
            QueueFull / QuotaExceeded: see ``Admission``.
            UnknownImage: an image name ``PTC_IMAGES`` does not offer; InvalidField: with ``session_id``, an
                image other than the session's.
            ImageUnusable (a SandboxError, 503): a one-shot job's image is not present or cannot run scripts.
        """
        caller = Caller(owner, admin)
        image = self._image(request, caller)
        key = self._settings.key_limits.get(owner)
        limits = resolve_limits(request.model_copy(update={"image": image}), self._settings, key)
        if request.callback_url and self._secrets.for_owner(owner) is None:
            raise InvalidField(
                "callback_url needs the server setting PTC_CALLBACK_SECRET, or a PTC_CALLBACK_SECRETS entry for "
                "this key (callbacks are always signed)",
                ("body", "callback_url"),
            )
        if request.callback_url:
            try:
                self._egress.target(request.callback_url)
            except EgressDenied as exc:
                raise InvalidField(str(exc), ("body", "callback_url")) from exc
        if request.session_id is not None:
            if request.durable:
                raise InvalidField(
                    "a session's scripts are not durable: they run in the session's sandbox, kept between them",
                    ("body", "durable"),
                )
            return await self._admit_to_session(request, limits, caller, request.session_id)
        engine = self._engines.choose(request.language) if self._engines is not None else None
        if engine is not None and (image != DEFAULT_IMAGE or request.language not in (None, engine.language)):
            with contextlib.suppress(EngineUnavailable):  # the job's start reports it, as any job's does
                await engine.require_image(image, request.language or engine.language)  # a 503 naming the image
        ticket = self._admission.one_shot(caller.owner)
        try:
            tools, toolset = request.tools, request.toolset
            job, manifest = await self._new_job(limits, request, tools, toolset, caller, engine, None, request.language)
        except BaseException:
            ticket.release()
            raise
        job.image = image
        job.durable = request.durable is not False
        return Admitted(job, request, manifest, ticket, None, admin=admin)

    async def readmit(
        self,
        spec: RunSpec,
        replay: list[Logged],
        resume: dict[str, Any],
        parked: tuple[Mapping[str, tuple[str, datetime]], float] | None = None,
        ticket: Ticket | None = None,
    ) -> Admitted:
        """A durable one-shot job left unfinished (by an earlier run of the service, or parked), admitted again from
        its run spec to be resumed by replaying ``replay`` (its call log); ``resume`` is the view's entry for it;
        ``parked``: a job parked while it waited for the harness: the calls it still waits for (``PausedCalls``'
        ``carried``) and the seconds its runs took. Counted as a running job again (``ticket``, taken already), or
        else never refused for its owner's quotas or the queue's bound (``Admission.resumed``: it was admitted once).

        Raises:
            ManifestError, InvalidField, UnknownImage, RequestLimitError: as ``admit`` (the job cannot be resumed:
            it is marked lost instead).
        """
        caller, request = Caller(spec.owner, spec.admin), spec.request
        key = self._settings.key_limits.get(spec.owner)
        limits = resolve_limits(request.model_copy(update={"image": spec.image}), self._settings, key)
        engine = self._engines[spec.engine] if self._engines is not None else None
        ticket = ticket or self._admission.resumed(caller.owner)
        try:
            job, manifest = await self._new_job(
                limits, request, request.tools, request.toolset, caller, engine, spec.job_id, request.language
            )
        except BaseException:
            ticket.release()
            raise
        job.image, job.durable, job.hash_seed, job.created_at = spec.image, True, spec.hash_seed, spec.created_at
        job.resumes = [*spec.resumes, resume]
        carried, job.active_s = parked if parked is not None else ({}, spec.active_s)
        return Admitted(job, request, manifest, ticket, None, replay, True, spec.admin, carried)

    def _image(self, request: ExecuteRequest, caller: Caller) -> str:
        """The image name of ``request``'s job: with ``session_id``, the session's (``image`` must be absent or
        equal to it); else ``image``, or its language's default (``image_name``).

        Raises:
            SessionNotFound: an unknown session, or another owner's (before its image is compared).
            InvalidField: ``image`` or ``language`` is not the session's; no image offered runs ``language``.
            UnknownImage: ``image`` is not a name in ``PTC_IMAGES``.
        """
        if request.session_id is None:
            return image_name(self._settings, request.image, request.language)
        session = find_session(self._sessions, request.session_id, caller)
        return session.script_image(request.image, request.language)

    async def _admit_to_session(
        self, request: ExecuteRequest, limits: ResolvedLimits, caller: Caller, session_id: str
    ) -> Admitted:
        """Queue ``request`` for its session's turn (one script at a time per session, in order of arrival)."""
        find_session(self._sessions, session_id, caller)  # another owner's session is not found
        session = self._sessions.usable(session_id)
        for name in SANDBOX_LIMITS:
            asked = getattr(request.limits, name)
            if asked is not None and asked != session.limits[name]:
                raise InvalidField(
                    f"a session's scripts share its sandbox: {name} is {session.limits[name]} for this session",
                    ("body", "limits", name),
                )
        sandbox_limits = {name: session.limits[name] for name in SANDBOX_LIMITS}
        if request.limits.output_bytes is None:
            sandbox_limits["output_bytes"] = session.limits["output_bytes"]
        limits = replace(limits, **sandbox_limits)  # the job's view and messages give its session's limits
        own_tools = bool(request.tools or request.toolset)
        job_caller = caller if own_tools else Caller(session.owner)  # the session's toolset is its owner's
        ticket = self._admission.in_session(session, job_caller.owner)  # counts against the job's owner
        try:
            job, manifest = await self._new_job(
                limits,
                request,
                request.tools if own_tools else session.tools,
                request.toolset if own_tools else session.toolset,
                job_caller,
                self._engines[session.engine] if self._engines is not None else None,
                language=session.language,
            )
        except BaseException:
            ticket.release()
            raise
        job.session_id = session.id
        job.image = session.image
        return Admitted(job, request, manifest, ticket, session)

    async def _new_job(
        self,
        limits: ResolvedLimits,
        request: ExecuteRequest,
        tools: list[dict[str, Any]],
        toolset: str | None,
        caller: Caller,
        engine: Engine | None,
        resumed: str | None = None,
        language: str | None = None,
    ) -> tuple[LiveJob, CompiledManifest]:
        """A job for an admitted ``request`` (live from now on) and its compiled manifest (``tools`` or ``toolset``),
        its script (in ``language``; None: the engine's) prepared by ``engine`` (``Engine.prepare``; None: Python's).
        ``resumed``: the id of a durable job resumed (its output folder taken up: ``OutputLog.resume``).

        Raises:
            ManifestError / InvalidField: the manifest is unusable.
        """
        manifest = await self._toolsets.manifest(tools, toolset, caller)
        language = language or (engine.language if engine is not None else PYTHON)
        job_id = resumed or "job_" + secrets.token_hex(12)
        output_dir = self._output_dir / job_id
        retain, inline = self._settings.output_retention_bytes, limits.output_bytes
        budget = self._admission.quotas.output(caller.owner)

        def script_and_files() -> tuple[Normalized, OutputLog, OutputLog]:  # CPU and file system: not on the loop
            script, repair = request.script, request.normalize
            normalized = prepare(script, repair) if engine is None else engine.prepare(script, repair, language)
            if resumed is None or not output_dir.exists():  # a resumed job's is there (unless removed since)
                output_dir.mkdir(mode=0o700)
                mark_owner(output_dir, caller.owner)
            logs = [OutputLog(output_dir / name, inline, retain, budget) for name in ("stdout", "stderr")]
            if resumed is not None:
                for log in logs:
                    log.resume()
            return normalized, logs[0], logs[1]

        work = asyncio.ensure_future(asyncio.to_thread(script_and_files))  # one hand-off to a thread
        try:
            normalized, stdout, stderr = await asyncio.shield(work)
        except asyncio.CancelledError:  # the client gave up: the files the thread still makes are not left open
            work.add_done_callback(lambda done: _discard(done, output_dir))
            raise
        if request.normalize:
            count(normalized)
        job = LiveJob(
            id=job_id,
            limits=limits,
            metadata=request.metadata,
            callback_url=request.callback_url,
            output_dir=output_dir,
            stdout=stdout,
            stderr=stderr,
            loop=asyncio.get_running_loop(),
            owner=caller.owner,
            normalized=normalized,
            output_budget=budget,
        )
        if engine is not None:
            job.engine = engine.name
        job.language = language
        self.live.add(job)
        return job, manifest
