"""The jobs' request and response models: ``POST /execute``, the job view (``JobView``) and its parts, the
answers to a paused call, ``GET /jobs``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from service.egress import url_problem
from service.schemas.common import LANGUAGE_DESCRIPTION, Env, Files, Language, Limits, Metadata, utf8_text
from service.settings import MAX_SCRIPT_CHARS, MAX_TOOLS

# The values of ``service.jobs.model.JobStatus``, spelled out for the OpenAPI document (a unit test keeps them
# equal); named apart from the enum.
JobStatusValue = Literal[
    "queued", "running", "waiting", "succeeded", "failed", "timed_out", "stopped", "oom_killed", "lost"
]
CallStatus = Literal["pending", "ok", "error", "rejected", "timeout"]


class OutputFile(BaseModel):
    """A file the script left in outputs/ (served by GET /jobs/{id}/files/{path})."""

    path: str = Field(description="Relative to /tmp: outputs/...")
    bytes: int
    sha256: str = Field(description="Hex SHA-256 of the file's bytes.")
    content_type: str = Field(description="Guessed from the file's extension.")


class SkippedFile(BaseModel):
    """An entry of outputs/ not collected: a symlink, a fifo, a device, past a cap (reason ``cap``)."""

    path: str
    reason: str


class ExecuteRequest(BaseModel):
    """Body of ``POST /execute``."""

    model_config = ConfigDict(extra="forbid")

    script: str = Field(..., max_length=MAX_SCRIPT_CHARS, description="Source to run (UTF-8), in its language.")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, max_length=MAX_TOOLS, description="Tool manifest: one entry per tool."
    )
    toolset: str | None = Field(None, max_length=64, description="Id of a manifest registered with POST /toolsets.")
    timeout_s: float | None = Field(
        None, strict=True, gt=0, description="Wall-clock limit in seconds (default: server setting)."
    )
    wait_s: float | None = Field(
        None,
        strict=True,
        ge=0,
        description="How long to wait for the end before answering 202 with the job so far (s); 0 = at once.",
    )
    callback_url: str | None = Field(
        None, max_length=2048, description="Where to POST the final job view, signed (see docs/api.md, Callbacks)."
    )
    limits: Limits = Field(default_factory=Limits)
    language: Language | None = Field(
        None, description=LANGUAGE_DESCRIPTION + " With session_id: the session's, or absent."
    )
    image: str | None = Field(
        None,
        max_length=64,
        description="The sandbox image, by its name in PTC_IMAGES (GET /readyz lists them); default: default. With "
        "session_id: the session's, or absent.",
    )
    env: Env = Field(default_factory=dict, description="Extra environment variables for the script.")
    files: Files = Field(default_factory=list)
    metadata: Metadata = Field(default_factory=dict, description="Opaque; returned in the job view.")
    session_id: str | None = Field(
        None,
        max_length=64,
        description="Run in this session's sandbox (POST /sessions): after the session's earlier scripts, with "
        "its files; limits other than timeout_s and output_bytes are the session's. tools/toolset default to the "
        "session's; env adds to the session's.",
    )
    normalize: bool = Field(
        True,
        strict=True,
        description="Repair a script that does not compile (fences, wrappers, literal \\n; docs/normalization.md).",
    )
    durable: bool | None = Field(
        None,
        strict=True,
        description="Log every tool call in the job store and, if the service stops under the job, resume it by "
        "replaying its script against that log (docs/durability.md). Default: true for a one-shot job; a session's "
        "scripts are never durable (true with session_id is refused).",
    )

    @field_validator("script")
    @classmethod
    def _no_nul(cls, script: str) -> str:
        if "\x00" in script:
            raise ValueError("script contains a NUL character")
        return script

    @field_validator("callback_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.lower().startswith(("http://", "https://")):
            raise ValueError("callback_url must be an absolute http(s) URL")
        problem = url_problem(url) if url is not None else None
        if problem:
            raise ValueError(problem)
        return url


class ToolCallError(BaseModel):
    """Why a tool call did not return a result (``type`` as ``ToolError.type`` in the script)."""

    type: str
    message: str


class CallApproval(BaseModel):
    """Who decided on a call that needed approval, and when (``POST /jobs/{id}/calls/{call_id}/approve|deny``)."""

    decision: Literal["approved", "denied", "timed_out"]
    by: str | None = Field(description="The API key name that decided; null when the approval timed out.")
    at: datetime = Field(description="When the decision was made (or the approval timed out).")
    reason: str | None = Field(None, description="The approver's reason, if given.")


class CallRecord(BaseModel):
    """One tool call as the broker saw it (``service.broker.records``): its call record in the job view."""

    seq: int = Field(description="1-based, in order of arrival at the broker.")
    call_id: str
    tool: str = Field(description="The tool's original name.")
    args: Any = Field(description="The arguments as sent, with original parameter names.")
    status: CallStatus = Field(description="pending while the tool has not answered.")
    result: Any = None
    error: ToolCallError | None = None
    repaired: bool = Field(False, description="An argument sent as JSON text was parsed into the object it encodes.")
    repairs: list[str] = Field(
        default_factory=list,
        description="The call's repairs, by kind, in the order made: `positional_dict` (the stub bound a lone "
        "positional dict as the arguments; reported by the sandbox's stub), `json_text` (as `repaired`).",
    )
    caller: str = Field("code", description="Who made the call: the script's code.")
    attempts: int | None = Field(None, description="Attempts made, when an idempotent tool was retried.")
    started_at: datetime
    duration_ms: float | None = Field(description="Milliseconds from arrival to answer.")
    args_dropped_bytes: int | None = Field(
        None, description="Set when args were not kept (PTC_MAX_RECORD_BYTES reached): their size in bytes of JSON."
    )
    result_dropped_bytes: int | None = Field(
        None, description="Set when the result was not kept (PTC_MAX_RECORD_BYTES reached): its size in bytes of JSON."
    )
    approval: CallApproval | None = Field(
        None,
        description="The approval decision of a call that needed one (the tool's approval in the manifest); null "
        "for calls that needed none, and while (or if ever) a decision is awaited.",
    )


class ScriptRepair(BaseModel):
    """A repair made to the script before it ran (``service.normalize``)."""

    kind: Literal[
        "bom", "crlf", "fence", "tag_wrapper", "json_wrapper", "shell_wrapper", "literal_escapes", "tabs", "indent"
    ]
    detail: str


class ScriptReport(BaseModel):
    """What the in-sandbox runtime said of the script's uncaught exception: the script's claim, unverified."""

    type: str
    message: str | None = None
    line: int | None = None
    column: int | None = None
    text: str | None = None


class JobError(BaseModel):
    """Why a job did not succeed, as the service observed it: its compile's SyntaxError, a non-zero exit, a
    timeout, a stop, an OOM kill, a sandbox failure... (``service.verdict``)."""

    type: str
    message: str
    line: int | None = None
    column: int | None = None
    text: str | None = Field(None, description="The offending source line (SyntaxError).")
    hint: str | None = Field(None, description="SyntaxError: what mechanical cause was recognized, in one line.")
    script_report: ScriptReport | None = Field(
        None,
        description="The script's own report of its uncaught exception (the traceback's last line: type, message, "
        "line), as sent from inside the sandbox: unverified, a script can write anything here.",
    )


class PendingCall(BaseModel):
    """A call waiting for the harness: a client-executed call's answer (``POST /jobs/{id}/calls/{call_id}``) or a
    decision on a call that needs approval (``POST /jobs/{id}/calls/{call_id}/approve`` or ``/deny``)."""

    call_id: str
    tool: str
    args: Any = Field(description="The arguments, validated (and repaired, if they were).")
    awaiting: Literal["client", "approval"] = Field(
        "client", description="client: the client executes the call; approval: a human approves or denies it."
    )
    expires_at: datetime | None = Field(
        None,
        description="When the call stops waiting: the script then gets its timeout (approval_timeout for approvals).",
    )


class ApprovalDecision(BaseModel):
    """Body of ``POST /jobs/{id}/calls/{call_id}/approve`` and ``/deny`` (optional): the approver's reason; a
    denial's reaches the script in its ToolError's message."""

    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(None, max_length=2000)


class ClientAnswer(BaseModel):
    """Body of ``POST /jobs/{id}/calls/{call_id}``: exactly one of ``result`` (any JSON) or ``error``."""

    model_config = ConfigDict(extra="forbid")

    result: Any = None
    error: ToolCallError | None = None

    @field_validator("error")
    @classmethod
    def _utf8(cls, error: ToolCallError | None) -> ToolCallError | None:
        if error is not None:
            utf8_text(error.type, "error.type")
            utf8_text(error.message, "error.message")
        return error


class CallbackAttempt(BaseModel):
    """One delivery attempt of the completion callback."""

    at: datetime
    status_code: int | None = Field(description="The receiver's HTTP status; None when no answer came.")
    error: str | None = Field(description="Why the attempt failed; None when it succeeded (2xx).")
    duration_ms: float


class CallbackState(BaseModel):
    """Delivery of the job's completion callback."""

    url: str
    state: Literal["pending", "delivered", "failed"]
    attempts: list[CallbackAttempt]


class JobResume(BaseModel):
    """One resume of a durable job (docs/durability.md): when, why, and on which instance."""

    at: datetime
    reason: str = Field(
        description="drained: the job was parked when its service stopped (SIGTERM); service_restarted: the service "
        "was found dead under it (a crash, kill -9); replica_lost: another replica took it over from a dead one; "
        "answered: it was parked waiting for the harness and a call it waited for was answered; expired: likewise, "
        "and a call it waited for reached its expires_at."
    )
    instance: str = Field(description="The instance id (PTC_INSTANCE_ID) that resumed it.")


class JobView(BaseModel):
    """A job as the API shows it (``service.jobs.live.LiveJob.view_dict`` while live, then the saved view)."""

    job_id: str
    status: JobStatusValue
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
    calls_total: int = Field(0, description="Number of call records.")
    calls_by_status: dict[str, int] = Field(default_factory=dict, description="Call records per status.")
    calls_over_limit: int = Field(description="Calls refused without a record because the job reached its call limit.")
    error: JobError | None
    metadata: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    duration_ms: float | None = Field(description="Milliseconds from sandbox start to end.")
    queue_ms: float | None = Field(description="Milliseconds spent waiting for a sandbox slot (so far, while queued).")
    stdout_offset: int | None = Field(
        None, description="Set when the view was asked from a byte offset: stdout then holds the bytes from there."
    )
    stderr_offset: int | None = None
    stdout_next_offset: int = Field(0, description="Byte offset to ask from next to get only newer output.")
    stderr_next_offset: int = 0
    stdout_retained_bytes: int = Field(0, description="Bytes of stdout kept on disk (readable by offset).")
    stderr_retained_bytes: int = 0
    callback: CallbackState | None = None
    sandbox_start: Literal["warm", "cold", "session"] | None = Field(
        None,
        description="warm: the job ran in a sandbox from the warm pool; cold: in one started for it; "
        "session: in its session's sandbox.",
    )
    session_id: str | None = Field(None, description="The session the job ran in, if any.")
    image: str | None = Field(
        None, description="The name (in PTC_IMAGES) of the image the job ran in (null: saved before images were named)."
    )
    language: str = Field("python", description="The script's language: python, javascript or typescript.")
    sandbox_id: str | None = Field(None, description="The engine's id of the job's container (12 hex digits).")
    owner: str | None = Field(
        None,
        description="The API key name that created the job (anonymous without auth; null: saved before owners "
        "were recorded). A completion callback's body names it too.",
    )
    trace_id: str | None = Field(
        None,
        description="The OpenTelemetry trace id of the job (32 hex digits): the trace of the POST /execute that "
        "submitted it (of its traceparent header, when one came). Null when tracing is off (docs/telemetry.md).",
    )
    pending_calls: list[PendingCall] = Field(
        default_factory=list,
        description="Calls waiting for the harness: client-executed calls and calls awaiting approval (status is "
        "then waiting).",
    )
    normalization: list[ScriptRepair] = Field(
        default_factory=list, description="Repairs made to the script before it ran (empty: it ran as sent)."
    )
    ran_as_coroutine: bool = Field(
        False,
        description="The script had top-level await and ran as a coroutine in a new event loop (as the runtime "
        "inside the sandbox reported: unverified).",
    )
    original_script: str | None = Field(None, description="With repairs: the script as sent.")
    normalized_script: str | None = Field(None, description="With repairs: the script that ran.")
    files: list[OutputFile] = Field(
        default_factory=list, description="The files the script left in outputs/ (docs/files.md)."
    )
    files_omitted: int = Field(0, description="Entries of outputs/ not collected (past a cap, not regular files).")
    files_skipped: list[SkippedFile] = Field(
        default_factory=list, description="The first 100 entries not collected, with why."
    )
    durable: bool = Field(
        False, description="Its tool calls are logged and it resumes by replay if the service stops under it."
    )
    resumes: list[JobResume] = Field(default_factory=list, description="Each time the job was resumed, in order.")
    parked_at: datetime | None = Field(
        None,
        description="When the job was parked (null: it is not parked): its sandbox is released; it waits for the "
        "pending_calls listed (an answer resumes it by replay) or, parked by a draining service, for the next start.",
    )
    active_ms: float = Field(
        0.0, description="Time the job's runs have taken so far, parked time excluded: what its timeout_s bounds (ms)."
    )


class CallSummary(BaseModel):
    """A call record as ``?calls=summary`` shows it (``views.render.SUMMARY_FIELDS``): no arguments, no result."""

    seq: int
    call_id: str
    tool: str
    status: CallStatus
    error: ToolCallError | None
    duration_ms: float | None
    approval: CallApproval | None


def _selected_view() -> type[BaseModel]:
    """``JobView`` with every field but ``job_id`` and ``status`` optional and ``calls`` holding records or
    summaries: the shape of a view under ``?calls=summary|none`` or ``?fields=`` (documentation only)."""
    fields: dict[str, Any] = {}
    for name, info in JobView.model_fields.items():
        annotation = info.annotation
        if name == "calls":
            annotation = list[CallRecord | CallSummary]
        required = name in ("job_id", "status")
        fields[name] = (annotation, Field(... if required else None, description=info.description))
    return create_model(
        "JobViewSelection",
        __doc__="A job view as ?calls=summary|none and ?fields= select it: job_id and status always; any other "
        "field of JobView when selected (calls absent under calls=none, summaries under calls=summary).",
        **fields,
    )


JobViewSelection = _selected_view()


class JobSummary(BaseModel):
    """A job in a listing (no output, no calls)."""

    job_id: str
    status: JobStatusValue
    exit_code: int | None
    error: JobError | None
    metadata: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    duration_ms: float | None
    calls: int = Field(description="Number of call records.")
    owner: str | None = Field(None, description="The API key name that created the job (null: legacy).")


class JobList(BaseModel):
    """A page of ``GET /jobs``, newest first."""

    jobs: list[JobSummary]
    next_cursor: str | None = Field(description="Pass as cursor for the next page; None on the last page.")
