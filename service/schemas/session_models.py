"""The sessions' request and response models: ``POST /sessions``, the session view, its files."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.schemas.common import LANGUAGE_DESCRIPTION, Env, Files, Language, Limits, Metadata
from service.schemas.job_models import JobError
from service.settings import MAX_TOOLS


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
        description="The session sandbox's image, by its name in PTC_IMAGES; default: default (node for javascript "
        "and typescript).",
    )
    language: Language | None = Field(None, description=LANGUAGE_DESCRIPTION + " Every script of the session is in it.")
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
    language: str = Field("python", description="The language of its scripts: python, javascript or typescript.")
    executions: int = Field(description="Scripts that ran in it.")
    queued: int = Field(description="Scripts waiting for their turn.")
    current_job_id: str | None = Field(description="The job running now.")
    sandbox_id: str | None = Field(description="The engine's id of the session's container (12 hex digits).")
    metadata: dict[str, Any]
    owner: str | None = Field(None, description="The API key name that created it (anonymous without auth).")


class SessionList(BaseModel):
    """Answer of ``GET /sessions``: the live sessions, oldest first."""

    sessions: list[SessionView]
