"""A job while the service holds it in memory (``LiveJob``), its resolved limits, and the store's row of a view.

Output bytes of a job are kept on disk under ``work_dir/output/<job_id>/`` (see ``service.output.OutputLog``)
for offset reads; the folder's marks (``service.jobs.marks``) say whose output budget they count against and, once the
job has ended, how many bytes the job keeps in the store (its call records' arguments and results, its stored view
and summary), which count against it too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span

from service.broker import Broker
from service.engines import CONTAINER, PYTHON
from service.errors import EngineUnavailable, FileRefused, RequestLimitError, SandboxError
from service.files import FileBudget, OutputFiles
from service.jobs.marks import mark_stored
from service.jobs.model import INTERNAL_ERROR, SERVICE_STOPPED, ErrorType, Failure, Job, JobStatus
from service.normalize import Normalized, view_fields
from service.output import OutputLog
from service.sandbox.backend import Stream
from service.sandbox.images import image_name
from service.schemas.job_models import ExecuteRequest, JobSummary, JobView
from service.settings import DEFAULT_IMAGE, KeyLimits, Settings
from service.store import JobStore, StoredJob

if TYPE_CHECKING:
    from service.views.render import ViewCache

log = logging.getLogger(__name__)

STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
SUMMARY_FIELDS = tuple(name for name in JobSummary.model_fields if name != "calls")  # all are the view's too
SLICE_BYTES = 1024 * 1024  # the most bytes of a stream read into memory at once
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


def resolve_limits(request: ExecuteRequest, settings: Settings, key: KeyLimits | None = None) -> ResolvedLimits:
    """Apply the defaults of the request's image (``Settings.image_defaults_of``: its ``PTC_IMAGE_DEFAULTS`` over
    ``PTC_DEFAULT_*``), lowered to ``key``'s maxima (``PTC_KEY_LIMITS``) when given, and check the server maxima.

    Raises:
        UnknownImage: ``request.image`` is not a name in ``PTC_IMAGES``.
        RequestLimitError: naming the field that exceeds its server maximum.
    """
    limits = request.limits
    defaults = settings.image_defaults_of(image_name(settings, request.image))

    def pick(value: Any, name: str, maximum: Any, loc: tuple[str, ...]) -> Any:
        if value is None:
            default = defaults[name]
            ceiling = getattr(key, name, None) if key is not None else None
            return default if ceiling is None else min(default, ceiling)
        if value > maximum:
            raise RequestLimitError(f"{value} exceeds the server maximum of {maximum}", ("body", *loc))
        return value

    return ResolvedLimits(
        timeout_s=pick(request.timeout_s, "timeout_s", settings.max_timeout_s, ("timeout_s",)),
        wait_s=pick(request.wait_s, "wait_s", settings.max_wait_s, ("wait_s",)),
        memory_mb=pick(limits.memory_mb, "memory_mb", settings.max_memory_mb, ("limits", "memory_mb")),
        cpus=pick(limits.cpus, "cpus", min(settings.max_cpus, os.cpu_count() or 1), ("limits", "cpus")),
        pids=pick(limits.pids, "pids", settings.max_pids, ("limits", "pids")),
        output_bytes=pick(limits.output_bytes, "output_bytes", settings.max_output_bytes, ("limits", "output_bytes")),
        tmp_mb=pick(limits.tmp_mb, "tmp_mb", settings.max_tmp_mb, ("limits", "tmp_mb")),
    )


def now() -> datetime:
    """The current time (UTC)."""
    return datetime.now(UTC)


def ms(start: datetime | None, end: datetime | None) -> float | None:
    """Milliseconds from ``start`` to ``end`` (3 decimals); None when either is missing."""
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
    stored: asyncio.Event = field(default_factory=asyncio.Event)  # its first save is done (or its run ended)
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)  # set while client calls wait for answers
    broker: Broker | None = None
    sandbox_start: str | None = None  # "warm" (from the pool), "cold" or "session"
    sandbox_id: str | None = None  # the engine's container id, once the job has one
    session_id: str | None = None  # the session it runs in (not counted in the admission of one-shot jobs)
    image: str = DEFAULT_IMAGE  # the name (in PTC_IMAGES) of its sandbox's image
    engine: str = CONTAINER  # the name of the script engine that runs it (``service.engines``); not in its view
    language: str = PYTHON  # its script's language (``service.engines``: ``PYTHON``, ``JAVASCRIPT``, ``TYPESCRIPT``)
    stop_reason: str | None = None  # why a stop was asked, when not by POST /jobs/{id}/stop
    normalized: Normalized | None = None  # the script's normalization (no repairs when switched off)
    output_files: OutputFiles | None = None  # what the script left in outputs/, once its run began
    output_budget: FileBudget | None = None  # what its owner may still keep on disk (output and files)
    record_bytes: int = 0  # bytes of args and results its call records keep (``CallRecords.kept_bytes``), once ended
    stored_bytes: int | None = None  # what it keeps in the store in all, counted once its final row was made
    durable: bool = False  # its calls are logged and it resumes by replay (``service.broker.durable``)
    resumes: list[dict[str, Any]] = field(default_factory=list)  # the view's ``resumes``: at, reason, instance
    diverged: Failure | None = None  # its replay diverged from its call log: it ends ``failed`` with this
    hash_seed: int | None = None  # its interpreter's string-hash seed, once its sandbox has one (a replay's too)
    parking: bool = False  # the service is stopping: a durable job is parked (left unfinished for a resume), not lost
    park_reserved: bool = False  # a place among the parked jobs is reserved for it (``ParkedJobs.reserve``)
    spec_kept: bool = False  # its run spec is in the store (``service.jobs.durability.keep_spec``)
    parked_at: datetime | None = None  # when it was parked
    parked_calls: list[dict[str, Any]] = field(default_factory=list)  # the calls it waits for while parked
    active_s: float = 0.0  # seconds its earlier runs took (parked time excluded): its timeout_s counts them too
    run_began: float | None = None  # monotonic time its current run's time limit began, while it runs
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    saving: asyncio.Lock = field(default_factory=asyncio.Lock)  # saves reach the store in the order they began
    status_save_queued: bool = False  # a status save waits to take its view: status changes meanwhile ride on it
    status_saved_at: float = 0.0  # loop time of the last status save (``StatusSaves``)
    span: Span | None = (
        None  # its trace span, from admission to its end (``service.observability.telemetry``; None: tracing off)
    )
    trace_id: str | None = None  # the trace id of ``span`` (32 hex digits), kept in its view

    def script(self, request: ExecuteRequest) -> str:
        """The script to run: the request's, as normalization left it."""
        return self.normalized.script if self.normalized is not None else request.script

    def sink(self, stream: Stream, data: bytes) -> None:
        """OutputSink for this job's run (called on the event loop, by its sandbox's control reader)."""
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
            "duration_ms": ms(started, self.ended_at),
            "queue_ms": ms(self.created_at, started or (None if self.ended_at else now())),
            "stdout_next_offset": out.total_bytes,
            "stderr_next_offset": err.total_bytes,
            "stdout_retained_bytes": self.stdout.retained_bytes,
            "stderr_retained_bytes": self.stderr.retained_bytes,
            "callback": {"url": self.callback_url, "state": "pending", "attempts": []} if self.callback_url else None,
            "pending_calls": self.parked_calls
            if self.parked_at is not None
            else (self.broker.paused.pending_calls if self.broker is not None else []),
            "sandbox_start": self.sandbox_start,
            "sandbox_id": self.sandbox_id,
            "session_id": self.session_id,
            "image": self.image,
            "language": self.language,
            "owner": self.owner,
            "trace_id": self.trace_id,
            "ran_as_coroutine": self.ran_as_coroutine
            or (self.broker is not None and self.broker.records.ran_as_coroutine),
            **view_fields(self.normalized),
            **self.files_view(),
            "durable": self.durable,
            "resumes": self.resumes,
            "parked_at": self.parked_at,
            "active_ms": round(self.active_time() * 1000, 3),
        }

    def active_time(self) -> float:
        """Seconds its runs have taken so far, parked time excluded (what its ``timeout_s`` bounds)."""
        began = self.run_began
        return self.active_s + (time.monotonic() - began if began is not None else 0.0)

    def files_view(self) -> dict[str, Any]:
        """The view's ``files``, ``files_omitted`` and ``files_skipped`` (only files complete so far)."""
        collected = self.output_files
        if collected is None:
            return {"files": [], "files_omitted": 0, "files_skipped": []}
        done = [dict(f) for f in collected.files if f["sha256"]]
        return {"files": done, "files_omitted": collected.omitted, "files_skipped": list(collected.skipped)}


async def note_stored_bytes(job: LiveJob, row: StoredJob) -> None:
    """Count what the ended job keeps in the store against its owner's output budget, once (before the final
    row is saved: from then on the job may be purged): its call records' arguments and results (taken already,
    ``job.record_bytes``) and the rest of ``row`` (its view, with the script, metadata and inline output, and its
    summary), charged even past the quota (a finished result is never dropped; the owner's next job is refused
    until a purge gives bytes back). The total is marked on the job's output folder (``marks.mark_stored``: one
    attribute, written on the loop), which the purge gives back. Failures to write it are logged."""
    if job.stored_bytes is not None:
        return  # counted at the first attempt of its final save
    rest = max(len(row.view) + len(row.summary) - job.record_bytes, 0)
    if job.output_budget is not None:
        job.output_budget.charge(rest)
    job.stored_bytes = job.record_bytes + rest
    try:
        mark_stored(job.output_dir, job.stored_bytes)
    except OSError:
        log.exception("job %s: could not note the bytes it keeps in the store", job.id)


async def wait_for_end_or_client(job: LiveJob, timeout_s: float) -> None:
    """Return when the job ends, when it waits on a client-executed call, or after ``timeout_s``."""
    ended = asyncio.ensure_future(job.done.wait())
    waiting = asyncio.ensure_future(job.waiting.wait())
    try:
        await asyncio.wait({ended, waiting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        waiting.cancel()


async def unless_ending(job: LiveJob | None) -> LiveJob | None:
    """``job`` while its live view may be served (not ended); None, once its final view is saved, for a job whose final
    status is set: the runner sets it, then saves the final view, and only then tells anyone (``Runner._cleanup``), so
    a read in between waits for the save (a live view saying ``succeeded`` would tell the end before it is saved)."""
    if job is not None and job.ended:
        await job.done.wait()
        return None
    return job


class LiveJobs(Mapping[str, LiveJob]):
    """The jobs this service holds in memory, by id: the one owner of the set.

    Admission ``add``s a job when it admits it; the runner ``remove``s it once its final view is saved (from then
    on it is read from the store). Every other part (views, sessions, progress saves, the ``ptc_jobs`` gauge)
    only reads it, as a ``Mapping``. Used from the event loop only.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, LiveJob] = {}

    def __getitem__(self, job_id: str) -> LiveJob:
        return self._jobs[job_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: LiveJob) -> None:
        """Hold ``job`` (admitted, not saved as ended yet)."""
        self._jobs[job.id] = job

    def remove(self, job_id: str) -> None:
        """Let the job go (its final view is saved); nothing if it is not held."""
        self._jobs.pop(job_id, None)


def end_by_failure(job: LiveJob, exc: BaseException) -> None:
    """Set the status and error of a job whose run raised ``exc`` (the service stopping included)."""
    if isinstance(exc, asyncio.CancelledError):
        if not job.ended:
            job.end(JobStatus.LOST, SERVICE_STOPPED)
    elif isinstance(exc, FileRefused):
        if not job.ended:
            job.end(JobStatus.FAILED, Failure(ErrorType.FILES_REFUSED, str(exc)))
    elif isinstance(exc, SandboxError):
        log.error("job %s: sandbox failure: %s", job.id, exc)
        kind = ErrorType.ENGINE_UNAVAILABLE if isinstance(exc, EngineUnavailable) else ErrorType.SANDBOX_ERROR
        if not job.ended:
            job.end(JobStatus.FAILED, Failure(kind, str(exc)))
    elif isinstance(exc, Exception):
        log.exception("job %s: unexpected failure", job.id, exc_info=exc)
        if not job.ended:
            job.end(JobStatus.FAILED, INTERNAL_ERROR)


def stored_job(head: dict[str, Any], calls: int, body: bytes, instance_id: str) -> StoredJob:
    """The store's row for a job view: ``body`` (its JSON), its columns, summary and callback flag from ``head``
    (the view's fields but its calls) and ``calls`` (how many records it holds)."""
    model = JobView.model_validate({**head, "calls": [], "pending_calls": []})
    fields = {name: getattr(model, name) for name in SUMMARY_FIELDS}  # typed already: not the whole view dumped
    summary = JobSummary.model_validate({**fields, "calls": calls})
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


async def save_final_again(
    store: JobStore,
    save: Callable[[StoredJob], Awaitable[object]],
    cache: ViewCache,
    job_id: str,
    instance_id: str,
    render: Callable[[], Awaitable[None]],
) -> None:
    """One more attempt at saving an ended job's final view that the store refused (``Runner``), through ``save``
    (the replica's fenced save: ``Replicas.save``).

    Nothing when the store holds an ended view already: a later save (its callback's delivery) got there first,
    and must not be undone by this older one. Else the view readers see (the view cache's, its callback's state
    included), or, when the cache dropped it, ``render()`` (the runner's save of the job's own view).
    """
    stored = await store.jobs.get(job_id)
    if stored is not None and stored.ended_at is not None:
        return
    kept = cache.get(job_id)
    if kept is None:
        return await render()
    await save(stored_job(kept.head, len(kept.spans), kept.body, instance_id))
