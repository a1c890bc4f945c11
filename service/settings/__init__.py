"""Service configuration, read from ``PTC_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.settings.egress_syntax import parse_rule

MAX_SCRIPT_CHARS = 8 * 1024 * 1024  # outer bound of the request schema; PTC_MAX_SCRIPT_BYTES is the limit (413)
MAX_TOOLS = 1000  # outer bound of a manifest's tools; PTC_MAX_TOOLS is the limit (422)


class KeyLimits(BaseModel):
    """Maxima for the requests of one API key (``PTC_KEY_LIMITS``); each lowers the server's own maximum.

    A request that asks for more than its key's maximum is refused (422); one that asks nothing gets the
    server default, lowered to the key's maximum.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(None, gt=0, description="Largest timeout_s (s).")
    memory_mb: int | None = Field(None, ge=16, description="Largest limits.memory_mb (MiB).")
    cpus: float | None = Field(None, gt=0, description="Largest limits.cpus.")
    pids: int | None = Field(None, ge=8, description="Largest limits.pids.")
    output_bytes: int | None = Field(None, ge=1024, description="Largest limits.output_bytes.")
    tmp_mb: int | None = Field(None, ge=1, description="Largest limits.tmp_mb (MiB).")
    tools: int | None = Field(None, ge=0, description="Most tools in one request's manifest.")


class KeyQuotas(BaseModel):
    """One API key's quotas (``PTC_KEY_QUOTAS``); each replaces the default ``PTC_QUOTA_<NAME>`` for that key.

    A value is taken as it is: 0 allows nothing (e.g. ``{"batch": {"sessions": 0}}``). See ``service.quotas``.
    """

    model_config = ConfigDict(extra="forbid")

    running_jobs: int | None = Field(None, ge=0, description="Jobs (one-shot and session scripts) running at once.")
    queued_jobs: int | None = Field(None, ge=0, description="Jobs not ended beyond running_jobs (waiting).")
    sessions: int | None = Field(None, ge=0, description="Sessions open at once.")
    session_memory_mb: int | None = Field(None, ge=0, description="memory_mb summed over its open sessions (MiB).")
    session_cpus: float | None = Field(None, ge=0, description="cpus summed over its open sessions.")
    output_bytes: int | None = Field(None, ge=0, description="Output bytes of its jobs retained on disk (bytes).")
    jobs_per_minute: int | None = Field(None, ge=0, description="Jobs admitted in any 60 s.")


IMAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")  # a name in PTC_IMAGES (what requests send as image)
DEFAULT_IMAGE = "default"  # the image of a request that names none
NODE_IMAGE = "node"  # the image of a JavaScript or TypeScript request that names none (when PTC_IMAGES offers it)


class ImageDefaults(BaseModel):
    """What a request of one image gets for each value it leaves unset (``PTC_IMAGE_DEFAULTS``); each replaces
    the server's ``PTC_DEFAULT_<NAME>`` for that image and must not exceed the server's ``PTC_MAX_<NAME>``.

    A request's explicit values still win; a key's maxima (``PTC_KEY_LIMITS``) still lower them.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(None, gt=0, description="timeout_s of its jobs (s).")
    memory_mb: int | None = Field(None, ge=16, description="limits.memory_mb (MiB).")
    cpus: float | None = Field(None, gt=0, description="limits.cpus.")
    pids: int | None = Field(None, ge=8, description="limits.pids.")
    output_bytes: int | None = Field(None, ge=1024, description="limits.output_bytes (bytes).")
    tmp_mb: int | None = Field(None, ge=1, description="limits.tmp_mb (MiB).")


# Defaults whose maximum is not named max_<the default's name without default_>: default -> its maximum.
CEILINGS_BY_MEANING = {
    "session_idle_timeout_s": "max_session_lifetime_s",
    "session_max_lifetime_s": "max_session_lifetime_s",
}


IMAGE_DEFAULT_FIELDS = ("timeout_s", "wait_s", "memory_mb", "cpus", "pids", "output_bytes", "tmp_mb")


class Settings(BaseSettings):
    """Every setting of the service; each field is the env var ``PTC_<NAME>``.

    A ``default_*`` setting is what a request gets when it asks for nothing; it may lower a limit, or
    raise it up to the ``max_*`` ceiling. A default above its maximum is refused (``default_ceilings``).
    """

    model_config = SettingsConfigDict(env_prefix="PTC_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8080, description="Port the HTTP server listens on.")
    instance_id: str | None = Field(
        None,
        description="Name of this service instance; labels its containers so that a restart can sweep "
        "what a crashed run left behind. Default: the host name and a hash of the work dir, so instances with "
        "their own work dirs never sweep each other's sandboxes.",
    )
    docker_host: str | None = Field(
        None,
        description="Docker engine URL (e.g. unix:///var/run/docker.sock); default: DOCKER_HOST or the local socket.",
    )
    sandbox_image: str = Field(
        "ptc-sandbox-runtime:latest",
        description="Image of the sandboxes of requests that name no image (the image named default; "
        "PTC_IMAGES may name it instead).",
    )
    images: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Images a request may choose by name (its image field), comma-separated name=image pairs, "
        "e.g. default=ptc-sandbox-runtime:latest,data=ptc-sandbox-data:latest; names: lower-case letters, digits, "
        "._- (at most 32). default (requests that name none) is PTC_SANDBOX_IMAGE unless named here.",
    )
    image_defaults: dict[str, ImageDefaults] = Field(
        default_factory=dict,
        description='Per-image defaults as JSON, e.g. {"data": {"memory_mb": 1024, "timeout_s": 120}}: what a '
        "request of that image gets for a value it leaves unset, instead of PTC_DEFAULT_*, within PTC_MAX_*; "
        "fields: timeout_s, memory_mb, cpus, pids, output_bytes, tmp_mb.",
    )
    runtime: str | None = Field(
        None, description="OCI runtime for sandboxes (e.g. runsc for gVisor); default: the engine's."
    )
    work_dir: Path = Field(
        Path("/var/lib/ptc-sandbox"),
        description="Host directory for per-job folders (socket, stubs, script), bind-mounted into sandboxes. "
        "Keep the path short: a unix socket path must fit in 107 bytes.",
    )
    sandbox_folders_tmpfs_mb: int = Field(
        1024,
        ge=0,
        description="Size of the tmpfs the service mounts at work_dir/run for the sandboxes' folders, so that a "
        "sandbox's mount table shows no host path (needs root; else a warning) (MiB); 0: none, folders on disk.",
    )
    max_concurrent_sandboxes: int = Field(
        0, description="Scripts running at once, one-shot jobs and session scripts alike; 0 means 2 x CPU count."
    )

    default_timeout_s: float = Field(300, gt=0, description="Wall-clock limit of a job when the request sets none (s).")
    max_timeout_s: float = Field(3600, gt=0, description="Largest timeout_s a request may ask for (s).")
    default_memory_mb: int = Field(256, ge=16, description="Memory of a sandbox (MiB); swap is not added.")
    max_memory_mb: int = Field(4096, ge=16, description="Largest memory_mb a request may ask for (MiB).")
    default_cpus: float = Field(1.0, gt=0, description="CPUs of a sandbox.")
    max_cpus: float = Field(4.0, gt=0, description="Largest cpus a request may ask for.")
    default_pids: int = Field(128, ge=8, description="Process/thread limit of a sandbox.")
    max_pids: int = Field(1024, ge=8, description="Largest pids a request may ask for.")
    default_output_bytes: int = Field(
        64 * 1024, ge=1024, description="Inline cap per stream (bytes): head and tail kept."
    )
    max_output_bytes: int = Field(1024 * 1024, ge=1024, description="Largest output_bytes a request may ask for.")
    default_tmp_mb: int = Field(64, ge=1, description="Size of the sandbox's tmpfs /tmp (MiB).")
    max_files: int = Field(
        100, ge=0, description="Most files a request's files may hold (more: 413 before any sandbox starts)."
    )
    max_files_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="Most bytes a request's files may hold in all, decoded, and a PUT of a session's file (more: 413; "
        "bounded by max_body_bytes too).",
    )
    max_output_files: int = Field(
        100, ge=0, description="Most files collected from a script's outputs/ folder (the rest counted in the view)."
    )
    max_output_files_bytes: int = Field(
        32 * 1024 * 1024,
        ge=0,
        description="Most bytes collected from a script's outputs/ folder in all, and of a session's file read with "
        "GET (bytes).",
    )
    max_files_listed: int = Field(1000, ge=1, description="Most entries GET /sessions/{id}/files lists.")
    max_tmp_mb: int = Field(1024, ge=1, description="Largest tmp_mb a request may ask for (MiB).")
    file_size_mb: int = Field(64, ge=1, description="RLIMIT_FSIZE of sandbox processes (MiB).")
    open_files: int = Field(1024, ge=16, description="RLIMIT_NOFILE of sandbox processes.")

    max_tool_calls: int = Field(10_000, ge=1, description="Tool calls a job may make; later ones are refused.")
    tool_timeout_s: float = Field(30.0, gt=0, description="Default time limit of one http tool call (s).")
    max_tool_result_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest tool result passed back to a script (bytes of JSON)."
    )
    max_request_line_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest single stub request on the broker socket (bytes)."
    )
    max_record_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="Bytes of arguments and results (JSON) a job's call records keep; past it (or past its key's "
        "output_bytes quota) a record keeps its call but not its args/result (args_dropped_bytes, "
        "result_dropped_bytes) (bytes).",
    )
    max_call_log_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Bytes of arguments and results (JSON) a durable job's call log may hold in the job store; a "
        "job that would pass it stops being durable (its log and run spec are dropped: it is lost if the service "
        "stops under it) and runs on (bytes).",
    )
    max_record_bytes_total: int = Field(
        512 * 1024 * 1024,
        ge=0,
        description="The same for the call records of all running jobs together (bytes).",
    )
    max_call_bytes_in_flight: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Bytes of tool-call requests of one job handled at once; past it the broker reads no more "
        "from the job until calls end (bytes).",
    )
    max_call_bytes_in_flight_total: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Bytes of tool-call requests handled at once for all jobs; a call past it is refused "
        "(ToolError limit_exceeded, record rejected) (bytes).",
    )
    view_cache_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Encoded views of ended jobs kept in memory for reading (bytes).",
    )
    validation_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="Threads that check tool-call arguments and results against their schemas, shared by all jobs "
        "(one check per job at a time, taken round-robin between keys and jobs).",
    )
    validation_budget_s: float = Field(
        1.0,
        gt=0,
        description="CPU time one check of a tool call's arguments (or result) may take; past it the call is "
        "refused with limit_exceeded (s).",
    )
    manifest_threads: int = Field(
        2,
        ge=1,
        le=64,
        description="Threads that compile tool manifests (schema checks, stubs), shared by all keys (one compile "
        "per key at a time, taken round-robin between keys).",
    )
    manifest_budget_s: float = Field(
        10.0,
        gt=0,
        description="CPU time one manifest's compile may take; past it the request is refused with 422 (s).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level; debug adds tool arguments and results to the logs."
    )
    log_format: Literal["json", "text"] = Field(
        "json", description="Log lines as JSON objects (one per event) or as plain text."
    )
    metrics_max_tools: int = Field(
        100, ge=0, description="Distinct tool names that get their own metrics label; later ones count as other."
    )

    store_path: Path | None = Field(None, description="SQLite job store file; default: jobs.sqlite3 in the work dir.")
    store_url: SecretStr | None = Field(
        None,
        description="PostgreSQL job store, postgresql://user:password@host:port/db (never logged); unset: "
        "the SQLite store (store_path). docs/operations.md, Job store.",
    )
    store_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for one job store operation (PostgreSQL); past it: 503 (s)."
    )
    internal_url: str | None = Field(
        None,
        pattern=r"^https?://[^/?#\s]+/?$",
        description="Where the other replicas reach this one (http://host:port, no path); default: http://PTC_HOST:"
        "PTC_PORT unless the host is a wildcard, else the host name's first non-loopback address. docs/scaling.md.",
    )
    internal_secret: SecretStr | None = Field(
        None,
        description="HMAC key of the internal calls between replicas (at least 32 characters; several, "
        "space-separated, newest first, while rotating: sign with the first, accept any); required with a "
        "PostgreSQL store (PTC_STORE_URL). Worth every tenant's keys: keep it like the database password.",
    )
    replica_heartbeat_s: float = Field(
        2.0, gt=0, description="How often this replica renews its lease in the store's registry (s)."
    )
    replica_lease_s: float = Field(
        10.0,
        gt=0,
        description="Lease length from each renewal (s); at least 3 times PTC_REPLICA_HEARTBEAT_S. A replica whose "
        "lease passed is dead for the others (docs/scaling.md).",
    )
    replica_scan_s: float = Field(
        2.0,
        gt=0,
        description="How often this replica looks for expired leases and the jobs they left (s, jittered by 20%). "
        "docs/scaling.md, Detection.",
    )
    progress_save_s: float = Field(
        5.0,
        gt=0,
        description="PostgreSQL store: how often a running job's new output and call records are saved (s), bounding "
        "what a lost job loses.",
    )
    output_retention_bytes: int = Field(
        16 * 1024 * 1024, ge=0, description="Bytes of each stream kept on disk per job, readable by offset (bytes)."
    )
    job_retention_s: float = Field(
        24 * 3600, gt=0, description="How long ended jobs (view, output, calls) are kept before they are purged (s)."
    )
    purge_interval_s: float = Field(300, gt=0, description="How often expired jobs are purged (s).")
    mcp_toolset: str | None = Field(
        None,
        max_length=64,
        description="Toolset (POST /toolsets) the MCP tool execute uses when a call names none; it must be the "
        "calling key's own. Default: none (a call without toolset_id runs with no tools).",
    )
    default_wait_s: float = Field(
        30, ge=0, description="How long POST /execute waits for the end when wait_s is not given (s)."
    )
    max_wait_s: float = Field(300, ge=0, description="Largest wait_s, and largest timeout_s of /jobs/{id}/wait (s).")
    max_queue: int = Field(
        100, ge=0, description="Jobs that may wait for a sandbox slot; past that /execute answers 429."
    )
    retry_after_s: int = Field(2, ge=1, description="Retry-After of a 429 (s).")
    max_reads_per_key: int = Field(
        4,
        ge=1,
        description="Session file downloads and GET /jobs answers one key may have under way at once (each sent a "
        "slice at a time); one more answers 429 (docs/operations.md, Quotas and admission).",
    )
    client_call_timeout_s: float = Field(
        270, gt=0, description="How long a client-executed tool call waits for the client's answer (s)."
    )
    approval_timeout_s: float = Field(
        270,
        gt=0,
        description="How long a tool call that needs approval waits for it (s), for tools without their own "
        "approval_timeout_s; then the script gets a ToolError of type approval_timeout.",
    )
    warm_pool_size: int = Field(
        4, ge=0, le=64, description="Sandboxes kept started and waiting for a job, per profile; 0 = off."
    )
    warm_pool_max_profiles: int = Field(
        4,
        ge=1,
        le=64,
        description="Warm pools at most, one per sandbox profile (limits, runtime); the default profile's included. "
        "The others are shared fairly between keys (a key holding two more than another gives one up to it).",
    )
    warm_pool_max_age_s: float = Field(600, gt=0, description="A pooled sandbox idle longer than this is replaced (s).")
    max_sessions: int = Field(32, ge=0, description="Sessions open at once; past that POST /sessions answers 429.")
    session_idle_timeout_s: float = Field(
        300, gt=0, description="A session without a script this long ends, when it sets no idle_timeout_s (s)."
    )
    session_max_lifetime_s: float = Field(
        3600, gt=0, description="A session ends this long after its creation, when it sets no max_lifetime_s (s)."
    )
    max_session_lifetime_s: float = Field(
        24 * 3600, gt=0, description="Largest idle_timeout_s and max_lifetime_s a session may ask for (s)."
    )
    session_runtimes: list[str] = Field(
        default_factory=lambda: ["runc", "runsc"],
        description="OCI runtimes a session may ask for by name (JSON list); the server's runtime is always allowed.",
    )
    stop_grace_s: float = Field(2.0, ge=0, description="Time between SIGTERM and SIGKILL when a job is stopped (s).")
    drain_s: float = Field(
        15.0,
        ge=0,
        description="On SIGTERM: how long running jobs have to end while the service takes no new work (503 "
        "draining) before the durable ones are parked for a resume and the others end lost (s). Then open "
        "requests get up to 10 s more: keep a supervisor's grace period above both (Kubernetes: "
        "terminationGracePeriodSeconds 30).",
    )
    park_after_s: float = Field(
        30.0,
        ge=0,
        description="A durable one-shot job whose calls have all waited this long for the harness (a client-executed "
        "call, an approval) is parked: its sandbox, script slot and memory are released, and an answer resumes it "
        "by replay (docs/durability.md) (s).",
    )
    max_park_s: float = Field(
        7 * 86400.0,
        gt=0,
        description="The longest any call waits for the harness (a client tool's timeout_s, an approval_timeout_s "
        "and the defaults above are cut to it); then the script gets its timeout (s; default 7 days).",
    )
    max_parked_jobs: int = Field(
        10000,
        ge=0,
        description="Jobs parked at once on this service; with several keys each may park a quarter of it. A job "
        "past its key's share waits in its sandbox instead.",
    )
    callback_secret: SecretStr | None = Field(
        None,
        description="Secret that signs completion callbacks (Standard Webhooks webhook-signature; also the "
        "deprecated X-PTC-Signature, for one more release): whsec_<base64> (at least 24 bytes) or free-form text; "
        "two separated by a space (new old) while rotating. callback_url is refused without it.",
    )
    callback_secrets: SecretStr | None = Field(
        None,
        description="Per-key callback secrets, comma-separated name:secret pairs: the callbacks of a key's jobs "
        "are signed with its own secret (PTC_CALLBACK_SECRET signs the others); name:new old while rotating.",
    )
    callback_secrets_file: Path | None = Field(
        None, description="File with more name:secret pairs for callbacks, one per line (# comments)."
    )
    callback_max_attempts: int = Field(5, ge=1, description="Deliveries tried per completion callback.")
    callback_backoff_s: float = Field(
        0.5, gt=0, description="First retry delay of a callback; doubles per attempt, at most 60 s (s)."
    )
    callback_timeout_s: float = Field(10, gt=0, description="Time limit of one callback delivery (s).")

    # -- authentication (service/tenancy.py, service/api/auth.py) --
    auth: Literal["required", "disabled"] = Field(
        "required",
        description="required: every route but /healthz, /readyz (and /metrics when PTC_METRICS_AUTH=open) needs "
        "a bearer token from PTC_API_KEYS; disabled: no authentication (development only; refused on a "
        "non-loopback PTC_HOST unless PTC_AUTH_FORCE_INSECURE).",
    )
    auth_force_insecure: bool = Field(
        False, description="Allow PTC_AUTH=disabled on a non-loopback address (never in production)."
    )
    api_keys: str | None = Field(
        None,
        description="API keys as comma-separated name:sha256hex pairs (the SHA-256 of the token, from "
        "`ptc-sandbox hash-key NAME`); the name shows in logs and metrics.",
    )
    api_keys_file: Path | None = Field(
        None, description="File with more name:sha256hex pairs, one per line (# comments), e.g. a mounted Secret."
    )
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated names of API keys with the admin role: they see and act on every owner's "
        "jobs, sessions and toolsets (the others only on their own).",
    )
    metrics_auth: Literal["required", "open"] = Field(
        "required",
        description="required: GET /metrics answers only the admin role and PTC_METRICS_KEYS (others get 403); "
        "open: it answers without a key (for a scraper on a trusted network).",
    )
    metrics_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated names of API keys that may read GET /metrics (e.g. Prometheus's key), besides "
        "the admin role; they have no other power beyond their own jobs.",
    )

    # -- egress rules (service/egress.py) --
    egress_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated [scheme://]host[:port] rules of what http/mcp endpoints and callbacks may "
        "reach (docs/operations.md, Egress rules); non-public addresses (loopback, private) need an address rule, "
        "best with its port: http://127.0.0.1:8765. Empty (the default): nothing.",
    )

    # -- request limits (service/limits.py) --
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body; larger ones get 413 before they are read (bytes)."
    )
    max_script_bytes: int = Field(
        1024 * 1024, ge=1, le=MAX_SCRIPT_CHARS, description="Largest script, UTF-8 encoded; larger: 413 (bytes)."
    )
    max_manifest_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest manifest (tools and mcp_servers as JSON) in one request; larger: 413 (bytes).",
    )
    max_tools: int = Field(
        MAX_TOOLS, ge=1, le=MAX_TOOLS, description="Most tools in one manifest (MCP listings included); more: 422."
    )
    header_timeout_s: float = Field(
        10,
        ge=0,
        description="A request's line and headers must arrive within this of the connection opening (or of the "
        "previous response); past it: 408 and the connection is closed. 0 = no limit (s).",
    )
    body_timeout_s: float = Field(
        60,
        ge=0,
        description="A request's body must arrive within this of its headers; past it the connection is "
        "closed. 0 = no limit (s).",
    )
    max_connections: int = Field(
        4096, ge=0, description="HTTP connections open at once; past it a new one gets 503 and is closed. 0 = no cap."
    )
    max_connections_per_address: int = Field(
        256,
        ge=0,
        description="HTTP connections open at once from one client address (PTC_TRUSTED_PROXIES excepted; IPv6 "
        "addresses are grouped by /64, IPv4-mapped ones count as their IPv4 address); past it a new one gets 429 "
        "and is closed. 0 = no cap.",
    )
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated addresses or CIDR networks of reverse proxies in front of the service: their "
        "connections carry many clients', so PTC_MAX_CONNECTIONS_PER_ADDRESS does not apply to them.",
    )
    key_limits: dict[str, KeyLimits] = Field(
        default_factory=dict,
        description='Per-key maxima as JSON, e.g. {"agent-a": {"timeout_s": 60, "memory_mb": 512, "tools": 50}}; '
        "fields: timeout_s, memory_mb, cpus, pids, output_bytes, tmp_mb, tools.",
    )

    # -- quotas per key and host capacity (service/quotas.py) --
    quota_running_jobs: int | None = Field(
        None,
        ge=0,
        description="Jobs of one key (one-shot and session scripts) running at once; more wait. "
        "Default: half the concurrency (at least 1); with one tenant, all of it.",
    )
    quota_queued_jobs: int | None = Field(
        None,
        ge=0,
        description="Jobs of one key that may wait beyond its running ones; past that 429. "
        "Default: a quarter of PTC_MAX_QUEUE (at least 1); with one tenant, all of it.",
    )
    quota_sessions: int | None = Field(
        None,
        ge=0,
        description="Sessions one key may have open. Default: a quarter of PTC_MAX_SESSIONS (at least 1); with one "
        "tenant, all of it.",
    )
    quota_session_memory_mb: int | None = Field(
        None,
        ge=0,
        description="memory_mb summed over one key's open sessions (MiB). Default: a quarter of the host memory "
        "capacity; with one tenant, all of it.",
    )
    quota_session_cpus: float | None = Field(
        None,
        ge=0,
        description="cpus summed over one key's open sessions. Default: a quarter of the host CPU capacity "
        "(PTC_HOST_CPUS x PTC_CPU_OVERCOMMIT); with one tenant, all of it.",
    )
    quota_output_bytes: int = Field(
        1024**3,
        ge=0,
        description="Bytes one key's jobs make the service keep until purged: retained output, output files and "
        "the arguments and results of their call records; past it no more is kept and new jobs get 429 (bytes).",
    )
    quota_jobs_per_minute: int | None = Field(
        None,
        ge=0,
        description="Jobs one key may submit in any 60 s. Default: 600; with one tenant, no limit (the queue "
        "bound and the concurrency still hold).",
    )
    key_quotas: dict[str, KeyQuotas] = Field(
        default_factory=dict,
        description='Per-key quotas as JSON, e.g. {"agent-a": {"running_jobs": 8, "sessions": 2}}; fields: '
        "running_jobs, queued_jobs, sessions, session_memory_mb, session_cpus, output_bytes, jobs_per_minute "
        "(without authentication the key is named anonymous). One tenant (authentication disabled, or keys of "
        "one name) has the whole host by default: see each PTC_QUOTA_*.",
    )
    host_memory_mb: int | None = Field(
        None, ge=1, description="Host memory sandboxes may commit before overcommit (MiB). Default: the machine's."
    )
    host_cpus: float | None = Field(
        None, gt=0, description="Host CPUs sandboxes may commit before overcommit. Default: the machine's count."
    )
    memory_overcommit: float = Field(
        1.0, gt=0, description="Sandbox memory limits may add up to this times PTC_HOST_MEMORY_MB."
    )
    cpu_overcommit: float = Field(
        8.0,
        gt=0,
        description="Sandbox CPU limits may add up to this times PTC_HOST_CPUS (scripts running at once stay "
        "bounded by the concurrency).",
    )

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> Settings:
        """Refuse a default above its maximum (every pair of ``default_ceilings``): it would apply, unchecked,
        to every request that sets none (e.g. a 7,200 s default timeout under a 3,600 s maximum)."""
        above = [
            f"PTC_{default.upper()} ({getattr(self, default)}) is above PTC_{ceiling.upper()} "
            f"({getattr(self, ceiling)})"
            for default, ceiling in default_ceilings()
            if getattr(self, default) > getattr(self, ceiling)
        ]
        if above:
            raise PydanticCustomError(
                "default_above_maximum",
                "{above}: a default applies to every request that does not set the value, so it must not exceed "
                "the maximum a request may ask for; lower the default or raise the maximum",
                {"above": "; ".join(above)},
            )
        return self

    @model_validator(mode="after")
    def _lease_outlasts_heartbeats(self) -> Settings:
        """Refuse a lease shorter than three heartbeats: one late renewal would cost the replica its jobs."""
        if self.replica_lease_s < 3 * self.replica_heartbeat_s:
            raise PydanticCustomError(
                "lease_too_short",
                "PTC_REPLICA_LEASE_S ({lease}) must be at least 3 times PTC_REPLICA_HEARTBEAT_S ({beat})",
                {"lease": self.replica_lease_s, "beat": self.replica_heartbeat_s},
            )
        return self

    @field_validator("images", mode="before")
    @classmethod
    def _parse_images(cls, value: object) -> object:
        """``name=image,...`` -> {name: image}; a malformed pair, a bad or repeated name is refused (naming it)."""
        if not isinstance(value, str):
            return value
        images: dict[str, str] = {}
        for pair in (part.strip() for part in value.split(",")):
            if not pair:
                continue
            name, equals, image = (piece.strip() for piece in pair.partition("="))
            if not equals or not image or any(c.isspace() for c in image):
                raise ValueError(f"{pair!r} is not name=image")
            if name in images:
                raise ValueError(f"image name {name!r} is named twice")
            images[name] = image
        return images

    @model_validator(mode="after")
    def _images(self) -> Settings:
        """Check the image names and per-image defaults, and make ``images`` name ``default``.

        ``images["default"]`` and ``sandbox_image`` are the same image afterwards (whichever was given; both given
        and different is refused).
        """
        for name in self.images:
            if not IMAGE_NAME.fullmatch(name):
                raise ValueError(
                    f"PTC_IMAGES: {name!r} is not an image name (lower-case letters, digits, '.', '_', '-'; at most 32)"
                )
        named = self.images.get(DEFAULT_IMAGE)
        if named is not None and "sandbox_image" in self.model_fields_set and named != self.sandbox_image:
            raise ValueError(
                f"PTC_SANDBOX_IMAGE ({self.sandbox_image}) and PTC_IMAGES's default ({named}) differ: set one"
            )
        if named is not None:
            self.sandbox_image = named
        self.images = {DEFAULT_IMAGE: self.sandbox_image, **self.images}
        for name, defaults in self.image_defaults.items():
            if name not in self.images:
                raise ValueError(
                    f"PTC_IMAGE_DEFAULTS names image {name!r}, which PTC_IMAGES does not; images: {sorted(self.images)}"
                )
            above = [
                f"{field} ({value}) is above PTC_MAX_{field.upper()} ({getattr(self, 'max_' + field)})"
                for field, value in defaults.model_dump(exclude_none=True).items()
                if value > getattr(self, "max_" + field)
            ]
            if above:
                raise ValueError(f"PTC_IMAGE_DEFAULTS of image {name!r}: " + "; ".join(above))
        return self

    def image_defaults_of(self, image: str) -> dict[str, float]:
        """What a request of ``image`` (a name in ``images``) gets for each value it leaves unset: ``timeout_s``,
        ``wait_s``, ``memory_mb``, ``cpus``, ``pids``, ``output_bytes``, ``tmp_mb`` (units as the settings'):
        its ``PTC_IMAGE_DEFAULTS`` entry over the ``PTC_DEFAULT_*`` settings."""
        server = {name: getattr(self, "default_" + name) for name in IMAGE_DEFAULT_FIELDS}
        own = self.image_defaults.get(image)
        return {**server, **(own.model_dump(exclude_none=True) if own is not None else {})}

    @field_validator("trusted_proxies")
    @classmethod
    def _parse_proxies(cls, entries: list[str]) -> list[str]:
        for entry in entries:  # as service.api.connections.parse_networks reads them; ValueError names the entry
            if entry.strip():
                ipaddress.ip_network(entry.strip(), strict=False)
        return entries

    @field_validator("egress_allow", "admin_keys", "metrics_keys", "trusted_proxies", mode="before")
    @classmethod
    def _split_rules(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("egress_allow")
    @classmethod
    def _parse_rules(cls, rules: list[str]) -> list[str]:
        for rule in rules:
            parse_rule(rule)  # ValueError names the rule
        return rules

    def instance(self) -> str:
        """``instance_id``, or ``<host name>-<8 hex of the work dir's path>``."""
        if self.instance_id:
            return self.instance_id
        digest = hashlib.sha256(str(self.work_dir.resolve()).encode()).hexdigest()[:8]
        return f"{socket.gethostname()}-{digest}"

    @field_validator("store_url")
    @classmethod
    def _postgresql_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        import sqlalchemy  # only with a store URL: the SQLite default does not import it

        problem = "PTC_STORE_URL must be a postgresql://user:password@host:port/db URL"  # never the value itself
        try:
            url = sqlalchemy.make_url(value.get_secret_value())
        except (sqlalchemy.exc.ArgumentError, ValueError):
            raise ValueError(problem) from None
        if url.drivername not in ("postgresql", "postgres", "postgresql+psycopg") or not url.database:
            raise ValueError(problem)
        return value

    def job_store_path(self) -> Path:
        """Where the SQLite store lives (``store_path`` or ``work_dir/jobs.sqlite3``)."""
        return self.store_path or self.work_dir / "jobs.sqlite3"

    def concurrency(self) -> int:
        """Sandboxes allowed to run at once (``max_concurrent_sandboxes`` or 2 x CPUs)."""

        return self.max_concurrent_sandboxes or 2 * (os.cpu_count() or 1)


def default_ceilings() -> list[tuple[str, str]]:
    """Every (default, maximum) pair of ``Settings``, by field name: each ``default_<x>`` with ``max_<x>``
    (a ``default_<x>`` without one is a bug that ``tests/unit/test_settings.py`` catches), then
    ``CEILINGS_BY_MEANING``."""
    fields = Settings.model_fields
    pairs = [
        (name, "max_" + name.removeprefix("default_"))
        for name in fields
        if name.startswith("default_") and "max_" + name.removeprefix("default_") in fields
    ]
    return pairs + list(CEILINGS_BY_MEANING.items())


def settings_table() -> str:
    """The settings table of docs/settings.md (Markdown), rendered from the fields above so the two cannot drift."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, info in Settings.model_fields.items():
        value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
        if value is None:
            default = "—"
        elif name in ("egress_allow", "admin_keys", "metrics_keys", "trusted_proxies"):  # comma-separated lists
            default = f"`{','.join(value)}`" if value else "—"
        elif name == "images":  # comma-separated name=image pairs
            default = "—"
        elif isinstance(value, list | dict):  # read as JSON
            default = f"`{json.dumps(value, default=lambda v: v.model_dump(exclude_none=True))}`"
        else:
            default = f"`{value}`"
        rows.append(f"| `PTC_{name.upper()}` | {default} | {info.description} |")
    return "\n".join(rows)
