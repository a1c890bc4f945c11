"""The job service built from settings (``build_jobs``), in this order: the sandbox side (host capacity, quotas,
folders, the engines of ``engine_table.ENGINES`` with their warm pools, sessions, placement), the manifest cache and
check threads, admission, the runner, reading, session requests, recovery and webhooks; then metrics, logs and
webhooks subscribed to the lifecycle events (the run path imports none of them), the webhooks woken by the store's
notifications, and with a shared store the replicas' background work (reaper, progress saves, self-fencing).
Nothing is started here: ``JobManager.start`` does that.
"""

from __future__ import annotations

from collections.abc import Mapping

from service import callbacks
from service.broker import BrokerShared, CallMemory
from service.callbacks import CallbackPolicy
from service.composition.engine_table import ENGINES, EngineFactory
from service.composition.job_manager import JobManager, JobParts
from service.engines import CONTAINER, Engines, EngineSite
from service.jobs.admission import Admission, Intake
from service.jobs.events import (
    CallEnded,
    Events,
    JobEnded,
    JobLost,
    JobParked,
    ParkedJobStopped,
    SandboxStarted,
    StatusChanged,
)
from service.jobs.live import LiveJobs
from service.jobs.model import JobStatus
from service.jobs.parking import ParkedJobs
from service.jobs.placement import Sandboxes
from service.jobs.recovery import Recovery
from service.jobs.runner import Runner
from service.jobs.state import JobState
from service.jobs.tasks import Tasks
from service.jobs.webhooks import Webhooks
from service.observability import logs
from service.observability.metrics import Metrics
from service.quotas import HostCapacity, Quotas
from service.replicas.fencing import SelfFence
from service.replicas.notify import Elsewhere, Waiters
from service.replicas.progress import ProgressSaver
from service.replicas.reaper import Reaper
from service.replicas.registration import Replicas
from service.sandbox.backend import SandboxBackend
from service.sandbox.folders import SandboxFolders
from service.sandbox.labels import instance_labels as labels_of
from service.sessions.manager import Session, SessionManager
from service.sessions.requests import SessionJobs
from service.settings import Settings
from service.slots import Slots
from service.store import JobStore
from service.toolkit.cache import ManifestCache
from service.toolkit.endpoints import EndpointClients
from service.toolkit.validation import CheckScheduler
from service.toolsets import Toolsets, installation_salt
from service.views.read import JobViews
from service.views.render import ViewCache


def build_jobs(
    settings: Settings,
    backend: SandboxBackend,
    endpoints: EndpointClients,
    store: JobStore,
    metrics: Metrics,
    replicas: Replicas,
    waiters: Waiters | None = None,
    *,
    single_tenant: bool = False,
    engines: Mapping[str, EngineFactory] = ENGINES,
    default_engine: str = CONTAINER,
) -> JobManager:
    """The job service and its parts, with metrics, logs and webhooks subscribed to its lifecycle events.
    Nothing is started: ``JobManager.start`` does that.

    ``waiters``: the store listener's (PostgreSQL), which ``wait`` on another replica's job uses.
    ``single_tenant``: one tenant (``tenancy.single_tenant``): per-key shares default to the whole (``Quotas``,
    ``Webhooks``' deliveries per owner). ``engines``: the script engines to build (name -> factory), of which
    ``default_engine`` runs every request.

    Raises:
        InsecureConfig: a malformed ``PTC_CALLBACK_SECRETS``.
        ValueError: ``default_engine`` is not one of ``engines``.
    """
    instance_labels = labels_of(settings.instance())
    capacity = HostCapacity.from_settings(settings)
    quotas = Quotas(settings, capacity, single_tenant=single_tenant)
    folders = SandboxFolders(settings.work_dir / "run", settings.sandbox_folders_tmpfs_mb)
    output_dir = settings.work_dir / "output"
    site = EngineSite(settings, backend, capacity, folders.path, instance_labels, logs.sandbox_stopped)
    built = Engines({name: factory(site) for name, factory in engines.items()}, default_engine)
    manifests = ManifestCache(
        installation_salt(settings.work_dir), threads=settings.manifest_threads, budget_s=settings.manifest_budget_s
    )
    checks = CheckScheduler(settings.validation_threads, settings.validation_budget_s)
    parked = ParkedJobs(settings.max_parked_jobs, shared=not single_tenant)
    state = JobState(LiveJobs(), Events(), Tasks(), ViewCache(settings.view_cache_bytes), parked)
    live, events, tasks, cache = state.live, state.events, state.tasks, state.final_views
    ending = _SessionEnd()
    sessions = SessionManager(settings.max_sessions, before_end=ending, on_count=metrics.set_sessions)
    admission = Admission(settings, quotas, Slots(settings.concurrency()), lambda: sessions.queued)
    sandboxes = Sandboxes(built, admission, sessions, set())
    toolsets = Toolsets(store, manifests, endpoints, settings.max_tools)
    callback_policy = CallbackPolicy(callbacks.load_secrets(settings), endpoints.egress, single_tenant)
    intake = Intake(settings, admission, toolsets, sessions, callback_policy, live, built)
    call_memory = CallMemory(settings.max_record_bytes_total, settings.max_call_bytes_in_flight_total)
    runner = Runner(settings, store, state, sandboxes, BrokerShared(endpoints, checks, call_memory), replicas)
    if waiters is not None:
        waiters.on_ended = cache.drop
    elsewhere = Elsewhere(store, replicas, waiters)
    views = JobViews(store, live, output_dir, cache, elsewhere)
    ending.jobs = SessionJobs(settings, sandboxes, toolsets, runner, live, replicas, elsewhere)
    recovery = Recovery(settings, built, store, folders, quotas, state, replicas)
    webhooks = Webhooks(settings, store, views, state, callback_policy, metrics, replicas)
    _observe(events, metrics, webhooks)
    metrics.track_jobs(live)
    metrics.track_parked(lambda: len(parked))
    metrics.track_pools(built.warm)
    parts = JobParts(
        intake, runner, views, toolsets, ending.jobs, recovery, webhooks, tasks, sandboxes, sessions, built, folders,
        manifests, checks, parked, store,
    )  # fmt: skip
    if waiters is not None:
        _wake_webhooks(waiters, webhooks)
    if store.shares_output:  # replicas (docs/scaling.md, step 5): SQLite serves one, which nothing fences
        reaper = Reaper(store, replicas, events, settings.replica_scan_s, settings.output_retention_bytes, metrics)
        progress = ProgressSaver(store, live, runner.save, settings.progress_save_s)
        parts.background += [reaper.loop, progress.loop]
        replicas.on_fenced.append(SelfFence(recovery.sweep, tasks))
        manager = JobManager(parts)
        reaper.adopt = manager.adopt_orphan  # a dead replica's durable jobs are resumed here
        return manager
    return JobManager(parts)


class _SessionEnd:
    """What a session does before it ends: stop its running job (``SessionJobs``, built after the sessions)."""

    def __init__(self) -> None:
        self.jobs: SessionJobs | None = None

    async def __call__(self, session: Session) -> None:
        if self.jobs is not None:
            await self.jobs.end_session_jobs(session)


def _observe(events: Events, metrics: Metrics, webhooks: Webhooks) -> None:
    """Subscribe metrics, logs and webhooks to the lifecycle events (the run path imports none of them)."""

    def sandbox_started(event: SandboxStarted) -> None:
        job = event.job
        metrics.sandbox_started(job.sandbox_start, event.seconds)
        logs.sandbox("sandbox_start", job.id, job.sandbox_id, event.seconds, mode=job.sandbox_start)

    def call_ended(event: CallEnded) -> None:
        metrics.tool_call(event.record)
        logs.tool_call(event.job.id, event.record)

    def job_ended(event: JobEnded) -> None:
        metrics.job_ended(event.job)
        logs.job(event.job)

    events.subscribe(StatusChanged, lambda event: logs.job(event.job))
    events.subscribe(CallEnded, call_ended)
    events.subscribe(SandboxStarted, sandbox_started)
    events.subscribe(JobEnded, job_ended)
    events.subscribe(JobEnded, webhooks.job_ended)
    events.subscribe(JobLost, lambda _: metrics.ended_from_store(JobStatus.LOST))
    events.subscribe(ParkedJobStopped, lambda _: metrics.ended_from_store(JobStatus.STOPPED))
    events.subscribe(JobParked, lambda _: metrics.parked.inc())


def _wake_webhooks(waiters: Waiters, webhooks: Webhooks) -> None:
    """Due callbacks are claimed at once: a job marked lost, a replica that left or expired."""
    waiters.on_callbacks = webhooks.wake
    on_replicas = waiters.on_replicas

    def replicas_changed() -> None:
        on_replicas()
        webhooks.wake()

    waiters.on_replicas = replicas_changed
