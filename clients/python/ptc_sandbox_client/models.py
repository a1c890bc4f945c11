"""Wire models of the service's answers (docs/api.md, docs/views-and-events.md, docs/sessions.md).

Every model accepts fields it does not know (a newer service adds them) and keeps them (``model_extra``); a view
asked with ``fields=`` has only those fields, so every field but the id has a default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

ENDED_STATUSES = frozenset({"succeeded", "failed", "timed_out", "oom_killed", "stopped", "lost"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class CallError(_Model):
    """A tool call's error: ``type`` and ``message``."""

    type: str = ""
    message: str = ""


class CallRecord(_Model):
    """One broker record of a job's ``calls``; ``status``: ``ok``, ``error``, ``rejected``, ``timeout``, ``pending``."""

    seq: int | None = None
    call_id: str = ""
    tool: str = ""
    args: Any = None
    status: str = ""
    result: Any = None
    error: CallError | None = None
    repaired: Any = None
    repairs: list[str] = []
    attempts: int | None = None
    caller: str | None = None
    started_at: str | None = None
    duration_ms: float | None = None
    approval: dict[str, Any] | None = None


class PendingCall(_Model):
    """A call waiting for the caller: ``awaiting`` is ``client`` (answer it) or ``approval`` (approve or deny)."""

    call_id: str
    tool: str = ""
    args: Any = None
    awaiting: str = "client"


class OutputFile(_Model):
    """A file the script left in ``outputs/`` (``bytes``: size; served by ``GET /jobs/{id}/files/{path}``)."""

    path: str
    bytes: int = 0
    sha256: str = ""
    content_type: str = ""


class JobView(_Model):
    """The job view; ``status`` one of queued, running, waiting, succeeded, failed, timed_out, oom_killed, stopped,
    lost."""

    job_id: str
    status: str = ""
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_next_offset: int | None = None
    stderr_next_offset: int | None = None
    error: dict[str, Any] | None = None
    metadata: Any = None
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    duration_ms: float | None = None
    queue_ms: float | None = None
    session_id: str | None = None
    image: str | None = None
    language: str | None = None
    files: list[OutputFile] = []
    pending_calls: list[PendingCall] = []
    calls_total: int | None = None
    calls_by_status: dict[str, int] | None = None
    calls: list[CallRecord] | int | None = None
    callback: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        """Whether the status is final."""
        return self.status in ENDED_STATUSES

    @property
    def call_records(self) -> list[CallRecord]:
        """The call records (empty when asked with ``calls=none``)."""
        return self.calls if isinstance(self.calls, list) else []


class SessionView(_Model):
    """A session's view (docs/sessions.md)."""

    session_id: str
    status: str = ""
    metadata: Any = None
    image: str | None = None
    language: str | None = None
    created_at: str | None = None
    ended_at: str | None = None


class SessionFile(_Model):
    """An entry of a session's file list."""

    path: str
    bytes: int | None = None
    skipped: str | None = None


class Event(_Model):
    """One Server-Sent Event of ``GET /jobs/{id}/events``: ``event`` (``status``, ``stdout``, ``stderr``, ``call``,
    ``end``), ``id`` (opaque, for resuming) and ``data`` (the decoded JSON)."""

    event: str
    id: str | None = None
    data: Any = None

    @property
    def view(self) -> JobView | None:
        """The final job view of an ``end`` event."""
        return JobView.model_validate(self.data) if self.event == "end" and isinstance(self.data, dict) else None

    @property
    def call(self) -> CallRecord | None:
        """The record of a ``call`` event."""
        return CallRecord.model_validate(self.data) if self.event == "call" and isinstance(self.data, dict) else None


Stream = Literal["stdout", "stderr"]
