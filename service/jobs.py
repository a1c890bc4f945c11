"""Jobs: one script run, from request to terminal status (DESIGN.md, "Data flow of one execution").

``JobManager.submit`` checks a request, prepares the job's folder (script,
generated ``tools`` package, broker socket) and runs the job as a task: wait
for a sandbox slot, start the sandbox, enforce the wall-clock limit, then
remove the sandbox and the folder whatever happened. Jobs live in memory in
this version; the view of an ended job does not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from service.broker import Broker
from service.errors import EngineUnavailable, JobNotFound, RequestLimitError, SandboxError
from service.output import CappedStream
from service.sandbox.base import ExitStatus, SandboxBackend, SandboxHandle, SandboxSpec, Stream
from service.schemas import ExecuteRequest, JobView
from service.settings import Settings
from service.toolkit.endpoints import EndpointClients
from service.toolkit.manifest import ToolSpec, parse_manifest
from service.toolkit.stubs import generate_stub_module

log = logging.getLogger(__name__)

LABEL_INSTANCE = "io.ptc-sandbox.instance"
LABEL_JOB = "io.ptc-sandbox.job"
LABEL_MANAGED = "io.ptc-sandbox.managed"
KILL_WAIT_S = 30.0


@dataclass(frozen=True)
class ResolvedLimits:
    """A request's limits after defaults and server maxima were applied."""

    timeout_s: float
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
            raise RequestLimitError(
                f"{'.'.join(loc)} = {value} exceeds the server maximum of {maximum}", ("body", *loc)
            )
        return value

    return ResolvedLimits(
        timeout_s=pick(request.timeout_s, settings.default_timeout_s, settings.max_timeout_s, ("timeout_s",)),
        memory_mb=pick(limits.memory_mb, settings.default_memory_mb, settings.max_memory_mb, ("limits", "memory_mb")),
        cpus=pick(limits.cpus, settings.default_cpus, settings.max_cpus, ("limits", "cpus")),
        pids=pick(limits.pids, settings.default_pids, settings.max_pids, ("limits", "pids")),
        output_bytes=pick(
            limits.output_bytes, settings.default_output_bytes, settings.max_output_bytes, ("limits", "output_bytes")
        ),
        tmp_mb=pick(limits.tmp_mb, settings.default_tmp_mb, settings.max_tmp_mb, ("limits", "tmp_mb")),
    )


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Job:
    """One execution and everything the view shows of it."""

    id: str
    limits: ResolvedLimits
    metadata: dict[str, Any]
    stdout: CappedStream
    stderr: CappedStream
    status: str = "queued"
    exit_code: int | None = None
    error: dict[str, Any] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    calls_over_limit: int = 0
    created_at: datetime = field(default_factory=_now)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def sink(self, stream: Stream, data: bytes) -> None:
        """OutputSink for this job's sandbox."""
        (self.stdout if stream == "stdout" else self.stderr).write(data)

    def view(self) -> JobView:
        """The job as the API shows it now."""
        out, err = self.stdout.render(), self.stderr.render()
        duration = queue = None
        if self.started_at is not None:
            queue = round((self.started_at - self.created_at).total_seconds() * 1000, 3)
            if self.ended_at is not None:
                duration = round((self.ended_at - self.started_at).total_seconds() * 1000, 3)
        return JobView.model_validate(
            {
                "job_id": self.id,
                "status": self.status,
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
                "calls_over_limit": self.calls_over_limit,
                "error": self.error,
                "metadata": self.metadata,
                "created_at": self.created_at,
                "started_at": self.started_at,
                "ended_at": self.ended_at,
                "duration_ms": duration,
                "queue_ms": queue,
            }
        )


class JobManager:
    """Runs jobs in sandboxes, at most ``settings.concurrency()`` at once.

    Args:
        settings: service settings.
        backend: the sandbox backend.
        endpoints: shared endpoint clients used by every job's broker.
    """

    def __init__(self, settings: Settings, backend: SandboxBackend, endpoints: EndpointClients) -> None:
        self._settings = settings
        self._backend = backend
        self._endpoints = endpoints
        self._slots = asyncio.Semaphore(settings.concurrency())
        self._jobs: dict[str, Job] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._jobs_dir = settings.work_dir / "jobs"
        self._instance_labels = {LABEL_MANAGED: "1", LABEL_INSTANCE: settings.instance_id}

    async def start(self) -> None:
        """Sweep what a previous run of this instance left: its containers and job folders."""
        try:
            removed = await self._backend.remove_labelled(self._instance_labels)
        except SandboxError as exc:
            log.warning("could not sweep sandboxes of instance %s: %s", self._settings.instance_id, exc)
            removed = 0
        if removed:
            log.warning(
                "removed %d sandbox(es) left behind by an earlier run of instance %s",
                removed,
                self._settings.instance_id,
            )
        if self._jobs_dir.exists():
            shutil.rmtree(self._jobs_dir, ignore_errors=True)
        self._jobs_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self._settings.work_dir, 0o755)
        os.chmod(self._jobs_dir, 0o755)

    async def close(self) -> None:
        """Stop every job still running (each cleans up its sandbox) and wait for them."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def get(self, job_id: str) -> Job:
        """The job with this id; raises JobNotFound."""
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobNotFound(job_id) from None

    def submit(self, request: ExecuteRequest) -> Job:
        """Check ``request`` and start its job.

        Raises:
            ManifestError: a tool entry is unusable (names the entry and field).
            RequestLimitError: a limit exceeds its server maximum.
        """
        tools = parse_manifest(request.tools, ("body", "tools"))
        limits = resolve_limits(request, self._settings)
        job = Job(
            id="job_" + secrets.token_hex(12),
            limits=limits,
            metadata=request.metadata,
            stdout=CappedStream(limits.output_bytes),
            stderr=CappedStream(limits.output_bytes),
        )
        self._jobs[job.id] = job
        task = asyncio.create_task(self._run(job, request, tools), name=f"job {job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def _prepare_dir(self, job: Job, script: str, tools: dict[str, ToolSpec]) -> Path:
        job_dir = self._jobs_dir / job.id
        package = job_dir / "tools"
        package.mkdir(parents=True, mode=0o755)
        os.chmod(job_dir, 0o755)
        (package / "__init__.py").write_text(generate_stub_module(tools.values()), encoding="utf-8")
        (job_dir / "script.py").write_text(script, encoding="utf-8", errors="surrogatepass")
        for path in (package / "__init__.py", job_dir / "script.py"):
            os.chmod(path, 0o644)
        return job_dir

    async def _run(self, job: Job, request: ExecuteRequest, tools: dict[str, ToolSpec]) -> None:
        settings = self._settings
        broker = Broker(tools, self._endpoints, settings.max_tool_calls, settings.max_request_line_bytes)
        job.calls = broker.records
        handle: SandboxHandle | None = None
        job_dir: Path | None = None
        try:
            job_dir = await asyncio.to_thread(self._prepare_dir, job, request.script, tools)
            await broker.start(job_dir / "tools.sock")
            async with self._slots:
                spec = SandboxSpec(
                    image=settings.sandbox_image,
                    job_dir=job_dir,
                    memory_mb=job.limits.memory_mb,
                    cpus=job.limits.cpus,
                    pids=job.limits.pids,
                    tmp_mb=job.limits.tmp_mb,
                    file_size_mb=settings.file_size_mb,
                    open_files=settings.open_files,
                    env=request.env,
                    labels={**self._instance_labels, LABEL_JOB: job.id},
                    runtime=settings.runtime,
                )
                job.status, job.started_at = "running", _now()
                started = time.monotonic()
                handle = await self._backend.start(spec, job.sink)
                waiting = asyncio.ensure_future(self._backend.wait(handle))
                remaining = job.limits.timeout_s - (time.monotonic() - started)
                done, _ = await asyncio.wait({waiting}, timeout=max(remaining, 0))
                timed_out = not done
                if timed_out:
                    await self._backend.kill(handle)
                exit_status = await asyncio.wait_for(waiting, KILL_WAIT_S)
                self._finish(job, exit_status, timed_out, broker)
        except asyncio.CancelledError:
            job.status = "lost"
            job.error = {"type": "service_stopped", "message": "the service stopped while the job ran"}
            raise
        except SandboxError as exc:
            log.error("job %s: sandbox failure: %s", job.id, exc)
            job.status = "failed"
            kind = "engine_unavailable" if isinstance(exc, EngineUnavailable) else "sandbox_error"
            job.error = {"type": kind, "message": str(exc)}
        except Exception:
            log.exception("job %s: unexpected failure", job.id)
            job.status = "failed"
            job.error = {"type": "internal_error", "message": "the service failed to run the job; see its log"}
        finally:
            await self._cleanup(job, handle, broker, job_dir)

    def _finish(self, job: Job, exit_status: ExitStatus, timed_out: bool, broker: Broker) -> None:
        job.exit_code = exit_status.exit_code
        if timed_out:
            job.status = "timed_out"
            job.error = {
                "type": "timeout",
                "message": f"the script ran past timeout_s={job.limits.timeout_s:g} and was killed",
            }
        elif exit_status.oom_killed:
            job.status = "oom_killed"
            job.error = {
                "type": "oom",
                "message": f"the sandbox ran out of memory (limit {job.limits.memory_mb} MiB) "
                "and the kernel killed the script",
            }
        else:
            job.status = "succeeded" if exit_status.exit_code == 0 else "failed"
            job.error = broker.reported_error if exit_status.exit_code != 0 else None

    async def _cleanup(self, job: Job, handle: SandboxHandle | None, broker: Broker, job_dir: Path | None) -> None:
        if handle is not None:
            try:
                await asyncio.shield(self._backend.remove(handle))
            except Exception:
                log.exception("job %s: could not remove sandbox %s", job.id, handle.id[:12])
        with contextlib.suppress(Exception):
            await broker.close()
        job.calls_over_limit = broker.calls_over_limit
        if job_dir is not None:
            await asyncio.to_thread(shutil.rmtree, job_dir, True)
        job.ended_at = _now()
        if job.started_at is None:
            job.started_at = job.ended_at
        job.done.set()
