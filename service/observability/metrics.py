"""Prometheus metrics (``GET /metrics``): their definitions, and one small helper per thing that is counted.

Names follow the Prometheus conventions: the ``ptc_``
prefix, base units in the name (``_seconds``), counters ending in ``_total``.
Every label has a bounded set of values; none ever carries a job id:

==============================================  ===============================================================
metric                                          labels (values)
==============================================  ===============================================================
``ptc_executions_total``                        ``status``: a terminal job status
``ptc_execution_duration_seconds``              (histogram) sandbox run time of every ended job, 0 if it never ran
``ptc_queue_wait_seconds``                      (histogram) submission to start (or end, if it never started)
``ptc_sandbox_start_seconds``                   (histogram) ``mode``: ``warm`` | ``cold`` | ``session``
``ptc_tool_calls_total``                        ``tool`` (capped, see below), ``status``: ok|error|rejected|timeout
``ptc_tool_call_duration_seconds``              (histogram) ``tool``
``ptc_jobs``                                    (gauge) ``status``: jobs the service holds now (queued, running…)
``ptc_sandbox_pool_size``                       (gauge) ``profile``: sandboxes of the warm pool waiting for a job
``ptc_sessions``                                (gauge) open sessions
``ptc_output_truncated_total``                  ``stream``: stdout | stderr (jobs whose inline output was cut)
``ptc_oom_kills_total``                         jobs ended ``oom_killed``
``ptc_timeouts_total``                          jobs ended ``timed_out``
``ptc_callback_deliveries_total``               ``outcome``: delivered | http_error | timeout | unreachable
``ptc_callbacks_total``                         ``state``: delivered | failed (after the last attempt)
``ptc_http_requests_total``                     ``method``, ``route`` (the route's template), ``status``
``ptc_script_normalizations_total``             ``kind``: a repair of ``service.normalize`` (process-wide)
``ptc_rejections_total``                        ``reason``: a quota, host capacity or global limit (429s)
``ptc_replicas``                                (gauge) ``state``: live | draining (the registry's last read)
``ptc_lease_renewals_total``                    ``outcome``: ok | error | fenced
``ptc_lease_remaining_seconds``                 (gauge) this replica's lease left at its last renewal
``ptc_replica_expiries_total``                  incarnations of other replicas this one found expired
``ptc_lease_expired_jobs_total``                jobs it marked ``lost`` after their replica's lease expired
``ptc_lease_expired_sessions_total``            sessions it marked ``broken`` so
``ptc_store_listener_reconnects_total``         ``LISTEN`` connections re-opened (PostgreSQL store)
``ptc_job_resumes_total``                       ``reason`` (a view's ``resumes``), ``outcome`` status|replay_diverged
``ptc_jobs_parked_total``                       durable jobs parked (at a shutdown, or waiting for the harness)
``ptc_parked_jobs``                             (gauge) jobs parked now, waiting for the harness without a sandbox
==============================================  ===============================================================

No label holds an instance id, a job id or an address: Prometheus adds the scraped replica as its own
``instance`` target label (``tests/unit/test_metrics_labels.py`` checks every family's label names and values).

Tool names come from manifests, which are unbounded: the first
``metrics_max_tools`` distinct names a process sees get their own ``tool``
label; later names, and names no manifest defines (unknown tools a script
tried), are counted as ``other``.

Each ``Metrics`` owns its ``CollectorRegistry`` (one per app), so tests can
build as many as they like. Histogram buckets of job times reach
``max_timeout_s``; tool call buckets reach ``max(tool_timeout_s,
client_call_timeout_s, approval_timeout_s)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.jobs.model import JobStatus
from service.normalize import NORMALIZATIONS
from service.observability import logs
from service.observability.state_metrics import StateCollector
from service.quotas import REJECTION_REASONS
from service.settings import Settings

if TYPE_CHECKING:
    from service.jobs.live import LiveJob

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "other"
START_MODES = ("warm", "cold", "session")
STREAMS = ("stdout", "stderr")
# Job times: from a few ms (print(1) from the warm pool) to the largest timeout_s.
JOB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
START_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOOL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def buckets_up_to(maximum: float, base: Iterable[float]) -> tuple[float, ...]:
    """``base`` below ``maximum``, then ``maximum`` itself (a histogram's upper bounds, s)."""
    return (*(b for b in base if b < maximum), float(maximum))


class Metrics:
    """Every metric of one service instance, in its own registry.

    Args:
        settings: sizes the histogram buckets and the tool label cap (``metrics_max_tools``).
    """

    def __init__(self, settings: Settings) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        job_buckets = buckets_up_to(settings.max_timeout_s, JOB_BUCKETS)
        tool_max = max(settings.tool_timeout_s, settings.client_call_timeout_s, settings.approval_timeout_s)
        self._max_tools = settings.metrics_max_tools
        self._tools: set[str] = set()
        self._tool_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}  # labelled, by (tool, status)
        self.executions = Counter("ptc_executions", "Jobs ended, by final status.", ["status"], registry=reg)
        self.execution_duration = Histogram(
            "ptc_execution_duration_seconds",
            "Run time of ended jobs in their sandbox (s); 0 for a job that never ran.",
            buckets=job_buckets,
            registry=reg,
        )
        self.queue_wait = Histogram(
            "ptc_queue_wait_seconds",
            "Time from submission to start (or to the end, for a job that never started) (s).",
            buckets=job_buckets,
            registry=reg,
        )
        self.sandbox_start = Histogram(
            "ptc_sandbox_start_seconds",
            "Time from a job's sandbox slot to its script being let go, by mode (warm pool, cold, session) (s).",
            ["mode"],
            buckets=START_BUCKETS,
            registry=reg,
        )
        self.tool_calls = Counter(
            "ptc_tool_calls", "Tool calls ended, by tool and status.", ["tool", "status"], registry=reg
        )
        self.tool_call_duration = Histogram(
            "ptc_tool_call_duration_seconds",
            "Duration of tool calls, validation and endpoint (s).",
            ["tool"],
            buckets=buckets_up_to(tool_max, TOOL_BUCKETS),
            registry=reg,
        )
        self.sessions = Gauge("ptc_sessions", "Open sessions.", registry=reg)
        self.replicas = Gauge(
            "ptc_replicas",
            "Replicas in the store's registry holding their lease at this replica's last read, by state (the "
            "same on every replica: aggregate with max).",
            ["state"],
            registry=reg,
        )
        self.lease_renewals = Counter(
            "ptc_lease_renewals", "Heartbeats of this replica's lease, by outcome.", ["outcome"], registry=reg
        )
        self.lease_remaining = Gauge(
            "ptc_lease_remaining_seconds",
            "This replica's lease left at its last renewal (s; alert below one heartbeat).",
            registry=reg,
        )
        self.replica_expiries = Counter(
            "ptc_replica_expiries",
            "Incarnations of other replicas this replica found expired (lease passed) and took over.",
            registry=reg,
        )
        self.lease_expired_jobs = Counter(
            "ptc_lease_expired_jobs",
            "Jobs this replica marked lost after their replica's lease expired (also in ptc_executions_total).",
            registry=reg,
        )
        self.lease_expired_sessions = Counter(
            "ptc_lease_expired_sessions",
            "Sessions this replica marked broken after their replica's lease expired.",
            registry=reg,
        )
        self.listener_reconnects = Counter(
            "ptc_store_listener_reconnects",
            "LISTEN connections to the job store re-opened after a loss (PostgreSQL store).",
            registry=reg,
        )
        self.forwarded_requests = Counter(
            "ptc_forwarded_requests",
            "Requests relayed to the replica owning their job or session, by route template and outcome "
            "(relayed, unavailable: the owner could not be reached, refused: it refused the signed call).",
            ["route", "outcome"],
            registry=reg,
        )
        self.internal_requests = Counter(
            "ptc_internal_requests",
            "Signed requests of other replicas received, by outcome (accepted, bad_signature, wrong_target, stale, "
            "replayed, busy).",
            ["outcome"],
            registry=reg,
        )
        self.output_truncated = Counter(
            "ptc_output_truncated",
            "Jobs whose inline output of a stream exceeded its cap (head and tail kept).",
            ["stream"],
            registry=reg,
        )
        self.oom_kills = Counter("ptc_oom_kills", "Jobs ended oom_killed.", registry=reg)
        self.timeouts = Counter("ptc_timeouts", "Jobs ended timed_out.", registry=reg)
        self.callback_deliveries = Counter(
            "ptc_callback_deliveries",
            "Completion callback delivery attempts, by outcome.",
            ["outcome"],
            registry=reg,
        )
        self.callbacks = Counter(
            "ptc_callbacks", "Completion callbacks after their last attempt, by state.", ["state"], registry=reg
        )
        self.http_requests = Counter(
            "ptc_http_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            registry=reg,
        )
        self.rejections = Counter(
            "ptc_rejections",
            "Requests refused with 429, by reason: a key's quota (running_jobs, queued_jobs, sessions, "
            "session_memory_mb, session_cpus, output_bytes, jobs_per_minute), the host's capacity (host_memory_mb, "
            "host_cpus) or a global limit (queue_full, max_sessions).",
            ["reason"],
            registry=reg,
        )
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)
        self.resumes = Counter(
            "ptc_job_resumes", "Resumed durable jobs once ended, by their last resume's reason and their final status "
            "(replay_diverged: their replay diverged from their call log).", ["reason", "outcome"], registry=reg,
        )  # fmt: skip
        self.parked = Counter(
            "ptc_jobs_parked",
            "Durable jobs parked: as this replica stopped, or waiting for the harness without a sandbox.",
            registry=reg,
        )
        self._state = StateCollector()
        reg.register(self._state)
        reg.register(NORMALIZATIONS)  # process-wide, counted where scripts are normalized
        for mode in START_MODES:  # the series exist from the start, at zero
            self.sandbox_start.labels(mode=mode)
        for stream in STREAMS:
            self.output_truncated.labels(stream=stream)
        for state in ("live", "draining"):
            self.replicas.labels(state=state)
        for outcome in ("ok", "error", "fenced"):
            self.lease_renewals.labels(outcome=outcome)
        for outcome in ("accepted", "bad_signature", "wrong_target", "stale", "replayed", "busy"):
            self.internal_requests.labels(outcome=outcome)

    # -- state read at scrape time -------------------------------------------------------------

    def track_jobs(self, live: Mapping[str, Any]) -> None:
        """Report ``ptc_jobs{status}`` from ``live`` (job id -> job with a ``status``), read at each scrape."""
        self._state.live = live

    def track_parked(self, count: Callable[[], int]) -> None:
        """Report ``ptc_parked_jobs`` from ``count()`` (jobs parked waiting for the harness), read at each scrape."""
        self._state.parked = count

    def track_pools(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        """Report ``ptc_sandbox_pool_size{profile}`` from ``sizes()`` (profile name -> waiting sandboxes), read at
        each scrape."""
        self._state.pools = sizes

    def set_sessions(self, count: int) -> None:
        """Set ``ptc_sessions`` (call it whenever a session opens or closes)."""
        self.sessions.set(count)

    def lease_renewal(self, outcome: str, remaining_s: float) -> None:
        """Count a heartbeat (``ok``, ``error``, ``fenced``) and set the lease left after it (s)."""
        self.lease_renewals.labels(outcome=outcome).inc()
        self.lease_remaining.set(max(0.0, remaining_s))

    def forwarded(self, route: str, outcome: str) -> None:
        """Count a request relayed to its owner: ``route`` its template (never an id), ``outcome`` ``relayed``,
        ``unavailable`` or ``refused``."""
        self.forwarded_requests.labels(route=route, outcome=outcome).inc()

    def internal_request(self, outcome: str) -> None:
        """Count a signed request received, by outcome (``internal.Verifier``)."""
        self.internal_requests.labels(outcome=outcome).inc()

    def set_replicas(self, counts: Mapping[str, int]) -> None:
        """Set ``ptc_replicas{state}`` (``live``, ``draining``) from the registry's last read."""
        for state, count in counts.items():
            self.replicas.labels(state=state).set(count)

    def replica_expired(self, jobs_lost: int, sessions_broken: int) -> None:
        """Count an incarnation of another replica found expired, with the jobs marked ``lost`` and the sessions
        marked ``broken`` for it (the reaper's, docs/scaling.md step 5)."""
        self.replica_expiries.inc()
        self.lease_expired_jobs.inc(jobs_lost)
        self.lease_expired_sessions.inc(sessions_broken)

    def listener_reconnected(self) -> None:
        """Count a re-opened ``LISTEN`` connection (``notify.Listener``'s ``on_reconnect``)."""
        self.listener_reconnects.inc()

    # -- events --------------------------------------------------------------------------------

    def job_ended(self, job: LiveJob) -> None:
        """Count an ended job: status, run time, queue wait, OOM kill, timeout, truncated streams."""
        ended = job.ended_at or job.started_at or job.created_at
        self.executions.labels(status=str(job.status)).inc()
        self.execution_duration.observe(_seconds(job.started_at, ended))
        self.queue_wait.observe(_seconds(job.created_at, job.started_at or ended))
        if job.status == JobStatus.OOM_KILLED:
            self.oom_kills.inc()
        elif job.status == JobStatus.TIMED_OUT:
            self.timeouts.inc()
        for stream, log in (("stdout", job.stdout), ("stderr", job.stderr)):
            if log.inline.total_bytes > job.limits.output_bytes:  # more than the cap: head and tail kept
                self.output_truncated.labels(stream=stream).inc()
        if job.resumes:  # outcome: its status, or replay_diverged
            self.resumes.labels(job.resumes[-1]["reason"], "replay_diverged" if job.diverged else job.status).inc()

    def ended_from_store(self, status: JobStatus) -> None:
        """Count a job ended from its stored view, with no run here to end: one an earlier run of the service left
        unfinished (found at start-up, ``lost``), or a parked job stopped (``stopped``)."""
        self.executions.labels(status=status.value).inc()

    def sandbox_started(self, mode: str | None, seconds: float) -> None:
        """Observe a job's sandbox start (``mode``: warm, cold or session)."""
        self.sandbox_start.labels(mode=mode or "cold").observe(seconds)

    def tool_call(self, record: Mapping[str, Any]) -> None:
        """Count an ended tool call from its call record (``tool``, ``status``, ``duration_ms``, ``error``)."""
        error = record.get("error") or {}
        unknown = isinstance(error, dict) and error.get("type") == "unknown_tool"
        tool = OTHER if unknown else self.tool_label(str(record.get("tool")))
        key = (tool, str(record.get("status")))
        children = self._tool_children.get(key)
        if children is None:  # labels() costs a lock and a tuple per call; bounded: tool labels x statuses
            children = self._tool_children[key] = (
                self.tool_calls.labels(tool=tool, status=key[1]),
                self.tool_call_duration.labels(tool=tool),
            )
        children[0].inc()
        children[1].observe((record.get("duration_ms") or 0) / 1000)

    def tool_label(self, name: str) -> str:
        """The ``tool`` label of a tool name: itself while fewer than ``metrics_max_tools`` names have one."""
        if name in self._tools:
            return name
        if len(self._tools) < self._max_tools and name != OTHER:
            self._tools.add(name)
            return name
        return OTHER

    def callback_attempt(self, attempt: Mapping[str, Any]) -> None:
        """Count one callback delivery attempt (a record of ``service.callbacks.deliver``'s ``on_attempt``)."""
        self.callback_deliveries.labels(outcome=callback_outcome(attempt)).inc()

    def callback_done(self, delivered: bool) -> None:
        """Count a callback after its last attempt."""
        self.callbacks.labels(state="delivered" if delivered else "failed").inc()

    def rejection(self, reason: str) -> None:
        """Count a request refused with 429 (``reason`` one of ``quotas.REJECTION_REASONS``)."""
        self.rejections.labels(reason=reason if reason in REJECTION_REASONS else OTHER).inc()

    def http_request(self, method: str, route: str, status: int) -> None:
        """Count an answered HTTP request."""
        self.http_requests.labels(method=method, route=route, status=str(status)).inc()

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


def callback_outcome(attempt: Mapping[str, Any]) -> str:
    """``delivered`` (2xx), ``http_error`` (another status), ``timeout`` or ``unreachable`` (no answer)."""
    status = attempt.get("status_code")
    if status is not None:
        return "delivered" if 200 <= int(status) < 300 and not attempt.get("error") else "http_error"
    return "timeout" if str(attempt.get("error", "")).startswith("no answer") else "unreachable"


def _seconds(start: datetime | None, end: datetime | None) -> float:
    if start is None or end is None:
        return 0.0
    return max((end - start).total_seconds(), 0.0)


class HttpObserver:
    """ASGI middleware: counts every HTTP request in ``ptc_http_requests_total`` and logs it as one event.

    The ``route`` label is the matched route's template (``/jobs/{job_id}``), never the
    path, so it stays bounded; a request no route matches is ``unmatched``.

    Args:
        app: the wrapped application.
        metrics: where requests are counted.
        routes: the app's routes, matched when the router did not run (e.g. a refused body).
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            route = self.route_of(scope)
            self.metrics.http_request(scope["method"], route, status)
            logs.request(scope, route, status, time.perf_counter() - started)

    def route_of(self, scope: Scope) -> str:
        """The template of the route that served (or would serve) ``scope``, else ``unmatched``."""
        route = scope.get("route")
        if route is None:
            for candidate in self.routes:
                if candidate.matches(scope)[0] != Match.NONE:
                    route = candidate
                    break
        path = getattr(route, "path", None)
        return path if isinstance(path, str) else "unmatched"
