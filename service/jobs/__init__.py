"""Jobs: one script run, from request to terminal status (DESIGN.md, "Data flow of one execution").

Lifecycle::

    queued --(sandbox slot)--> running --> succeeded | failed | timed_out | oom_killed
       \\                          \\--(stop)--> stopped
        \\--(stop)--> stopped
    (any state not ended when the service stops or dies) --> lost

``JobManager.submit`` checks a request, admits it (at most ``concurrency``
running plus ``max_queue`` queued, else ``QueueFull``; then its owner's
quotas, else ``QuotaExceeded``, see ``service.quotas``) and runs it as a task:
wait for a script slot (shared with session scripts) and room on the host,
start the sandbox with the job's folder (script,
generated ``tools`` package, broker socket), enforce ``timeout_s`` and stop
requests, then remove the sandbox and the folder whatever happened.

Every status change is saved to the job store; the final view is saved
before anyone is told the job ended, so an ended job survives any crash of
the service. While a job runs it is served from memory; once saved as
ended, from the store. Output bytes are kept on disk under
``work_dir/output/<job_id>/`` (see ``output.OutputLog``) for offset reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from service import callbacks, exactjson, logs, verdict, views
from service.auth import Caller
from service.broker import Broker, CallMemory
from service.egress import EgressDenied
from service.errors import (
    CallNotPending,
    EngineUnavailable,
    InvalidField,
    JobNotFound,
    QueueFull,
    RequestLimitError,
    SandboxError,
    SessionNotFound,
    WorkDirBusy,
)
from service.jobs.model import (
    FINAL,
    INTERNAL_ERROR,
    SERVICE_STOPPED,
    EndedBy,
    ErrorType,
    Job,
    JobError,
    JobStatus,
    end_of_run,
    session_closed,
    stopped_before_start,
)
from service.metrics import Metrics
from service.normalize import Normalized, prepare, view_fields
from service.output import CappedStream, OutputLog, OutputRange, decode_slice, read_range
from service.pool import RUNTIME_LABEL, WarmPools
from service.quotas import HostCapacity, OwnerSlot, Quotas, Slots
from service.sandbox.base import ExitStatus, SandboxBackend, SandboxSpec, Stream, write_run_files
from service.sandbox.folders import SandboxFolders
from service.schemas import ExecuteRequest, JobSummary, JobView, McpServer, SessionRequest
from service.sessions import KILL_CONFIRM_S, SESSION_FEATURE, Session, SessionManager, SessionRun, SessionSandbox
from service.settings import Settings
from service.store import JobQuery, JobStore, StoredJob
from service.toolkit.cache import CompiledManifest, ManifestCache
from service.toolkit.endpoints import EndpointClients, ToolCallFailed
from service.toolkit.validation import CheckScheduler
from service.views import Body, EncodedView, render_head, snapshot

log = logging.getLogger(__name__)

LABEL_INSTANCE = "io.ptc-sandbox.instance"
LABEL_JOB = "io.ptc-sandbox.job"
LABEL_MANAGED = "io.ptc-sandbox.managed"
LABEL_SESSION = "io.ptc-sandbox.session"
KILL_WAIT_S = 30.0
STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
SLICE_BYTES = 1024 * 1024
CALLBACK_DELIVERIES = 32
OWNER_FILE = "owner"  # in a job's output folder: whose output budget its retained bytes count against
SANDBOX_LIMITS = ("memory_mb", "cpus", "pids", "tmp_mb")  # a sandbox's own limits (a session's are fixed)


@dataclass(frozen=True)
class ResolvedLimits:
    """A request's limits after defaults and server maxima were applied."""

    timeout_s: float
    wait_s: float
    memory_mb: int
    cpus: float
    pids: int
    output_bytes: int
    tmp_mb: int


def resolve_limits(request: ExecuteRequest, settings: Settings) -> ResolvedLimits:
    """Apply defaults; raises RequestLimitError naming the field that exceeds its server maximum."""
    limits = request.limits

    def pick(value: Any, default: Any, maximum: Any, loc: tuple[str, ...]) -> Any:
        if value is None:
            return default
        if value > maximum:
            raise RequestLimitError(f"{value} exceeds the server maximum of {maximum}", ("body", *loc))
        return value

    return ResolvedLimits(
        timeout_s=pick(request.timeout_s, settings.default_timeout_s, settings.max_timeout_s, ("timeout_s",)),
        wait_s=pick(request.wait_s, settings.default_wait_s, settings.max_wait_s, ("wait_s",)),
        memory_mb=pick(limits.memory_mb, settings.default_memory_mb, settings.max_memory_mb, ("limits", "memory_mb")),
        cpus=pick(limits.cpus, settings.default_cpus, min(settings.max_cpus, os.cpu_count() or 1), ("limits", "cpus")),
        pids=pick(limits.pids, settings.default_pids, settings.max_pids, ("limits", "pids")),
        output_bytes=pick(
            limits.output_bytes, settings.default_output_bytes, settings.max_output_bytes, ("limits", "output_bytes")
        ),
        tmp_mb=pick(limits.tmp_mb, settings.default_tmp_mb, settings.max_tmp_mb, ("limits", "tmp_mb")),
    )


def _now() -> datetime:
    return datetime.now(UTC)


class _Acquirable(Protocol):
    """A sandbox slot or a session's turn: ``asyncio.Lock`` or ``quotas.OwnerSlot``."""

    async def acquire(self) -> bool: ...

    def release(self) -> None: ...


def _retained(folder: Path) -> tuple[str | None, int]:
    """The owner of a job's output folder and the bytes it retains (blocking: run it in a thread)."""
    try:
        owner: str | None = (folder / OWNER_FILE).read_text()
    except OSError:
        owner = None  # written before owners were recorded: counted against nobody
    size = 0
    for stream in STREAMS:
        with contextlib.suppress(OSError):
            size += (folder / stream).stat().st_size
    return owner, size


def _retained_by_owner(output_dir: Path) -> dict[str, int]:
    """Retained output bytes per owner in ``output_dir`` (blocking; at start-up)."""
    totals: Counter[str] = Counter()
    for folder in output_dir.iterdir():
        owner, size = _retained(folder)
        if owner is not None:
            totals[owner] += size
    return dict(totals)


def _remove_output(folder: Path) -> tuple[str | None, int]:
    """Delete a job's output folder; returns its owner and the bytes it retained (blocking)."""
    found = _retained(folder)
    shutil.rmtree(folder, True)
    return found


def _ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds() * 1000, 3)


@dataclass(kw_only=True)
class LiveJob(Job):
    """One execution while the service holds it in memory (from submission until saved as ended): its
    lifecycle record (``model.Job``) with its limits, output, broker and the events its followers wait on."""

    limits: ResolvedLimits
    metadata: dict[str, Any]
    callback_url: str | None
    output_dir: Path
    stdout: OutputLog
    stderr: OutputLog
    loop: asyncio.AbstractEventLoop
    calls: list[dict[str, Any]] = field(default_factory=list)
    calls_over_limit: int = 0
    ran_as_coroutine: bool = False  # the runtime's report: the script had top-level await
    done: asyncio.Event = field(default_factory=asyncio.Event)
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)  # set while client calls wait for answers
    broker: Broker | None = None
    sandbox_start: str | None = None  # "warm" (from the pool), "cold" or "session"
    sandbox_id: str | None = None  # the engine's container id, once the job has one
    session_id: str | None = None  # the session it runs in (not counted in the admission of one-shot jobs)
    stop_reason: str | None = None  # why a stop was asked, when not by POST /jobs/{id}/stop
    normalized: Normalized | None = None  # the script's normalization (no repairs when switched off)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    saving: asyncio.Lock = field(default_factory=asyncio.Lock)  # saves reach the store in the order they began

    def script(self, request: ExecuteRequest) -> str:
        """The script to run: the request's, as normalization left it."""
        return self.normalized.script if self.normalized is not None else request.script

    def sink(self, stream: Stream, data: bytes) -> None:
        """OutputSink for this job's sandbox (called on the backend's reader thread)."""
        (self.stdout if stream == "stdout" else self.stderr).write(data)
        self.loop.call_soon_threadsafe(self.notify)

    def notify(self) -> None:
        """Wake whoever follows the job (events stream): something changed. Event-loop thread only."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def changed(self) -> asyncio.Event:
        """An event set at the next change after this call."""
        return self._changed

    def view_dict(self) -> dict[str, Any]:
        """The job view as a plain dict (inline output, records so far)."""
        out, err = self.stdout.inline.render(), self.stderr.inline.render()
        started = self.started_at
        return {
            "job_id": self.id,
            "status": self.status.value,
            "exit_code": self.exit_code,
            "stdout": out.text,
            "stderr": err.text,
            "stdout_truncated": out.truncated,
            "stderr_truncated": err.truncated,
            "stdout_bytes": out.total_bytes,
            "stderr_bytes": err.total_bytes,
            "stdout_invalid_utf8": out.invalid_utf8,
            "stderr_invalid_utf8": err.invalid_utf8,
            "calls": self.calls,
            "calls_total": len(self.calls),
            "calls_by_status": dict(Counter(c["status"] for c in self.calls)),
            "calls_over_limit": self.calls_over_limit,
            "error": self.error,
            "metadata": self.metadata,
            "created_at": self.created_at,
            "started_at": started,
            "ended_at": self.ended_at,
            "duration_ms": _ms(started, self.ended_at),
            "queue_ms": _ms(self.created_at, started or (None if self.ended_at else _now())),
            "stdout_next_offset": out.total_bytes,
            "stderr_next_offset": err.total_bytes,
            "stdout_retained_bytes": self.stdout.retained_bytes,
            "stderr_retained_bytes": self.stderr.retained_bytes,
            "callback": {"url": self.callback_url, "state": "pending", "attempts": []} if self.callback_url else None,
            "pending_calls": self.broker.pending_client_calls if self.broker is not None else [],
            "sandbox_start": self.sandbox_start,
            "sandbox_id": self.sandbox_id,
            "session_id": self.session_id,
            "owner": self.owner,
            "ran_as_coroutine": self.ran_as_coroutine or (self.broker is not None and self.broker.ran_as_coroutine),
            **view_fields(self.normalized),
        }


async def wait_for_end_or_client(job: LiveJob, timeout_s: float) -> None:
    """Return when the job ends, when it waits on a client-executed call, or after ``timeout_s``."""
    ended = asyncio.ensure_future(job.done.wait())
    waiting = asyncio.ensure_future(job.waiting.wait())
    try:
        await asyncio.wait({ended, waiting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        waiting.cancel()


def stored_job(head: dict[str, Any], calls: int, body: bytes, instance_id: str) -> StoredJob:
    """The store's row for a job view: ``body`` (its JSON), its columns, summary and callback flag from ``head``
    (the view's fields but its calls) and ``calls`` (how many records it holds)."""
    model = JobView.model_validate({**head, "calls": [], "pending_calls": []})
    summary = JobSummary.model_validate({**model.model_dump(), "calls": calls})
    pending = model.callback is not None and model.callback.state == "pending" and model.ended_at is not None
    return StoredJob(
        job_id=model.job_id,
        status=model.status,
        instance_id=instance_id,
        created_at=model.created_at,
        ended_at=model.ended_at,
        view=body,
        summary=summary.model_dump_json().encode(),
        callback_pending=pending,
        owner=model.owner,
    )


class JobManager:
    """Runs jobs in sandboxes, at most ``settings.concurrency()`` at once, and keeps them in the store.

    Args:
        settings: service settings.
        backend: the sandbox backend.
        endpoints: shared endpoint clients used by every job's broker.
        store: the job store (opened and closed by the caller).
        metrics: where jobs, sandbox starts, tool calls and callbacks are counted; default: a registry of its own.
    """

    def __init__(
        self,
        settings: Settings,
        backend: SandboxBackend,
        endpoints: EndpointClients,
        store: JobStore,
        metrics: Metrics | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._endpoints = endpoints
        self._store = store
        self._slots = Slots(settings.concurrency())  # one-shot jobs and session scripts alike
        self._capacity = HostCapacity.from_settings(settings)
        self._quotas = Quotas(settings, self._capacity)
        self._call_memory = CallMemory(settings.max_record_bytes_total, settings.max_call_bytes_in_flight_total)
        self._views = views.ViewCache(settings.view_cache_bytes)
        self._loading: dict[str, asyncio.Future[EncodedView]] = {}  # ended views being read back from the store
        self._scanning = asyncio.Lock()  # one stored view indexed at a time
        self._end_events = views.ByteBudget(settings.view_cache_bytes)
        self._live: dict[str, LiveJob] = {}
        self._admitted = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._removals: set[asyncio.Future[None]] = set()  # sandboxes of ended jobs being removed
        self._folders = SandboxFolders(settings.work_dir / "run", settings.sandbox_folders_tmpfs_mb)
        self._jobs_dir = self._folders.path / "jobs"
        self._output_dir = settings.work_dir / "output"
        self._instance = settings.instance()
        self._instance_labels = {LABEL_MANAGED: "1", LABEL_INSTANCE: self._instance}
        self._http = httpx.AsyncClient(  # callbacks pass the egress rules of tool endpoints
            follow_redirects=False,
            transport=endpoints.egress.transport(limits=httpx.Limits(max_connections=CALLBACK_DELIVERIES)),
        )
        self._callback_slots = asyncio.Semaphore(CALLBACK_DELIVERIES)
        self._callback_secrets = callbacks.load_secrets(settings)
        defaults = resolve_limits(ExecuteRequest(script=""), settings)  # the default profile
        self._pool = WarmPools(
            backend,
            self._spec(defaults, {}, self._jobs_dir, None, {}),
            self._folders.path / "pool",
            settings.warm_pool_size,
            settings.warm_pool_max_age_s,
            settings.warm_pool_max_profiles,
            capacity=self._capacity,
        )
        self._manifests = ManifestCache(
            self._installation_salt(), threads=settings.manifest_threads, budget_s=settings.manifest_budget_s
        )
        self._checks = CheckScheduler(settings.validation_threads, settings.validation_budget_s)
        self._metrics = metrics or Metrics(settings)
        self._metrics.track_jobs(self._live)
        self._metrics.track_pools(self._pool.sizes)
        self._sessions = SessionManager(
            backend,
            self._folders.path / "sessions",
            settings.max_sessions,
            before_end=self._end_session_jobs,
            on_count=self._metrics.set_sessions,
        )

    # -- start-up, shutdown, retention ---------------------------------------------------------

    async def start(self) -> None:
        """Lock the work dir, then reconcile what a previous run left: sandboxes, job folders, unfinished jobs.

        Raises:
            WorkDirBusy: another running instance holds the work dir.
        """
        self._lock_work_dir()
        try:
            removed = await self._backend.remove_labelled(self._instance_labels)
        except SandboxError as exc:
            log.warning("could not sweep sandboxes of instance %s: %s", self._instance, exc)
            removed = 0
        if removed:
            log.warning(
                "removed %d sandbox(es) left behind by an earlier run of instance %s",
                removed,
                self._instance,
            )
        await asyncio.to_thread(self._folders.open)  # a tmpfs: sandboxes' mount tables show no host path
        if self._jobs_dir.exists():
            shutil.rmtree(self._jobs_dir, ignore_errors=True)
        for folder in (self._jobs_dir, self._output_dir):
            folder.mkdir(parents=True, exist_ok=True)
        # Only root (the service) enters the work dir: the engine mounts job folders into sandboxes itself.
        os.chmod(self._settings.work_dir, 0o700)
        for stored in await self._store.unfinished(self._instance):
            await self._mark_lost(stored)
        for owner, retained in (await asyncio.to_thread(_retained_by_owner, self._output_dir)).items():
            self._quotas.output(owner).take(retained)
        for stored in await self._store.callbacks_pending(self._instance):
            self._spawn(self._deliver_callback(stored.job_id), f"callback {stored.job_id}")
        self._spawn(self._purge_loop(), "retention purge")
        await self._sessions.start()
        await self._pool.start()

    async def _mark_lost(self, stored: StoredJob) -> None:
        """End a job a previous run left unfinished: status ``lost``, its output as far as it was kept."""
        view = exactjson.loads(stored.view)  # its records may hold integers past 64 bits
        ended = _now()
        started = datetime.fromisoformat(view["started_at"]) if view.get("started_at") else None
        for stream in STREAMS:
            path = self._output_dir / stored.job_id / stream
            inline = CappedStream(max(len(view[stream].encode()), 64 * 1024))
            size = await self._replay(path, inline, self._settings.output_retention_bytes)
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
        calls = [c for c in view["calls"] if c["status"] != "pending"] + [
            {**c, "status": "error", "error": {"type": "cancelled", "message": "the service stopped"}}
            for c in view["calls"]
            if c["status"] == "pending"
        ]
        view.update(
            status="lost",
            ended_at=ended,
            error={
                "type": "service_restarted",
                "message": f"the service stopped while the job was {stored.status}; "
                "its sandbox was removed when it started again",
            },
            duration_ms=_ms(started, ended),
            queue_ms=_ms(datetime.fromisoformat(view["created_at"]), started or ended),
            calls=calls,
            calls_total=len(calls),
            calls_by_status=dict(Counter(c["status"] for c in calls)),  # its pending calls ended
        )
        body = b"".join([part async for part in views.stream(render_head(view), [], view["calls"])])
        await self._store.put(stored_job(view, len(view["calls"]), body, stored.instance_id))
        self._metrics.job_lost()
        log.warning("job %s was %s when the service last stopped: marked lost", stored.job_id, stored.status)

    @staticmethod
    async def _replay(path: Path, inline: CappedStream, limit: int) -> int:
        """Write the first ``limit`` bytes of a retained file into ``inline`` a ``SLICE_BYTES`` slice at a time
        (never the whole file in memory); returns how many."""
        size = 0
        while size < limit:
            data = await asyncio.to_thread(read_range, path, size, min(SLICE_BYTES, limit - size))
            if not data:
                break
            inline.write(data)
            size += len(data)
        return size

    def _installation_salt(self) -> bytes:
        """A secret random key kept in the work dir (created once): keys toolset ids so they leak nothing."""
        path = self._settings.work_dir / ".toolset-salt"
        self._settings.work_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        return path.read_bytes()

    def _lock_work_dir(self) -> None:
        """Hold an exclusive lock on ``work_dir/.lock`` for the process's life (the kernel drops it on any exit)."""
        work_dir = self._settings.work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
        lock = open(work_dir / ".lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise WorkDirBusy(work_dir) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock_file = lock

    async def close(self) -> None:
        """Stop every job still running (each removes its sandbox and is saved as lost) and background work."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)
        await self._sessions.close()
        await self._pool.close()
        await asyncio.to_thread(self._folders.close)
        await self._http.aclose()
        self._checks.close()
        self._manifests.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _purge_loop(self) -> None:
        while True:
            try:
                await self.purge_expired()
            except Exception:
                log.exception("purging expired jobs failed")
            await asyncio.sleep(self._settings.purge_interval_s)

    async def purge_expired(self) -> int:
        """Delete ended jobs older than the retention, with their output files; returns how many."""
        cutoff = _now() - timedelta(seconds=self._settings.job_retention_s)
        ids = await self._store.purge(cutoff)
        for job_id in ids:
            self._views.drop(job_id)
            owner, retained = await asyncio.to_thread(_remove_output, self._output_dir / job_id)
            if owner is not None:
                self._quotas.output(owner).give_back(retained)
        if ids:
            log.info("purged %d job(s) ended before %s", len(ids), cutoff.isoformat())
        return len(ids)

    # -- submission and the run ----------------------------------------------------------------

    async def submit(self, request: ExecuteRequest, owner: str, *, admin: bool = False) -> LiveJob:
        """Check and admit ``request``, and start its job, owned by ``owner`` (the API key's name).

        Its ``session_id`` and ``toolset`` must be ``owner``'s own, unless ``admin`` (the admin role).

        Raises:
            ManifestError: a tool entry is unusable (names the entry and field).
            RequestLimitError: a limit exceeds its server maximum.
            InvalidField: an unknown toolset (another owner's included).
            SessionNotFound: an unknown session (another owner's included).
            QueueFull: ``concurrency`` jobs run and ``max_queue`` wait already.
            QuotaExceeded: the owner is at one of its job quotas (``Quotas.admit_job``).
        """
        limits = resolve_limits(request, self._settings)
        if request.callback_url and self._callback_secrets.for_owner(owner) is None:
            raise InvalidField(
                "callback_url needs the server setting PTC_CALLBACK_SECRET, or a PTC_CALLBACK_SECRETS entry for "
                "this key (callbacks are always signed)",
                ("body", "callback_url"),
            )
        if request.callback_url:
            try:
                self._endpoints.egress.target(request.callback_url)
            except EgressDenied as exc:
                raise InvalidField(str(exc), ("body", "callback_url")) from exc
        caller = Caller(owner, admin)
        if request.session_id is not None:
            return await self._submit_to_session(request, limits, caller)
        if self._admitted >= self._settings.concurrency() + self._settings.max_queue:
            raise QueueFull(self._settings.retry_after_s)
        self._quotas.admit_job(owner)
        self._admitted += 1  # counted before the first await, so admission is exact under concurrency
        try:
            job, manifest = await self._new_job(limits, request, request.tools, request.toolset, caller)
        except BaseException:
            self._admitted -= 1
            self._quotas.job_ended(owner)
            raise
        self._spawn(self._run(job, request, manifest), f"job {job.id}")
        return job

    async def _submit_to_session(self, request: ExecuteRequest, limits: ResolvedLimits, caller: Caller) -> LiveJob:
        """Queue ``request`` for its session's turn (one script at a time per session, in order of arrival)."""
        assert request.session_id is not None
        self._session(request.session_id, caller)  # another owner's session is not found
        session = self._sessions.usable(request.session_id)
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
        if session.queued >= self._settings.max_queue or self._sessions.queued >= self._settings.max_queue:
            raise QueueFull(self._settings.retry_after_s)  # PTC_MAX_QUEUE per session, and for all sessions
        own_tools = bool(request.tools or request.toolset)
        job_caller = caller if own_tools else Caller(session.owner)  # the session's toolset is its owner's
        self._quotas.admit_job(job_caller.owner)  # the job's owner, whose quotas it counts against until it ends
        session.queued += 1  # counted before the first await, so the session's queue bound is exact
        try:
            job, manifest = await self._new_job(
                limits,
                request,
                request.tools if own_tools else session.tools,
                request.toolset if own_tools else session.toolset,
                job_caller,
            )
        except BaseException:
            session.queued -= 1
            self._quotas.job_ended(job_caller.owner)
            raise
        job.session_id = session.id
        self._spawn(self._run_in_session(job, request, manifest, session), f"job {job.id}")
        return job

    async def _new_job(
        self,
        limits: ResolvedLimits,
        request: ExecuteRequest,
        tools: list[dict[str, Any]],
        toolset: str | None,
        caller: Caller,
    ) -> tuple[LiveJob, CompiledManifest]:
        """A job for an admitted ``request`` (live from now on) and its compiled manifest (``tools`` or ``toolset``).

        The job is ``caller.owner``'s; ``toolset`` must be one ``caller`` may use.

        Raises:
            ManifestError / InvalidField: the manifest is unusable.
        """
        manifest = await self.manifest(tools, toolset, caller)
        normalized = await prepare(request.script, request.normalize)
        job_id = "job_" + secrets.token_hex(12)
        output_dir = self._output_dir / job_id
        output_dir.mkdir(mode=0o700)
        (output_dir / OWNER_FILE).write_text(caller.owner)
        retain, inline = self._settings.output_retention_bytes, limits.output_bytes
        budget = self._quotas.output(caller.owner)
        job = LiveJob(
            id=job_id,
            limits=limits,
            metadata=request.metadata,
            callback_url=request.callback_url,
            output_dir=output_dir,
            stdout=OutputLog(output_dir / "stdout", inline, retain, budget),
            stderr=OutputLog(output_dir / "stderr", inline, retain, budget),
            loop=asyncio.get_running_loop(),
            owner=caller.owner,
            normalized=normalized,
        )
        self._live[job.id] = job
        return job, manifest

    def _spec(
        self, limits: ResolvedLimits, env: dict[str, str], job_dir: Path, job_id: str | None, labels: dict[str, str]
    ) -> SandboxSpec:
        """The sandbox a job with these limits and env runs in (``job_id`` None: a pooled or session sandbox)."""
        settings = self._settings
        return SandboxSpec(
            image=settings.sandbox_image,
            job_dir=job_dir,
            memory_mb=limits.memory_mb,
            cpus=limits.cpus,
            pids=limits.pids,
            tmp_mb=limits.tmp_mb,
            file_size_mb=settings.file_size_mb,
            open_files=settings.open_files,
            env=env,
            labels={**self._instance_labels, **({LABEL_JOB: job_id} if job_id else {}), **labels},
            runtime=settings.runtime,
        )

    async def _save(self, job: LiveJob, final: bool = False) -> None:
        """Save the job's view (encoded a batch of records at a time); ``final``: also keep it for reading."""
        logs.job(job)  # every save is a status change
        view = job.view_dict()
        records = snapshot(view["calls"])
        async with job.saving:  # encoding gives the loop back: a later save must not overtake an earlier one
            try:
                encoded = await views.encode(render_head(view), records)
            except (ValueError, TypeError):  # a view that cannot be encoded must still be saved: keep what can be
                log.exception("job %s: its view cannot be encoded; saving it without output and calls", job.id)
                view.update(views.unencodable(view))
                records = []
                encoded = await views.encode(render_head(view), records)
            await self._store.put(stored_job(encoded.head, len(records), encoded.body, self._instance))
        if final:
            self._views.put(job.id, encoded)

    async def _set_status(self, job: LiveJob, status: JobStatus) -> None:
        job.move(status)
        job.notify()
        await self._save(job)

    async def _acquire(self, job: LiveJob, slots: _Acquirable) -> bool:
        """Wait for a sandbox slot (or the session's turn); False (and nothing held) if the job was stopped first."""
        acquire = asyncio.ensure_future(slots.acquire())
        stopped = asyncio.ensure_future(job.stop_requested.wait())
        try:
            await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not acquire.done():
                acquire.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquire
        got_slot = acquire.done() and not acquire.cancelled()
        if got_slot and job.stop_requested.is_set():
            slots.release()
            return False
        return got_slot

    def _new_broker(self, job: LiveJob, manifest: CompiledManifest) -> Broker:
        """The job's broker (not listening yet); its records are the job's call records."""
        settings = self._settings
        broker = Broker(
            manifest.tools,
            self._endpoints,
            settings.max_tool_calls,
            settings.max_request_line_bytes,
            settings.max_record_bytes,
            on_call_end=lambda record: self._call_ended(job, record),
            client_call_timeout_s=settings.client_call_timeout_s,
            on_client_calls=lambda waiting: self._client_calls_changed(job, waiting),
            max_in_flight_bytes=settings.max_call_bytes_in_flight,
            memory=self._call_memory,
            checks=self._checks,
            check_group=job.owner,
        )
        job.calls = broker.records
        job.broker = broker
        return broker

    def _slot(self, job: LiveJob) -> OwnerSlot:
        """The script slot ``job`` takes while it runs (its owner's ``running_jobs`` quota applies)."""
        return self._slots.of(job.owner, self._quotas.of(job.owner).running_jobs)

    async def _slot_and_sandbox(self, job: LiveJob, spec: SandboxSpec) -> tuple[OwnerSlot, SessionSandbox] | None:
        """A script slot for ``job`` and its sandbox: a pooled one, or a new one (not started) with room
        committed on the host; None (nothing held) if the job was stopped first.

        Room is taken from idle pooled sandboxes when needed; when there is none, the job gives its slot
        back and waits (still ``queued``) for room to be released, so that a job waiting for room never
        holds a slot a session's script would need to end.
        """
        capacity, slot = self._capacity, self._slot(job)

        def fits() -> bool:
            return capacity.shortfall(spec.memory_mb, spec.cpus) is None

        while await self._acquire(job, slot):
            sandbox = self._pool.take(spec)
            if sandbox is not None:
                return slot, sandbox
            if self._pool.evict(fits):
                sandbox = SessionSandbox(self._backend, spec)
                sandbox.commitment = capacity.commit(spec.memory_mb, spec.cpus)  # given back at its removal
                return slot, sandbox
            slot.release()
            changed = asyncio.ensure_future(capacity.changed().wait())
            stopped = asyncio.ensure_future(job.stop_requested.wait())
            capacity.waiting += 1
            try:
                await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                capacity.waiting -= 1
                changed.cancel()
                stopped.cancel()
        return None

    async def _run(self, job: LiveJob, request: ExecuteRequest, manifest: CompiledManifest) -> None:
        broker = self._new_broker(job, manifest)
        sandbox: SessionSandbox | None = None
        try:
            await self._save(job)
            spec = self._spec(job.limits, {}, self._jobs_dir / job.id, job.id, {})
            got = await self._slot_and_sandbox(job, spec)
            if got is None:
                job.end(JobStatus.STOPPED, stopped_before_start())
                return
            slot, sandbox = got
            try:
                begin = time.monotonic()
                job.sandbox_start = "warm" if sandbox.handle is not None else "cold"
                job.started_at = _now()
                await self._set_status(job, JobStatus.RUNNING)
                started = time.monotonic()  # a cold job's time limit includes its sandbox's start
                if sandbox.handle is None:
                    await sandbox.start()
                job.sandbox_id = sandbox.handle.id[:12] if sandbox.handle is not None else None
                await asyncio.to_thread(write_run_files, sandbox.folder, job.script(request), manifest.stub_source)
                await broker.start(sandbox.folder / "tools.sock")
                run = await sandbox.run(job.id, request.env, job.sink)
                self._metrics.sandbox_started(job.sandbox_start, time.monotonic() - begin)
                logs.sandbox("sandbox_start", job.id, job.sandbox_id, time.monotonic() - begin, mode=job.sandbox_start)
                exit_status, ended_by = await self._supervise(job, run, started)
                self._finish(job, exit_status, ended_by, broker)
            finally:
                slot.release()
        except BaseException as exc:
            self._failed(job, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            await asyncio.shield(self._cleanup(job, broker, sandbox))

    @staticmethod
    def _failed(job: LiveJob, exc: BaseException) -> None:
        """Set the status and error of a job whose run raised ``exc`` (the service stopping included)."""
        if isinstance(exc, asyncio.CancelledError):
            if not job.ended:
                job.end(JobStatus.LOST, SERVICE_STOPPED)
        elif isinstance(exc, SandboxError):
            log.error("job %s: sandbox failure: %s", job.id, exc)
            kind = ErrorType.ENGINE_UNAVAILABLE if isinstance(exc, EngineUnavailable) else ErrorType.SANDBOX_ERROR
            if not job.ended:
                job.end(JobStatus.FAILED, JobError(kind, str(exc)))
        elif isinstance(exc, Exception):
            log.exception("job %s: unexpected failure", job.id, exc_info=exc)
            if not job.ended:
                job.end(JobStatus.FAILED, INTERNAL_ERROR)

    async def _run_in_session(
        self, job: LiveJob, request: ExecuteRequest, manifest: CompiledManifest, session: Session
    ) -> None:
        """Run a job in its session's sandbox once it is the session's turn; the sandbox stays for the next."""
        broker = self._new_broker(job, manifest)
        try:
            await self._save(job)
            got_turn = await self._acquire(job, session.turn)
            session.queued -= 1
            holds_slot = False
            if not got_turn:
                job.end(JobStatus.STOPPED, stopped_before_start())
                return
            try:
                if session.ended:
                    job.end(JobStatus.STOPPED, session_closed(session.status, before_turn=True))
                    return
                session.current_job_id = job.id  # busy from now on; a session that ends stops it
                slot = self._slot(job)
                if not await self._acquire(job, slot):
                    job.end(JobStatus.STOPPED, stopped_before_start(job.stop_reason))
                    return
                holds_slot = True
                if session.ended:
                    job.end(JobStatus.STOPPED, session_closed(session.status, before_turn=False))
                    return
                begin = time.monotonic()
                sandbox = session.sandbox
                stubs = None if session.stub_source == manifest.stub_source else manifest.stub_source
                await asyncio.to_thread(write_run_files, sandbox.folder, job.script(request), stubs)
                session.stub_source = manifest.stub_source
                await broker.start(sandbox.folder / "tools.sock")
                job.started_at = _now()
                job.sandbox_start = "session"
                job.sandbox_id = sandbox.handle.id[:12] if sandbox.handle is not None else None
                await self._set_status(job, JobStatus.RUNNING)
                started = time.monotonic()
                run = await sandbox.run(job.id, request.env, job.sink)
                self._metrics.sandbox_started("session", time.monotonic() - begin)
                logs.sandbox("sandbox_start", job.id, job.sandbox_id, time.monotonic() - begin, mode="session")
                exit_status, ended_by = await self._supervise(job, run, started)
                self._finish(job, exit_status, ended_by, broker)
            finally:
                if holds_slot:
                    slot.release()
                with contextlib.suppress(Exception):
                    await broker.close()  # before the next script's broker listens on the same path
                if session.current_job_id == job.id:
                    session.current_job_id = None
                    session.executions += 1
                session.last_used_at = _now()
                session.turn.release()
                if session.sandbox.broken is not None and not session.ended:
                    self._spawn(self._sessions.end(session, "broken", session.sandbox.broken), f"end {session.id}")
        except BaseException as exc:
            self._failed(job, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            await asyncio.shield(self._cleanup(job, broker, None))

    async def _supervise(self, job: LiveJob, run: SessionRun, started: float) -> tuple[ExitStatus, EndedBy | None]:
        """Wait for the script to exit, its time limit, or a stop request; returns (exit, what the service asked).

        The first of the time limit and a stop that is decided wins (a stop during the SIGTERM grace does not
        become a timeout, nor a stop after the timeout's SIGKILL a stop); whether it ended the script is for
        ``_finish`` to say from the exit the runtime reports.
        """
        waiting = asyncio.ensure_future(run.wait())
        stop = asyncio.ensure_future(job.stop_requested.wait())
        try:
            remaining = max(job.limits.timeout_s - (time.monotonic() - started), 0)
            done, _ = await asyncio.wait({waiting, stop}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            ended_by: EndedBy | None = None
            if waiting not in done:
                if stop in done:
                    ended_by = "stopped"
                    await run.signal("SIGTERM")
                    grace_done, _ = await asyncio.wait({waiting}, timeout=self._settings.stop_grace_s)
                    if not grace_done:
                        await run.kill()
                else:
                    ended_by = "timed_out"
                    await run.kill()
            return await asyncio.wait_for(waiting, KILL_WAIT_S), ended_by
        finally:
            stop.cancel()
            if not waiting.done():
                waiting.cancel()

    def _call_ended(self, job: LiveJob, record: dict[str, Any]) -> None:
        """A tool call of ``job`` has its outcome: wake followers, count it, log it (debug level)."""
        job.notify()
        self._metrics.tool_call(record)
        logs.tool_call(job.id, record)

    def _client_calls_changed(self, job: LiveJob, waiting: int) -> None:
        """``waiting`` while client-executed calls wait for answers, ``running`` again when none does."""
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
        self._spawn(self._save(job), f"save {job.id}")

    async def answer_call(self, job_id: str, caller: Caller, call_id: str, ok: bool, value: Any) -> Body:
        """Answer a client-executed call of a running job; returns the job's view after it.

        Raises:
            JobNotFound: no such job, or another owner's (only the job's owner answers its calls).
            CallNotPending: the job has ended, or that call is not waiting for an answer.
        """
        job = self.live(job_id, caller)
        if job is None:
            await self.stored_view(job_id, caller)
            raise CallNotPending(call_id)
        if job.broker is None:
            raise CallNotPending(call_id)
        changed = job.changed()
        job.broker.answer_client_call(call_id, ok, value)
        with contextlib.suppress(TimeoutError):  # let the call's task record the answer before the view is taken
            await asyncio.wait_for(changed.wait(), 1.0)
        return await self.view(job_id, caller)

    def _finish(self, job: LiveJob, exit_status: ExitStatus, ended_by: EndedBy | None, broker: Broker) -> None:
        """Set the job's status, exit code and error from what ended the script.

        ``ended_by`` is what the service asked for (``stopped`` or ``timed_out``; the first decided, see
        ``_supervise``); it names the end only when the service's signal ended the script (the runtime reports
        a death by the signal it sent while the script ran, ``ExitStatus.killed``) or the sandbox was lost
        after it was asked. A script whose own exit (or the OOM killer) came first ends by that exit: a stop or
        timeout that arrives as the script exits never relabels it, and an exit 0 is always ``succeeded``.
        """
        job.exit_code = exit_status.exit_code
        code = exit_status.exit_code
        script_failure = verdict.failure(code, job.normalized, broker.script_report) if code != 0 else None
        status, error = end_of_run(
            exit_status,
            ended_by,
            timeout_s=job.limits.timeout_s,
            memory_mb=job.limits.memory_mb,
            stop_reason=job.stop_reason,
            script_failure=script_failure,
        )
        job.end(status, error)

    async def _cleanup(self, job: LiveJob, broker: Broker, sandbox: SessionSandbox | None) -> None:
        """Save the final view, tell waiters, then remove the job's own ``sandbox`` (and folder). Never raises.

        The sandbox is removed after the answer (it has exited, or was killed, and its output is all in),
        so a caller does not wait ~40 ms for the engine; ``close`` waits for removals still under way.
        """
        try:
            with contextlib.suppress(Exception):
                await broker.close()
            job.calls_over_limit = broker.calls_over_limit
            job.ran_as_coroutine = broker.ran_as_coroutine
            for log_ in (job.stdout, job.stderr):
                log_.close()
            job.ended_at = _now()
            if not job.ended:
                job.end(JobStatus.LOST, job.error)
            self._metrics.job_ended(job)
            try:
                await self._save(job, final=True)
            except Exception:
                log.exception("job %s: could not save its final view", job.id)
        finally:
            broker.release()
            if job.session_id is None:
                self._admitted -= 1
            self._quotas.job_ended(job.owner)
            job.notify()
            job.done.set()
            self._live.pop(job.id, None)
            if job.callback_url:
                self._spawn(self._deliver_callback(job.id), f"callback {job.id}")
            if sandbox is not None:  # its removal never fails loudly; the start-up sweep catches what it misses
                sandbox.stop_reason = job.status
                removal = asyncio.ensure_future(sandbox.destroy())
                self._removals.add(removal)
                removal.add_done_callback(self._removals.discard)

    # -- callbacks -----------------------------------------------------------------------------

    async def _deliver_callback(self, job_id: str) -> None:
        """Deliver the job's completion callback (at most ``CALLBACK_DELIVERIES`` at once), saving each attempt."""
        async with self._callback_slots:
            await self._deliver_callback_now(job_id)

    async def _deliver_callback_now(self, job_id: str) -> None:
        stored = await self._store.get(job_id)
        if stored is None:
            return
        secret = self._callback_secrets.for_owner(stored.owner)
        if secret is None:
            log.warning("job %s: its callback cannot be sent: no callback secret for its owner is set", job_id)
            return
        final = await self._encoded(job_id)
        view = dict(final.head)
        callback = view["callback"] = dict(view["callback"], attempts=list(view["callback"]["attempts"]))
        body = final.body
        pending: list[asyncio.Task[None]] = []

        def on_attempt(attempt: dict[str, Any]) -> None:
            self._metrics.callback_attempt(attempt)
            callback["attempts"].append(attempt)
            pending.append(asyncio.ensure_future(self._put_view(stored, view, final)))

        delivered = await callbacks.deliver(
            self._http,
            callback["url"],
            body,
            secret,
            max_attempts=self._settings.callback_max_attempts,
            backoff_s=self._settings.callback_backoff_s,
            timeout_s=self._settings.callback_timeout_s,
            on_attempt=on_attempt,
            owner=stored.owner,
        )
        callback["state"] = "delivered" if delivered else "failed"
        self._metrics.callback_done(delivered)
        await asyncio.gather(*pending, return_exceptions=True)
        await self._put_view(stored, view, final)
        if not delivered:
            log.warning(
                "job %s: callback to its callback_url failed after %d attempts", job_id, len(callback["attempts"])
            )

    async def _put_view(self, stored: StoredJob, head: dict[str, Any], final: EncodedView) -> None:
        """Save an ended job's view with a new ``head`` (its call records as they were); keep it for reading."""
        encoded = await views.encode(render_head(head), list(final.records()))
        await self._store.put(stored_job(encoded.head, len(encoded.spans), encoded.body, stored.instance_id))
        self._views.put(stored.job_id, encoded)

    # -- manifests -----------------------------------------------------------------------------

    async def manifest(self, tools: list[dict[str, Any]], toolset: str | None, caller: Caller) -> CompiledManifest:
        """The compiled manifest of a request: its ``tools``, or the registered ``toolset``.

        A toolset is usable only by the owners that registered it (and the admin role): for anyone
        else it is unknown, so its endpoint credentials never serve another key.

        Raises:
            ManifestError: a tool entry is unusable.
            InvalidField: both, or an unknown toolset (another owner's included, with the same message).
        """
        if toolset is not None:
            if tools:
                raise InvalidField("give tools or toolset, not both", ("body", "toolset"))
            raw = await self._store.get_toolset(toolset, caller.only_owner)
            if raw is None:
                raise InvalidField(
                    f"no toolset {toolset!r}; register the manifest with POST /toolsets", ("body", "toolset")
                )
            tools = orjson.loads(raw)
        return await self._manifests.compile(tools, caller.owner)

    async def register_toolset(
        self, tools: list[dict[str, Any]], servers: list[McpServer], owner: str
    ) -> CompiledManifest:
        """Check a manifest and keep it under its content id for ``owner`` (registering it again is a no-op).

        Each of ``servers`` is asked for its ``tools/list``; its tools join the manifest with an ``mcp`` endpoint.

        Raises:
            ManifestError / InvalidField: as for any manifest; InvalidField when a server cannot list its tools.
        """
        tools = list(tools)
        for i, server in enumerate(servers):
            try:
                listed = await self._endpoints.list_mcp_tools(server.url, server.headers, server.timeout_s or 30.0)
            except ToolCallFailed as exc:
                raise InvalidField(f"{exc.type}: {exc.message}", ("body", "mcp_servers", i)) from exc
            endpoint: dict[str, Any] = {"kind": "mcp", "url": server.url, "headers": server.headers}
            if server.timeout_s:
                endpoint["timeout_s"] = server.timeout_s
            tools += [{**entry, "endpoint": endpoint} for entry in listed]
        if len(tools) > self._settings.max_tools:
            raise RequestLimitError(
                f"{len(tools)} tools (MCP listings included) exceed the server maximum of {self._settings.max_tools}",
                ("body", "mcp_servers"),
            )
        compiled = await self._manifests.compile(tools, owner)
        if compiled.toolset_id is None:
            raise InvalidField("this manifest cannot be stored as JSON (lone surrogates?)", ("body", "tools"))
        await self._store.put_toolset(compiled.toolset_id, orjson.dumps(tools), owner)
        return compiled

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, request: SessionRequest, owner: str, *, admin: bool = False) -> dict[str, Any]:
        """Start a session's sandbox, owned by ``owner``, and return its view.

        Its ``toolset`` must be ``owner``'s own, unless ``admin``.

        The session counts against its owner's session quotas and commits its memory and CPUs on the host
        (idle pooled sandboxes give up their room for it) until it ends.

        Raises:
            RequestLimitError / InvalidField: a limit past its maximum, an unknown runtime or toolset, a bad
                manifest (checked now, not at the first script).
            TooManySessions: ``max_sessions`` are open.
            QuotaExceeded: the owner is at a session quota, or the host has no room (``host_memory_mb``,
                ``host_cpus``).
            SandboxError: the image cannot run sessions, or the sandbox could not start.
        """
        settings = self._settings
        limits = resolve_limits(ExecuteRequest(script="", limits=request.limits), settings)
        lifetimes = {}
        for name, value, default in (
            ("idle_timeout_s", request.idle_timeout_s, settings.session_idle_timeout_s),
            ("max_lifetime_s", request.max_lifetime_s, settings.session_max_lifetime_s),
        ):
            if value is not None and value > settings.max_session_lifetime_s:
                raise RequestLimitError(
                    f"{value} exceeds the server maximum of {settings.max_session_lifetime_s}", ("body", name)
                )
            lifetimes[name] = value if value is not None else default
        runtime = request.runtime or settings.runtime
        if runtime is not None and runtime != settings.runtime and runtime not in settings.session_runtimes:
            raise InvalidField(
                f"runtime {runtime!r} is not offered; ask for one of {sorted(settings.session_runtimes)}",
                ("body", "runtime"),
            )
        await self.manifest(request.tools, request.toolset, Caller(owner, admin))  # a bad manifest fails now
        features = (await self._backend.image_labels(settings.sandbox_image)).get(RUNTIME_LABEL, "")
        if SESSION_FEATURE not in features.split(","):
            raise SandboxError(
                f"the sandbox image {settings.sandbox_image} cannot run sessions "
                "(rebuild it with sandbox_image/build.sh)"
            )
        spec = self._spec(limits, request.env, self._jobs_dir, None, {LABEL_SESSION: "1"})
        spec = replace(spec, runtime=None if runtime == "runc" else runtime)
        memory_mb, cpus = limits.memory_mb, limits.cpus
        self._quotas.admit_session(owner, memory_mb, cpus)  # from here to the commitment: no await
        try:

            def fits() -> bool:
                return self._capacity.shortfall(memory_mb, cpus) is None

            if not self._pool.evict(fits):
                raise self._capacity.refusal(memory_mb, cpus, self._capacity.shortfall(memory_mb, cpus) or "")
            commitment = self._capacity.commit(memory_mb, cpus)
            try:
                session = await self._sessions.create(
                    spec,
                    limits={name: getattr(limits, name) for name in (*SANDBOX_LIMITS, "output_bytes")},
                    env=request.env,
                    tools=request.tools,
                    toolset=request.toolset,
                    metadata=request.metadata,
                    owner=owner,
                    **lifetimes,
                )
            except BaseException:
                if commitment is not None:
                    commitment.release()
                raise
        except BaseException:
            self._quotas.session_ended(owner, memory_mb, cpus)
            raise
        session.sandbox.commitment = commitment  # given back when its sandbox is removed
        log.info("session %s started in sandbox %s", session.id, session.view()["sandbox_id"])
        return session.view()

    def _session(self, session_id: str, caller: Caller) -> Session:
        """A live or recently ended session ``caller`` may access; raises SessionNotFound (another owner's too)."""
        session = self._sessions.get(session_id)
        if not caller.may_access(session.owner):
            raise SessionNotFound(session_id)
        return session

    def session_view(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """A session's view; raises SessionNotFound (for another owner's session too)."""
        return self._session(session_id, caller).view()

    def sessions(self, caller: Caller) -> list[dict[str, Any]]:
        """Views of the open sessions ``caller`` may access (the admin role: all), oldest first."""
        return [s.view() for s in self._sessions.live_sessions() if caller.may_access(s.owner)]

    async def delete_session(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """End a session: its running script is stopped, its queued ones end ``stopped``, its sandbox is removed.

        Idempotent: an ended session's view is returned as it is. Raises SessionNotFound (another owner's too).
        """
        session = self._session(session_id, caller)
        await self._sessions.end(session, "closed", None)
        return session.view()

    async def _end_session_jobs(self, session: Session) -> None:
        """Before a session's sandbox goes: stop the script running in it (queued ones see the session ended).

        Its owner's session quotas are given back here (its host capacity when its sandbox is removed).
        """
        self._quotas.session_ended(session.owner, session.limits["memory_mb"], session.limits["cpus"])
        job = self._live.get(session.current_job_id or "")
        if job is None:
            return
        reason = (session.error or {}).get("message") or "deleted"
        job.stop_reason = f"the session ended ({session.status}: {reason})"
        job.stop_requested.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.done.wait(), self._settings.stop_grace_s + KILL_CONFIRM_S + 1)

    # -- reading, waiting, stopping ------------------------------------------------------------

    def live(self, job_id: str, caller: Caller) -> LiveJob | None:
        """The job if it has not been saved as ended yet; raises JobNotFound when it is another owner's.

        Every job a caller names goes through here or ``final``: another owner's job answers
        exactly like one that does not exist (its existence is not revealed).
        """
        job = self._live.get(job_id)
        if job is not None and not caller.may_access(job.owner):
            raise JobNotFound(job_id)
        return job

    async def stored_view(self, job_id: str, caller: Caller) -> bytes:
        """The saved view (JSON bytes) of a job that is not live; raises JobNotFound (another owner's too)."""
        return (await self.final(job_id, caller)).body

    async def final(self, job_id: str, caller: Caller) -> EncodedView:
        """The encoded view of a job that is not live: kept since it ended, or read back from the store (once
        for concurrent readers, one view indexed at a time, off the event loop).

        Raises:
            JobNotFound: no such job, or another owner's (the same answer: existence is not revealed).
        """
        encoded = await self._encoded(job_id)
        if not caller.may_access(encoded.head.get("owner")):  # None: saved before owners were (admin only)
            raise JobNotFound(job_id)
        return encoded

    async def _encoded(self, job_id: str) -> EncodedView:
        """``final`` without the owner check, for the service's own reads; raises JobNotFound."""
        cached = self._views.get(job_id)
        if cached is not None:
            return cached
        loading = self._loading.get(job_id)
        if loading is None:
            loading = self._loading[job_id] = asyncio.ensure_future(self._load(job_id))
            loading.add_done_callback(lambda _: self._loading.pop(job_id, None))
        return await asyncio.shield(loading)

    async def _load(self, job_id: str) -> EncodedView:
        stored = await self._store.get(job_id)
        if stored is None:
            raise JobNotFound(job_id)
        async with self._scanning:
            head, spans = await asyncio.to_thread(views.scan, stored.view)
        encoded = EncodedView(head, stored.view, spans)
        if job_id not in self._live:  # a job saved as running may have ended meanwhile: its own save wins
            self._views.put(job_id, encoded)
        return encoded

    def live_view(self, job: LiveJob) -> Body:
        """A live job's view, rendered a batch of records at a time as it is sent."""
        return self._render(job.view_dict())

    @staticmethod
    def _render(view: dict[str, Any]) -> Body:
        records = snapshot(view["calls"])
        return views.stream(render_head(view), view.get("pending_calls", []), records)

    async def view(self, job_id: str, caller: Caller, offsets: dict[Stream, int | None] | None = None) -> Body:
        """The job's view (JSON bytes, or pieces of them); with ``offsets``, a stream's text holds its bytes from
        that offset.

        Raises:
            JobNotFound: no such job, or another owner's.
        """
        job = self.live(job_id, caller)
        wanted = {stream: offset for stream, offset in (offsets or {}).items() if offset is not None}
        if job is not None:
            view = job.view_dict()
            for stream, offset in wanted.items():
                await self._slice(view, stream, offset)
            return self._render(view)
        final = await self.final(job_id, caller)
        if not wanted:
            return final.body
        head = dict(final.head)
        for stream, offset in wanted.items():
            await self._slice(head, stream, offset)
        return views.stream(render_head(head), [], final.records())

    async def _slice(self, view: dict[str, Any], stream: Stream, offset: int) -> None:
        """Put the stream's retained bytes from ``offset`` (at most ``SLICE_BYTES``) into ``view``.

        ``<stream>_truncated`` then says whether retained bytes follow the slice.
        """
        path = self._output_dir / view["job_id"] / stream
        data = await asyncio.to_thread(read_range, path, offset, SLICE_BYTES)
        at_end = view["status"] in FINAL and offset + len(data) >= view[f"{stream}_retained_bytes"]
        text, consumed, invalid = decode_slice(data, final=at_end)
        view[stream] = text
        view[f"{stream}_offset"] = offset
        view[f"{stream}_next_offset"] = offset + consumed
        view[f"{stream}_invalid_utf8"] = invalid
        view[f"{stream}_truncated"] = offset + consumed < view[f"{stream}_retained_bytes"]

    async def read_output(self, job_id: str, caller: Caller, stream: Stream, offset: int, length: int) -> bytes:
        """Raw retained bytes of a stream, at most ``min(length, SLICE_BYTES)`` of them (bounded in memory:
        ``output_range`` serves longer reads); raises JobNotFound (for another owner's job too)."""
        if self.live(job_id, caller) is None:
            await self.stored_view(job_id, caller)
        path = self._output_dir / job_id / stream
        return await asyncio.to_thread(read_range, path, offset, min(length, SLICE_BYTES))

    async def output_range(self, job_id: str, caller: Caller, stream: Stream, offset: int, length: int) -> OutputRange:
        """The retained bytes of a stream from ``offset``, up to ``length`` (those retained now), as an open
        ``OutputRange`` to read a slice at a time and close (``GET /jobs/{id}/output/{stream}``).

        Raises:
            JobNotFound: no such job, or another owner's.
        """
        if self.live(job_id, caller) is None:
            await self.stored_view(job_id, caller)
        return await asyncio.to_thread(OutputRange.open, self._output_dir / job_id / stream, offset, length)

    async def wait(self, job_id: str, caller: Caller, timeout_s: float) -> Body:
        """Block until the job ends, waits for the client (a client-executed call), or ``timeout_s`` passes.

        Returns its view then. Raises JobNotFound (for another owner's job too, at once).
        """
        job = self.live(job_id, caller)
        if job is not None:
            await wait_for_end_or_client(job, timeout_s)
        return await self.view(job_id, caller)

    async def stop(self, job_id: str, caller: Caller) -> Body:
        """Stop the job (SIGTERM to its processes, SIGKILL after the grace); returns its view.

        Idempotent: on an ended job it only returns the final view. The answer is the saved final view (the one
        ``GET`` and ``wait`` serve), whatever ended the job: the script may have exited by itself first. It waits
        for the grace and the SIGKILL's confirmation; only a sandbox slower than that gets the live view.
        Raises JobNotFound (another owner's too).
        """
        job = self.live(job_id, caller)
        if job is not None:
            job.stop_requested.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.done.wait(), self._settings.stop_grace_s + KILL_CONFIRM_S + 1)
        return await self.view(job_id, caller)

    async def page(self, query: JobQuery) -> tuple[list[JobSummary], str | None]:
        """A page of jobs (newest first; only ``query.owner``'s unless it is None) and the next cursor.

        Raises InvalidCursor.
        """
        stored, cursor = await self._store.page(query)
        summaries = []
        for row in stored:
            live = self._live.get(row.job_id)
            if live is not None:
                view = live.view_dict()
                summaries.append(JobSummary.model_validate({**view, "calls": len(view["calls"])}))
            elif row.summary:
                summaries.append(JobSummary.model_validate_json(row.summary))
            else:  # saved before summaries were kept
                final = await self._encoded(row.job_id)
                summaries.append(JobSummary.model_validate({**final.head, "calls": len(final.spans)}))
        return summaries, cursor

    async def count(self) -> int:
        """Jobs in the store."""
        return await self._store.count()

    async def events(self, job_id: str, caller: Caller) -> AsyncIterator[tuple[str, Any]]:
        """Follow a job: yields ``(event, data)`` pairs, in order, until the job has ended.

        Events: ``status`` ``{"status"}`` on each change; ``stdout``/``stderr``
        ``{"offset", "text"}`` for each new piece of output (retained bytes);
        ``call`` with each call record (JSON bytes) once it has its outcome; finally ``end``
        with the final view (JSON bytes). A follower that joins late first gets everything
        so far. Raises JobNotFound (for another owner's job too).
        """
        job = self.live(job_id, caller)
        final = await self.final(job_id, caller) if job is None else None
        offsets = {"stdout": 0, "stderr": 0}
        sent = 0  # records before this index have all been sent
        sent_after: set[int] = set()  # indexes at or past ``sent`` already sent (they ended out of order)
        last_status = None
        while True:
            changed = job.changed() if job is not None else None
            if job is not None:
                head = job.view_dict()
                records: list[Any] = head["calls"]
                encoded: list[Any] = records
            else:
                assert final is not None
                head = final.head
                records = encoded = list(final.records())
            if head["status"] != last_status:
                last_status = head["status"]
                yield "status", {"status": last_status}
            for index in range(sent, len(records)):
                if index in sent_after or (job is not None and records[index]["status"] == "pending"):
                    continue
                sent_after.add(index)
                record = encoded[index]
                yield "call", views.encode_record(record) if isinstance(record, dict) else bytes(record)
            while sent in sent_after:
                sent_after.discard(sent)
                sent += 1
            ended = head["status"] in FINAL and (job is None or job.done.is_set())
            for stream in STREAMS:
                retained = head[f"{stream}_retained_bytes"]
                while offsets[stream] < retained:
                    data = await self.read_output(job_id, caller, stream, offsets[stream], 64 * 1024)
                    text, consumed, _ = decode_slice(data, final=ended and offsets[stream] + len(data) >= retained)
                    if not consumed:
                        break
                    yield stream, {"offset": offsets[stream], "text": text}
                    offsets[stream] += consumed
            if ended:
                end = final if final is not None else await self.final(job_id, caller)
                async with self._end_events.hold(len(end.body)):  # the end event is sent as one piece
                    yield "end", end.body
                return
            assert changed is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 15)
            if job is not None and job.done.is_set() and job_id not in self._live:
                job = None  # saved as ended: read the final view from the store
                final = await self._encoded(job_id)
