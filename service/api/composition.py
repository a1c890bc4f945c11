"""The composition of the job service: its parts built from settings and wired together (used by ``create_app``)."""

from __future__ import annotations

from service import callbacks
from service.jobs import JobManager
from service.observability.metrics import Metrics
from service.replicas.notify import Elsewhere, Waiters
from service.replicas.registration import Replicas
from service.sandbox.backend import SandboxBackend
from service.settings import Settings
from service.store import JobStore
from service.toolkit.endpoints import EndpointClients
from service.toolkit.validation import CheckScheduler


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
) -> JobManager:
    """The job service and its parts (the composition of ``service.jobs``), with metrics, logs and webhooks
    subscribed to its lifecycle events. Nothing is started: ``JobManager.start`` does that.

    ``waiters``: the store listener's (PostgreSQL), which ``wait`` on another replica's job uses.
    ``single_tenant``: one tenant (``auth.single_tenant``): per-key shares default to the whole (``Quotas``,
    ``Webhooks``' deliveries per owner).

    Raises:
        InsecureConfig: a malformed ``PTC_CALLBACK_SECRETS``.
    """
    from service.broker import CallMemory
    from service.jobs import JobParts
    from service.jobs.admission import Admission, Intake
    from service.jobs.events import CallEnded, Events, JobEnded, JobLost, SandboxStarted, StatusChanged
    from service.jobs.live import LiveJob, resolve_limits
    from service.jobs.placement import Sandboxes
    from service.jobs.recovery import Recovery
    from service.jobs.runner import Runner
    from service.jobs.tasks import Tasks
    from service.jobs.webhooks import Webhooks
    from service.observability import logs
    from service.quotas import HostCapacity, Quotas, Slots
    from service.replicas.fencing import SelfFence
    from service.replicas.progress import ProgressSaver
    from service.replicas.reaper import Reaper
    from service.sandbox.folders import SandboxFolders
    from service.sandbox.images import Images
    from service.sandbox.labels import instance_labels as labels_of
    from service.sandbox.pool import WarmPools
    from service.sandbox.spec import sandbox_spec
    from service.schemas import ExecuteRequest
    from service.sessions.manager import Session, SessionManager
    from service.sessions.requests import SessionJobs
    from service.toolkit.cache import ManifestCache
    from service.toolsets import Toolsets, installation_salt
    from service.views.read import JobViews
    from service.views.render import ViewCache

    instance = settings.instance()
    instance_labels = labels_of(instance)
    capacity = HostCapacity.from_settings(settings)
    quotas = Quotas(settings, capacity, single_tenant=single_tenant)
    folders = SandboxFolders(settings.work_dir / "run", settings.sandbox_folders_tmpfs_mb)
    jobs_dir, output_dir = folders.path / "jobs", settings.work_dir / "output"
    defaults = resolve_limits(ExecuteRequest(script=""), settings)  # the default profile
    pool = WarmPools(
        backend,
        sandbox_spec(settings, defaults, {}, jobs_dir, instance_labels),
        folders.path / "pool",
        settings.warm_pool_size,
        settings.warm_pool_max_age_s,
        settings.warm_pool_max_profiles,
        capacity=capacity,
        image_names={ref: name for name, ref in settings.images.items()},
    )
    manifests = ManifestCache(
        installation_salt(settings.work_dir), threads=settings.manifest_threads, budget_s=settings.manifest_budget_s
    )
    checks = CheckScheduler(settings.validation_threads, settings.validation_budget_s)
    live: dict[str, LiveJob] = {}
    events, tasks, cache = Events(), Tasks(), ViewCache(settings.view_cache_bytes)
    session_jobs: SessionJobs | None = None

    async def before_end(session: Session) -> None:
        if session_jobs is not None:
            await session_jobs.end_session_jobs(session)

    sessions = SessionManager(
        backend, folders.path / "sessions", settings.max_sessions, before_end=before_end, on_count=metrics.set_sessions
    )
    admission = Admission(settings, quotas, Slots(settings.concurrency()), lambda: sessions.queued)
    images = Images(backend, settings.images)
    sandboxes = Sandboxes(backend, pool, capacity, admission, sessions, jobs_dir, instance_labels, set(), images)
    toolsets = Toolsets(store, manifests, endpoints, settings.max_tools)
    secrets = callbacks.load_secrets(settings)
    intake = Intake(settings, admission, toolsets, sessions, endpoints, secrets, output_dir, live, images)
    call_memory = CallMemory(settings.max_record_bytes_total, settings.max_call_bytes_in_flight_total)
    runner = Runner(
        settings, store, events, sandboxes, endpoints, call_memory, checks, live, cache, tasks, instance, replicas
    )
    if waiters is not None:
        waiters.on_ended = cache.drop
    elsewhere = Elsewhere(store, replicas, waiters)
    views = JobViews(store, live, output_dir, cache, elsewhere)
    session_jobs = SessionJobs(settings, sessions, sandboxes, admission, toolsets, runner, live, replicas, elsewhere)
    recovery = Recovery(settings, backend, store, folders, quotas, events, cache, instance_labels, instance, replicas)
    webhooks = Webhooks(
        settings, store, views, cache, secrets, endpoints.egress, metrics, tasks, instance, replicas, single_tenant
    )
    if waiters is not None:  # due callbacks are claimed at once: a job marked lost, a replica that left or expired
        waiters.on_callbacks = webhooks.wake
        on_replicas = waiters.on_replicas

        def replicas_changed() -> None:
            on_replicas()
            webhooks.wake()

        waiters.on_replicas = replicas_changed

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
    events.subscribe(JobLost, lambda _: metrics.job_lost())
    metrics.track_jobs(live)
    metrics.track_pools(pool.sizes)
    parts = JobParts(
        intake, runner, views, toolsets, session_jobs, recovery, webhooks, tasks, sandboxes, sessions, pool, folders,
        manifests, checks,
    )  # fmt: skip
    if store.shares_output:  # replicas (docs/scaling.md, step 5): SQLite serves one, which nothing fences
        reaper = Reaper(store, replicas, events, settings.replica_scan_s, settings.output_retention_bytes, metrics)
        progress = ProgressSaver(store, live, runner.save, settings.progress_save_s)
        parts.background += [reaper.loop, progress.loop]
        replicas.on_fenced.append(SelfFence(recovery.sweep, tasks))
    return JobManager(parts)
