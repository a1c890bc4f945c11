"""Request and response models of the HTTP API (each route's body and answer; served as ``/openapi.json``)."""

from __future__ import annotations

import base64
import binascii
import math
import re
from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from ptc_runtime.files import check_path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from service.egress import header_problem, url_problem
from service.settings import MAX_SCRIPT_CHARS, MAX_TOOLS
from service.toolkit.schema import json_depth

MAX_METADATA_DEPTH = 32
MAX_METADATA_BYTES = 64 * 1024
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# PYTHON*: read by the interpreter as it starts, which a sandbox's resident interpreter did before the job came
# (and some, e.g. PYTHONMALLOC, could stop it); LD_*: read by the dynamic loader, likewise; PTC_*: the runtime's.
_RESERVED_ENV = ("PYTHON", "LD_", "PTC_")

# The values of ``service.jobs.model.JobStatus``, spelled out for the OpenAPI document (a unit test keeps them
# equal); named apart from the enum.
JobStatusValue = Literal[
    "queued", "running", "waiting", "succeeded", "failed", "timed_out", "stopped", "oom_killed", "lost"
]
CallStatus = Literal["pending", "ok", "error", "rejected", "timeout"]


def _has_non_finite(value: Any) -> bool:
    """Whether a JSON-like value holds a float NaN or infinity anywhere (walked without recursion)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def check_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` if it is small JSON (size and depth caps); raises ValueError otherwise.

    The size first (orjson, in C): the depth walk, in Python, then only sees at most ``MAX_METADATA_BYTES``.
    """
    try:
        encoded = orjson.dumps(metadata)
    except orjson.JSONEncodeError as exc:
        raise ValueError(f"metadata cannot be stored as JSON: {exc}") from None
    size = len(encoded)
    if b"null" in encoded and size <= MAX_METADATA_BYTES and _has_non_finite(metadata):
        # orjson writes NaN and infinities (which the request reader lets through, 1e400 included) as null
        raise ValueError("metadata cannot be stored as JSON: NaN or an infinity (a number out of range of a double)")
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes of JSON")
    if json_depth(metadata, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
    return metadata


def check_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` if every name is valid and not reserved by the runtime; raises ValueError otherwise."""
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r} is not a valid name")
        if name.startswith(_RESERVED_ENV):
            raise ValueError(
                f"environment variable {name!r} is reserved: PYTHON*, LD_* and PTC_* variables act when the "
                "interpreter starts, before a script's env applies"
            )
        if "\x00" in value:
            raise ValueError(f"environment variable {name!r} contains a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"environment variable {name!r} is not valid UTF-8 (a lone surrogate)") from None
    return env


Env = Annotated[dict[str, str], AfterValidator(check_env)]
Metadata = Annotated[dict[str, Any], AfterValidator(check_metadata)]


class Limits(BaseModel):
    """Per-request sandbox limits; each may be lowered freely or raised up to the server's ``max_*`` setting."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(None, strict=True, ge=16, description="Memory in MiB (swap is not added).")
    cpus: float | None = Field(
        None, strict=True, ge=0.01, description="CPU quota in CPUs (at most the host's CPU count)."
    )
    pids: int | None = Field(None, strict=True, ge=8, description="Maximum processes and threads.")
    output_bytes: int | None = Field(
        None, strict=True, ge=1024, description="Inline cap per stream in bytes (head and tail kept)."
    )
    tmp_mb: int | None = Field(None, strict=True, ge=1, description="Size of the tmpfs /tmp in MiB.")


class FileIn(BaseModel):
    """One file written under the sandbox's working directory (/tmp) before the script starts (docs/files.md)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        ...,
        max_length=1024,
        description="Relative to /tmp: no '..', not absolute, no NUL, not under outputs/ (at most 16 components).",
    )
    content: str | None = Field(None, description="The file as UTF-8 text (or content_base64).")
    content_base64: str | None = Field(None, description="The file's bytes, base64 (standard alphabet, padded).")

    @field_validator("path")
    @classmethod
    def _safe_path(cls, path: str) -> str:
        return check_path(path)

    @model_validator(mode="after")
    def _one_content(self) -> FileIn:
        if (self.content is None) == (self.content_base64 is None):
            raise ValueError("give exactly one of content and content_base64")
        if self.content_base64 is not None:
            try:
                base64.b64decode(self.content_base64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"content_base64 is not base64: {exc}") from None
        if self.content is not None:
            try:
                self.content.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("content is not UTF-8 text (lone surrogates): send content_base64") from None
        return self

    def data(self) -> bytes:
        """The file's bytes."""
        if self.content is not None:
            return self.content.encode("utf-8")
        return base64.b64decode(self.content_base64 or "", validate=True)

    def size(self) -> int:
        """The file's size in bytes (decoded), without decoding it."""
        if self.content is not None:
            return len(self.content.encode("utf-8"))
        text = (self.content_base64 or "").rstrip("=")
        return len(text) * 3 // 4


Files = Annotated[
    list[FileIn],
    Field(
        description="Files written under /tmp before the script starts (docs/files.md); at most PTC_MAX_FILES files "
        "and PTC_MAX_FILES_BYTES bytes (413)."
    ),
]


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


class SessionFile(BaseModel):
    """A file written by PUT /sessions/{id}/files/{path}."""

    path: str
    bytes: int
    sha256: str = Field(description="Hex SHA-256 of the bytes written.")


class SessionFileEntry(BaseModel):
    """An entry under a session's /tmp."""

    path: str
    bytes: int | None = Field(description="Its size; null for an entry that is not a regular file.")
    skipped: str | None = Field(None, description="Why it is not a regular file (symlink, not a regular file, ...).")


class SessionFileList(BaseModel):
    """Answer of GET /sessions/{id}/files."""

    files: list[SessionFileEntry]
    truncated: bool = Field(description="More entries than PTC_MAX_FILES_LISTED: the rest are not listed.")


class ExecuteRequest(BaseModel):
    """Body of ``POST /execute``."""

    model_config = ConfigDict(extra="forbid")

    script: str = Field(..., max_length=MAX_SCRIPT_CHARS, description="Python source to run (UTF-8).")
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


class SessionRequest(BaseModel):
    """Body of ``POST /sessions``."""

    model_config = ConfigDict(extra="forbid")

    limits: Limits = Field(
        default_factory=Limits, description="The session sandbox's limits (output_bytes: per script)."
    )
    runtime: str | None = Field(
        None, max_length=64, description="OCI runtime (e.g. runsc); one of PTC_SESSION_RUNTIMES; default: the server's."
    )
    image: str | None = Field(
        None,
        max_length=64,
        description="The session sandbox's image, by its name in PTC_IMAGES; default: default.",
    )
    tools: list[dict[str, Any]] = Field(
        default_factory=list, max_length=MAX_TOOLS, description="Manifest for the session's scripts (default)."
    )
    toolset: str | None = Field(None, max_length=64, description="Id of a manifest registered with POST /toolsets.")
    env: Env = Field(default_factory=dict, description="Environment variables of every script.")
    files: Files = Field(default_factory=list)
    idle_timeout_s: float | None = Field(
        None, strict=True, gt=0, description="End the session after this long without a script (s; default 300)."
    )
    max_lifetime_s: float | None = Field(
        None,
        strict=True,
        gt=0,
        description="End the session this long after its creation, busy or not (s; default 3600).",
    )
    metadata: Metadata = Field(default_factory=dict, description="Opaque; returned in the session view.")


class SessionLimits(BaseModel):
    """A session sandbox's limits, after defaults."""

    memory_mb: int
    cpus: float
    pids: int
    tmp_mb: int
    output_bytes: int


class SessionView(BaseModel):
    """A session as the API shows it."""

    session_id: str
    status: Literal["ready", "busy", "closed", "expired", "broken"] = Field(
        description="busy while a script runs or waits; closed (deleted), expired, broken: ended, sandbox removed."
    )
    error: JobError | None = Field(description="Why the session ended, when it did not end by DELETE.")
    created_at: datetime
    last_used_at: datetime = Field(description="When its last script ended (or its creation).")
    ended_at: datetime | None
    expires_at: datetime | None = Field(description="When it will expire if unused; None once ended.")
    idle_timeout_s: float
    max_lifetime_s: float
    limits: SessionLimits
    runtime: str | None
    image: str = Field("default", description="The name (in PTC_IMAGES) of the session sandbox's image.")
    executions: int = Field(description="Scripts that ran in it.")
    queued: int = Field(description="Scripts waiting for their turn.")
    current_job_id: str | None = Field(description="The job running now.")
    sandbox_id: str | None = Field(description="The engine's id of the session's container (12 hex digits).")
    metadata: dict[str, Any]
    owner: str | None = Field(None, description="The API key name that created it (anonymous without auth).")


class SessionList(BaseModel):
    """Answer of ``GET /sessions``: the live sessions, oldest first."""

    sessions: list[SessionView]


class McpServer(BaseModel):
    """An MCP server whose tools a toolset takes over (discovered with ``tools/list`` at registration)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048, description="Streamable HTTP endpoint, e.g. http://127.0.0.1:8765/mcp")
    headers: dict[str, str] = Field(default_factory=dict, description="Sent with every request; stay on the host.")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Limit of one call (s).")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.lower().startswith(("http://", "https://")):
            raise ValueError("url must be an absolute http(s) URL")
        problem = url_problem(url)
        if problem:
            raise ValueError(problem)
        return url

    @field_validator("headers")
    @classmethod
    def _allowed_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            problem = header_problem(name)
            if problem:
                raise ValueError(problem)
        return headers


class ManifestRequest(BaseModel):
    """Body of ``POST /stubs`` and ``POST /toolsets``: a manifest, or (for /stubs) a registered toolset."""

    model_config = ConfigDict(extra="forbid")

    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_TOOLS)
    toolset: str | None = Field(None, max_length=64, description="Id from POST /toolsets (instead of tools).")
    mcp_servers: list[McpServer] = Field(
        default_factory=list,
        max_length=32,
        description="For POST /toolsets: MCP servers whose tools/list entries join the manifest.",
    )


class StubsView(BaseModel):
    """Answer of ``POST /stubs``."""

    module: str = Field(description="The exact source of the `tools` package the sandbox imports.")
    usage: str = Field(description="A short text for the model's system prompt.")
    toolset_id: str = Field(description="The manifest's content id (what POST /toolsets would return).")


class ToolsetView(BaseModel):
    """Answer of ``POST /toolsets``."""

    toolset_id: str = Field(description="Pass as toolset in /execute or /stubs; the same manifest gives the same id.")
    tools: list[str] = Field(description="The tools' original names.")


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
