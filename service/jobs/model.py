"""The job model: statuses, the transitions between them, job errors and the end-of-run rules, in one place.

Lifecycle (every arrow is in ``TRANSITIONS``; ``Job.move`` refuses anything else)::

    queued --(slot, sandbox)--> running <--(client-executed calls wait / answered)--> waiting
      |                           |                                                     |
      |                           +--> succeeded | failed | timed_out | stopped | oom_killed | lost
      |                                                                                 |
      |                           (waiting ends like running: any final status) <------+
      +--> stopped (before it started) | failed (its sandbox could not start) | lost (the service stopped)

A ``lost`` job is one the service stopped (or died) under: ended at shut-down, or found unfinished in the
store at the next start-up. ``FINAL`` statuses never change again; ``LIVE`` ones are held in memory.

This module imports nothing else of the service: the store, schemas, logs and metrics import its names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol


class JobStatus(enum.StrEnum):
    """A job's status; the value is the string the API, the store and the logs use."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"  # its script waits for the answers of client-executed tool calls
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    STOPPED = "stopped"
    OOM_KILLED = "oom_killed"
    LOST = "lost"


LIVE: frozenset[JobStatus] = frozenset({JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.WAITING})
FINAL: frozenset[JobStatus] = frozenset(JobStatus) - LIVE

_RUN_ENDS = FINAL  # a running or waiting script can end any way at all
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.STOPPED, JobStatus.FAILED, JobStatus.LOST}),
    JobStatus.RUNNING: _RUN_ENDS | {JobStatus.WAITING},
    JobStatus.WAITING: _RUN_ENDS | {JobStatus.RUNNING},
    **{status: frozenset() for status in FINAL},
}


class ErrorType(enum.StrEnum):
    """The ``error.type`` values the service itself gives a job (a failed script's come from ``service.verdict``:
    ``nonzero_exit`` or its compile error's type)."""

    STOPPED = "stopped"  # stopped on request, or before it started
    SESSION_CLOSED = "session_closed"  # its session ended before its turn
    TIMEOUT = "timeout"
    OOM = "oom"
    SANDBOX_ERROR = "sandbox_error"  # the sandbox failed or was lost
    FILES_REFUSED = "files_refused"  # the sandbox could not write the request's files (its /tmp is full, ...)
    ENGINE_UNAVAILABLE = "engine_unavailable"
    INTERNAL_ERROR = "internal_error"  # the service failed (details in its log only)
    SERVICE_STOPPED = "service_stopped"  # the service stopped while the job ran
    SERVICE_RESTARTED = "service_restarted"  # found unfinished at start-up
    REPLICA_LOST = "replica_lost"  # its replica's lease passed (another replica marked it lost)
    CANCELLED = "cancelled"  # a tool call's error: the service stopped before it ended
    REPLAY_DIVERGED = "replay_diverged"  # resumed, its script made a call its call log does not hold


class IllegalTransition(Exception):
    """``Job.move`` was asked for a transition ``TRANSITIONS`` does not allow (a bug of the service).

    Not a ``service.errors.ServiceError``: no caller's request can cause it, and this module imports nothing.
    """

    def __init__(self, job_id: str, current: JobStatus, to: JobStatus) -> None:
        super().__init__(f"job {job_id}: {current} -> {to} is not an allowed transition")
        self.current, self.to = current, to


@dataclass(frozen=True)
class Failure:
    """Why a job did not succeed: ``type`` (an ``ErrorType`` or a verdict's type), a ``message`` for people,
    and an optional one-line ``hint``."""

    type: str
    message: str
    hint: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The view's ``error`` object (``hint`` only when there is one, as the API always gave it)."""
        error: dict[str, Any] = {"type": str(self.type), "message": self.message}
        if self.hint is not None:
            error["hint"] = self.hint
        return error


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(kw_only=True)
class Job:
    """A job's lifecycle record: identity, owner, status, exit code, error and times.

    ``status`` changes only through ``move`` (or ``end``), which refuses a transition ``TRANSITIONS`` does not
    allow. ``error`` is the view's ``error`` object (see ``Failure.as_dict`` and ``service.verdict``).
    """

    id: str
    owner: str  # the API key name that submitted it
    status: JobStatus = JobStatus.QUEUED
    exit_code: int | None = None
    error: dict[str, Any] | None = None
    created_at: datetime = field(default_factory=_now)
    started_at: datetime | None = None
    ended_at: datetime | None = None

    def move(self, to: JobStatus) -> None:
        """Change the status to ``to``; raises IllegalTransition when ``TRANSITIONS`` does not allow it."""
        if to not in TRANSITIONS[self.status]:
            raise IllegalTransition(self.id, self.status, to)
        self.status = to

    def end(self, to: JobStatus, error: Failure | dict[str, Any] | None) -> None:
        """Move to the final status ``to`` with ``error`` (None for a success); raises IllegalTransition."""
        if to not in FINAL:
            raise IllegalTransition(self.id, self.status, to)
        self.move(to)
        self.error = error.as_dict() if isinstance(error, Failure) else error

    @property
    def ended(self) -> bool:
        """Whether the status is final."""
        return self.status in FINAL


class RunExit(Protocol):
    """How the script's run ended, as the sandbox reports it (``service.sandbox.backend.ExitStatus``)."""

    @property
    def exit_code(self) -> int: ...
    @property
    def oom_killed(self) -> bool: ...
    @property
    def lost(self) -> str | None: ...
    @property
    def killed(self) -> bool: ...


EndedBy = Literal["stopped", "timed_out"]


def end_of_run(
    run: RunExit,
    ended_by: EndedBy | None,
    *,
    timeout_s: float,
    memory_mb: int,
    stop_reason: str | None = None,
    script_failure: dict[str, Any] | None = None,
) -> tuple[JobStatus, dict[str, Any] | None]:
    """The final status and error of a job whose script ran and ended as ``run`` says.

    Args:
        run: the sandbox's report of the exit.
        ended_by: what the service asked for, the first decided of a stop and the time limit (None: neither).
        timeout_s: the job's time limit (s), named in a timeout's message.
        memory_mb: the sandbox's memory limit (MiB), named in an OOM kill's message.
        stop_reason: why a stop was asked when not by ``POST /jobs/{id}/stop`` (e.g. its session ended).
        script_failure: the error of a non-zero exit the script made itself (``service.verdict.failure``).

    Returns:
        ``(status, error)``. The rules, first match wins: ``ended_by`` names the end only when the service's
        signal ended the script (``run.killed``) or the sandbox was lost (not by the OOM killer) after it was
        asked; then an OOM kill is ``oom_killed``; a lost sandbox ``failed`` (``sandbox_error``); exit 0
        ``succeeded``; any other exit ``failed`` with ``script_failure``. A stop or time limit that arrives as
        the script exits by itself never relabels that exit.
    """
    if not (run.killed or (run.lost is not None and not run.oom_killed)):
        ended_by = None  # the script ended by itself before the service's signal took effect
    if ended_by == "timed_out":
        message = f"the script ran past timeout_s={timeout_s:g} and was killed"
        return JobStatus.TIMED_OUT, Failure(ErrorType.TIMEOUT, message).as_dict()
    if ended_by == "stopped":
        return JobStatus.STOPPED, Failure(ErrorType.STOPPED, stop_reason or "stopped on request").as_dict()
    if run.oom_killed:
        message = f"the sandbox ran out of memory (limit {memory_mb} MiB) and the kernel killed the script"
        return JobStatus.OOM_KILLED, Failure(ErrorType.OOM, message).as_dict()
    if run.lost is not None:
        return JobStatus.FAILED, Failure(ErrorType.SANDBOX_ERROR, run.lost).as_dict()
    if run.exit_code == 0:
        return JobStatus.SUCCEEDED, None
    if script_failure is None:
        script_failure = {"type": "nonzero_exit", "message": f"the script exited with code {run.exit_code}"}
    return JobStatus.FAILED, script_failure


def stopped_before_start(reason: str | None = None) -> Failure:
    """The error of a job stopped while it waited for its slot, sandbox or turn."""
    return Failure(ErrorType.STOPPED, reason or "stopped before it started")


def session_closed(session_status: str, before_turn: bool) -> Failure:
    """The error of a job whose session ended (``session_status``) before or as its turn came."""
    when = " before this script's turn" if before_turn else ""
    return Failure(ErrorType.SESSION_CLOSED, f"the session ended ({session_status}){when}")


SERVICE_STOPPED = Failure(ErrorType.SERVICE_STOPPED, "the service stopped while the job ran")
INTERNAL_ERROR = Failure(ErrorType.INTERNAL_ERROR, "the service failed to run the job; see its log")
