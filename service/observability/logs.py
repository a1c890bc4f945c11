"""Structured logs: one JSON object per line on stderr, one line per event.

Every line has ``ts`` (ISO 8601, UTC), ``level``, ``logger`` and ``event``;
ordinary log messages have ``event: "log"`` and ``msg`` (and ``exc``, the
traceback, when there is one). The events (logger ``service.events``):

==================  ===========================================================================================
event               fields
==================  ===========================================================================================
``request``         ``method``, ``route`` (template), ``path``, ``status``, ``duration_ms``, ``job_id`` (of the path,
                    or the job a ``POST /execute`` created), ``key``
``job``             ``job_id``, ``status``, ``key``; when it ends also ``exit_code``, ``error_type``,
                    ``script_error_type`` (``error.script_report.type``: the script's claim), ``duration_ms``,
                    ``queue_ms``, ``sandbox_start``, ``sandbox_id``, ``image`` (its name in PTC_IMAGES), ``calls``,
                    ``stdout_bytes``, ``stderr_bytes``
``sandbox_start``   ``job_id``, ``sandbox_id``, ``mode`` (warm, cold, session), ``start_ms``; with ``job_id`` null,
                    a container started ahead of jobs: ``mode`` pool, or session (with ``session_id``)
``sandbox_stop``    ``job_id`` (null for pool and session sandboxes), ``sandbox_id``, ``reason``, ``stop_ms``
``tool_calls``      ``job_id``, ``key``, ``calls``, ``by_status``, ``by_tool`` (``{tool: {status: n}}``, at most
                    ``SUMMARY_TOOLS`` tools, the rest under ``other``), ``call_ms_total``, ``call_ms_max``
``tool_call``       (debug level only) ``job_id``, ``seq``, ``tool``, ``status``, ``duration_ms``, ``args``,
                    ``result``, ``error``
``replica``         ``action`` (``registered``, ``left``, ``lease_lost``, ``expired``), ``replica`` (the instance id
                    it concerns: this one's, or for ``expired`` the one found dead), ``epoch``; for ``expired`` also
                    ``detected_after_s``, ``jobs_lost``, ``sessions_broken`` (``replica_expired``)
==================  ===========================================================================================

Every line also carries ``instance``, this process's instance id (``PTC_INSTANCE_ID``), set once by
``configure``: the lines of several replicas can be merged and told apart.

What never appears at ``info``: script source, output, tool arguments and
results, error messages (which may quote the script's data; their ``type``
does appear), header values and secrets. With ``PTC_LOG_LEVEL=debug`` the
``tool_call`` events carry arguments, results and error messages; secrets
(endpoint headers, the callback secret) never appear at any level. Requests
of ``/healthz``, ``/readyz`` and ``/metrics`` are logged at debug level only.

With traces on (``service.observability.telemetry``), a line written inside a traced request has ``trace_id``, and every
``job`` event its job's ``trace_id`` (32 hex digits).

``key`` is the name of the API key that made the request (the request's state
``key_name``, set by whoever checks keys); a job's events name the key that owns
it, whoever resumed it. Without authentication it is null. ``PTC_LOG_FORMAT=text``
gives the same events as ``event key=value ...`` text lines instead.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import Scope

from service.jobs.model import FINAL
from service.observability import telemetry
from service.tenancy import IMPLICIT_OWNER

if TYPE_CHECKING:
    from service.jobs.live import LiveJob

EVENTS = logging.getLogger("service.events")
QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
QUIET_LIBRARIES = ("httpx", "httpcore")
SUMMARY_TOOLS = 20
PATH_CHARS = 200
MAX_CLAIMED_TYPE = 100  # characters of a script-reported exception type that the job event logs
_instance: str | None = None  # this process's instance id, in every line (``configure``)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``event``, then the event's fields or ``msg``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", "log"),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        else:
            line["msg"] = record.getMessage()
        if _instance is not None:
            line.setdefault("instance", _instance)
        if "trace_id" not in line and (trace_id := telemetry.trace_id()) is not None:
            line["trace_id"] = trace_id  # emitted inside a traced request or job (tracing on)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def configure(level: str, fmt: str, instance: str | None = None) -> None:
    """Send every log record (uvicorn's included) to stderr as JSON lines (``fmt="json"``) or text lines, each
    carrying ``instance`` (this process's instance id) when one is given."""
    global _instance
    _instance = instance
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        tag = f" instance={orjson.dumps(instance).decode()}" if instance is not None else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # no handlers of their own: through ours
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    for name in QUIET_LIBRARIES:  # a line per HTTP request with its full URL (a tool's query may hold a key)
        logging.getLogger(name).setLevel(logging.WARNING)


class _Text:
    """The text form of an event (``name k=v ...``), rendered only when a text handler asks for it."""

    def __init__(self, name: str, fields: Mapping[str, Any]) -> None:
        self.name, self.fields = name, fields

    def __str__(self) -> str:
        pairs = " ".join(f"{k}={orjson.dumps(v, default=str).decode()}" for k, v in self.fields.items())
        return f"{self.name} {pairs}"


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event with its fields (JSON-able values)."""
    if EVENTS.isEnabledFor(level):
        EVENTS.log(level, "%s", _Text(name, fields), extra={"event": name, "fields": fields})


def replica(action: str, instance_id: str, epoch: int | None, level: int = logging.INFO, **fields: Any) -> None:
    """A ``replica`` event: ``action`` (``registered``, ``left``, ``lease_lost``, ``expired``) of the incarnation
    ``(instance_id, epoch)``, logged as ``replica`` and ``epoch`` (``instance`` stays this process's id)."""
    event("replica", level, action=action, replica=instance_id, epoch=epoch, **fields)


def replica_expired(
    instance_id: str, epoch: int, detected_after_s: float, jobs_lost: int, sessions_broken: int
) -> None:
    """The ``replica`` ``expired`` event (warning level) of the reaper that took over a dead incarnation.

    Args:
        instance_id / epoch: the incarnation found expired.
        detected_after_s: store time from its last heartbeat to the expiry (s).
        jobs_lost: its unfinished jobs this replica marked ``lost``.
        sessions_broken: its open sessions this replica marked ``broken``.
    """
    replica(
        "expired",
        instance_id,
        epoch,
        logging.WARNING,
        detected_after_s=round(detected_after_s, 3),
        jobs_lost=jobs_lost,
        sessions_broken=sessions_broken,
    )


def request(scope: Scope, route: str, status: int, seconds: float) -> None:
    """The ``request`` event of an answered HTTP request (probes and scrapes at debug level)."""
    state = scope.get("state")
    state = state if isinstance(state, dict) else {}
    event(
        "request",
        logging.DEBUG if route in QUIET_ROUTES else logging.INFO,
        method=scope.get("method"),
        route=route,
        path=str(scope.get("path", ""))[:PATH_CHARS],
        status=status,
        duration_ms=round(seconds * 1000, 3),
        job_id=(scope.get("path_params") or {}).get("job_id") or state.get("job_id"),
        key=state.get("key_name"),
    )


def job(job: LiveJob) -> None:
    """The ``job`` event of a status change; when the job has ended, also its ``tool_calls`` summary."""
    key = None if job.owner == IMPLICIT_OWNER else job.owner  # the key that submitted it, whoever resumes it
    fields: dict[str, Any] = {"job_id": job.id, "status": str(job.status), "key": key}
    if job.trace_id is not None:
        fields["trace_id"] = job.trace_id
    if job.started_at is not None and job.status == "running":
        fields["queue_ms"] = _ms(job.created_at, job.started_at)
    if job.status in FINAL:
        fields.update(
            exit_code=job.exit_code,
            error_type=(job.error or {}).get("type"),
            script_error_type=_claimed_type(job.error),
            duration_ms=_ms(job.started_at, job.ended_at),
            queue_ms=_ms(job.created_at, job.started_at or job.ended_at),
            sandbox_start=job.sandbox_start,
            sandbox_id=job.sandbox_id,
            image=job.image,
            calls=len(job.calls),
            stdout_bytes=job.stdout.inline.total_bytes,
            stderr_bytes=job.stderr.inline.total_bytes,
        )
    event("job", **fields)
    if job.status in FINAL and job.calls:
        tool_calls(job.id, key, job.calls)


def _claimed_type(error: dict[str, Any] | None) -> str | None:
    """The exception type the script's runtime reported (unverified), when it looks like a Python class name."""
    claimed = ((error or {}).get("script_report") or {}).get("type")
    if isinstance(claimed, str) and len(claimed) <= MAX_CLAIMED_TYPE and claimed.isidentifier():
        return claimed
    return None


def tool_calls(job_id: str, key: str | None, records: list[dict[str, Any]]) -> None:
    """The ``tool_calls`` summary of a job: counts by status and by tool, call time; never arguments or results."""
    by_tool: dict[str, Counter[str]] = {}
    for record in records:
        name = str(record.get("tool"))
        if name not in by_tool and len(by_tool) >= SUMMARY_TOOLS:
            name = "other"
        by_tool.setdefault(name, Counter())[str(record.get("status"))] += 1
    durations = [float(r.get("duration_ms") or 0) for r in records]
    event(
        "tool_calls",
        job_id=job_id,
        key=key,
        calls=len(records),
        by_status=dict(Counter(str(r.get("status")) for r in records)),
        by_tool={name: dict(counts) for name, counts in by_tool.items()},
        call_ms_total=round(sum(durations), 3),
        call_ms_max=max(durations, default=0.0),
    )


def tool_call(job_id: str, record: Mapping[str, Any]) -> None:
    """A ``tool_call`` event with the call's arguments and result: debug level only."""
    if EVENTS.isEnabledFor(logging.DEBUG):
        event(
            "tool_call",
            logging.DEBUG,
            job_id=job_id,
            **{k: record.get(k) for k in ("seq", "tool", "status", "duration_ms", "args", "result", "error")},
        )


def sandbox(name: str, job_id: str | None, sandbox_id: str | None, seconds: float, **fields: Any) -> None:
    """A ``sandbox_start`` or ``sandbox_stop`` event (``start_ms`` / ``stop_ms`` from ``seconds``)."""
    timing = "start_ms" if name == "sandbox_start" else "stop_ms"
    ident = sandbox_id[:12] if sandbox_id else None
    event(name, **{"job_id": job_id, "sandbox_id": ident, **fields, timing: round(seconds * 1000, 3)})


def sandbox_stopped(job_id: str | None, sandbox_id: str, seconds: float, folder: str, reason: str | None) -> None:
    """The ``sandbox_stop`` event of a removed sandbox (``service.sandbox.ports.StopHook``)."""
    sandbox("sandbox_stop", job_id, sandbox_id, seconds, folder=folder, reason=reason)


def _ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds() * 1000, 3)
