"""Request and response models of the HTTP API (DESIGN.md, "HTTP API")."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SCRIPT_CHARS = 1024 * 1024
MAX_TOOLS = 1000
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_RESERVED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PTC_")

JobStatus = Literal["queued", "running", "waiting", "succeeded", "failed", "timed_out", "stopped", "oom_killed", "lost"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "timed_out", "stopped", "oom_killed", "lost"})
CallStatus = Literal["ok", "error", "rejected", "timeout"]


class Limits(BaseModel):
    """Per-request sandbox limits; each may be lowered freely or raised up to the server's ``max_*`` setting."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(None, ge=16, description="Memory in MiB (swap is not added).")
    cpus: float | None = Field(None, gt=0, description="CPU quota in CPUs.")
    pids: int | None = Field(None, ge=8, description="Maximum processes and threads.")
    output_bytes: int | None = Field(None, ge=1024, description="Inline cap per stream in bytes (head and tail kept).")
    tmp_mb: int | None = Field(None, ge=1, description="Size of the tmpfs /tmp in MiB.")


class ExecuteRequest(BaseModel):
    """Body of ``POST /execute``."""

    model_config = ConfigDict(extra="forbid")

    script: str = Field(..., max_length=MAX_SCRIPT_CHARS, description="Python source to run (UTF-8).")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, max_length=MAX_TOOLS, description="Tool manifest: one entry per tool."
    )
    timeout_s: float | None = Field(None, gt=0, description="Wall-clock limit in seconds (default: server setting).")
    limits: Limits = Field(default_factory=Limits)
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the script.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Opaque; returned in the job view.")

    @field_validator("script")
    @classmethod
    def _no_nul(cls, script: str) -> str:
        if "\x00" in script:
            raise ValueError("script contains a NUL character")
        return script

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not a valid name")
            if name.startswith(_RESERVED_ENV):
                raise ValueError(f"environment variable {name!r} is reserved by the sandbox runtime")
            if "\x00" in value:
                raise ValueError(f"environment variable {name!r} contains a NUL character")
        return env


class ToolCallError(BaseModel):
    """Why a tool call did not return a result (``type`` as ``ToolError.type`` in the script)."""

    type: str
    message: str


class CallRecord(BaseModel):
    """One tool call as the broker saw it (DESIGN.md, "Call record")."""

    seq: int = Field(description="1-based, in order of arrival at the broker.")
    call_id: str
    tool: str = Field(description="The tool's original name.")
    args: Any = Field(description="The arguments as sent, with original parameter names.")
    status: CallStatus
    result: Any = None
    error: ToolCallError | None = None
    started_at: datetime
    duration_ms: float | None = Field(description="Milliseconds from arrival to answer.")


class JobError(BaseModel):
    """Why a job did not succeed: the script's uncaught exception, or the service's reason."""

    type: str
    message: str
    line: int | None = None
    column: int | None = None
    text: str | None = Field(None, description="The offending source line (SyntaxError).")


class JobView(BaseModel):
    """A job as the API shows it (DESIGN.md, "Job view")."""

    job_id: str
    status: JobStatus
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int = Field(description="Bytes the script wrote to stdout in all (not only those shown).")
    stderr_bytes: int
    stdout_invalid_utf8: bool = Field(description="Bytes that were not UTF-8 were shown as U+FFFD.")
    stderr_invalid_utf8: bool
    calls: list[CallRecord]
    calls_over_limit: int = Field(description="Calls refused without a record because the job reached its call limit.")
    error: JobError | None
    metadata: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    duration_ms: float | None = Field(description="Milliseconds from sandbox start to end.")
    queue_ms: float | None = Field(description="Milliseconds spent waiting for a sandbox slot.")
