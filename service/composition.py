"""The composition root: everything the service runs, built from settings in order and wired (used by
``create_app``, whose app only installs middleware and routers and runs the lifespan).

``open_services`` builds and starts, in order: the sandbox backend, the endpoint clients, the store, the replica's
registration, the job service (``build_jobs``), idempotency, the peers' client and the store's listener; ``Services``
holds them and closes them in reverse. The script engines are built from one table, ``ENGINES`` (name -> factory
of an ``EngineSite``): today's is ``container_engine``.

``build_jobs`` builds, in this order: the sandbox side (host capacity, quotas, folders, the engines with their warm
pools, sessions, placement), the manifest cache and check threads, admission, the runner, reading, session requests,
recovery and webhooks; then subscribes metrics, logs and webhooks to the lifecycle events, and with a shared store
adds the replicas' background work (reaper, progress saves, self-fencing). ``JobManager`` holds the result and starts
and closes it in order. Nothing here is started at import or at ``build_jobs``: ``JobManager.start`` does that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service import callbacks
from service.broker import Broker, CallMemory
from service.egress import EgressPolicy, OwnAddress
from service.engines import CONTAINER, Engine, Engines
from service.engines.container import ContainerEngine
from service.errors import CallNotPending
from service.idempotency import IdempotencyKeys
from service.jobs.admission import Admission, Intake
from service.jobs.events import CallEnded, Events, JobEnded, JobLost, SandboxStarted, StatusChanged
from service.jobs.live import LiveJob, LiveJobs, resolve_limits
from service.jobs.placement import Sandboxes
from service.jobs.recovery import Recovery
from service.jobs.runner import Runner
from service.jobs.tasks import Tasks
from service.jobs.webhooks import Webhooks
from service.observability import logs, stages, telemetry
from service.observability.metrics import Metrics
from service.quotas import HostCapacity, Quotas
from service.replicas.fencing import SelfFence
from service.replicas.internal import Verifier
from service.replicas.notify import Elsewhere, Listener, Waiters
from service.replicas.progress import ProgressSaver
from service.replicas.reaper import Reaper
from service.replicas.registration import Replicas
from service.replicas.remote import Remote
from service.sandbox.backend import SandboxBackend
from service.sandbox.folders import SandboxFolders
from service.sandbox.images import Images
from service.sandbox.labels import instance_labels as labels_of
from service.sandbox.pool import WarmPools
from service.sandbox.ports import StopHook
from service.sandbox.spec import sandbox_spec
from service.schemas.job_models import ExecuteRequest
from service.sessions.manager import Session, SessionManager
from service.sessions.requests import SessionJobs
from service.settings import Settings
from service.slots import Slots
from service.store import JobStore, job_store
from service.tenancy import Caller
from service.toolkit.cache import ManifestCache
from service.toolkit.endpoints import EndpointClients
from service.toolkit.validation import CheckScheduler
from service.toolsets import Toolsets, installation_salt
from service.views.read import JobViews
from service.views.render import FULL, Body, Selection, ViewCache

log = logging.getLogger(__name__)


@dataclass
class JobParts:
    """The parts of the job service and what they own (built by ``build_jobs``)."""

    intake: Intake
    runner: Runner
    views: JobViews
    toolsets: Toolsets
    sessions: SessionJobs
    recovery: Recovery
    webhooks: Webhooks
    tasks: Tasks
    sandboxes: Sandboxes
    session_manager: SessionManager
    engines: Engines
    folders: SandboxFolders
    manifests: ManifestCache
    checks: CheckScheduler
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)  # loops run after start


class JobManager:
    """The job service: its start and close in order, and what touches more than one part (submitting a job, the
    answers and decisions about a paused call, stop). Reads, sessions and toolsets are the parts themselves.

    Args:
        parts: the parts, built by the composition root.

    Attributes:
        views: reading jobs (``JobViews``): views, output, pages, ``wait``, the event stream.
        sessions: session requests (``SessionJobs``).
        toolsets: registered manifests (``Toolsets``).
        recovery: start-up recovery and the retention purge (``Recovery.purge_expired``).
        engines: the script engines (``engines.Engines``; ``GET /readyz`` asks them).
    """

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts
        self._intake = parts.intake
        self._runner = parts.runner
        self.views = parts.views
        self.sessions = parts.sessions
        self.toolsets = parts.toolsets
        self.recovery = parts.recovery
        self.engines = parts.engines

    # -- start-up, shutdown, retention ---------------------------------------------------------

    async def start(self) -> None:
        """Recover what an earlier run left, resume pending callbacks, start the purge, sessions and the pool.

        Raises:
            WorkDirBusy: another running instance holds the work dir.
        """
        parts = self._parts
        await parts.recovery.start()
        await parts.webhooks.resume()
        parts.tasks.spawn(parts.recovery.purge_loop(), "retention purge")
        await parts.session_manager.start()
        await parts.engines.start()
        for loop in parts.background:  # with a shared store: the reaper, progress saves (docs/scaling.md, step 5)
            parts.tasks.spawn(loop(), loop.__qualname__)

    async def close(self) -> None:
        """Stop every job still running (each removes its sandbox and is saved as lost) and background work."""
        parts = self._parts
        await parts.tasks.close()
        if parts.sandboxes.removals:
            await asyncio.gather(*parts.sandboxes.removals, return_exceptions=True)
        await parts.session_manager.close()
        await parts.engines.close()
        await parts.recovery.sweep("still there at shutdown")
        await asyncio.to_thread(parts.folders.close)
        await parts.webhooks.close()
        parts.checks.close()
        parts.manifests.close()
        parts.recovery.release()

    # -- submission and the run ----------------------------------------------------------------

    async def submit(
        self, request: ExecuteRequest, owner: str, *, admin: bool = False, internal: bool = False
    ) -> LiveJob:
        """Check and admit ``request``, and start its job, owned by ``owner`` (the API key's name).

        Its ``session_id`` and ``toolset`` must be ``owner``'s own, unless ``admin`` (the admin role). A session
        open on another replica raises ``OwnerElsewhere`` (the request is relayed there), unless ``internal`` (a
        request relayed already: ``OwnerUnavailable``).

        Raises:
            ManifestError: a tool entry is unusable (names the entry and field).
            RequestLimitError: a limit exceeds its server maximum.
            InvalidField: an unknown toolset (another owner's included).
            SessionNotFound: an unknown session (another owner's included). SessionClosed: it ended.
            QueueFull: ``concurrency`` jobs run and ``max_queue`` wait already.
            QuotaExceeded: the owner is at one of its job quotas (``Quotas.admit_job``).

        Returns once the job's first save is done (or its run ended without one).
        """
        if request.session_id is not None:
            await self.sessions.locate_open(request.session_id, Caller(owner, admin, internal))
        admitted = await self._intake.admit(request, owner, admin)
        stages.mark("admitted")
        job = admitted.job
        self._runner.start(admitted).add_done_callback(lambda _: job.stored.set())
        await job.stored.wait()  # saved before it is answered: any replica finds the job its id names
        return job

    async def answer_call(
        self, job_id: str, caller: Caller, call_id: str, ok: bool, value: Any, selection: Selection = FULL
    ) -> Body:
        """Answer a client-executed call of a running job; returns the job's view after it.

        Raises:
            JobNotFound: no such job, or another owner's (only the job's owner answers its calls).
            CallNotPending: the job has ended, or that call is not waiting for an answer.
        """
        await self._settle(job_id, caller, call_id, lambda broker: broker.paused.answer_client_call(call_id, ok, value))
        return await self.views.view(job_id, caller, selection=selection)

    async def decide_approval(
        self,
        job_id: str,
        caller: Caller,
        call_id: str,
        approved: bool,
        reason: str | None,
        selection: Selection = FULL,
    ) -> Body:
        """Approve (the call goes on to its endpoint) or deny a call awaiting approval; returns the job's view.
        The record's ``approval.by`` is the caller's key name.

        Raises:
            JobNotFound: no such job, or another owner's (only the job's owner, or the admin role, decides).
            CallNotPending: the job has ended, or that call does not await approval (decided, timed out, unknown).
        """
        await self._settle(
            job_id,
            caller,
            call_id,
            lambda broker: broker.paused.decide_approval(call_id, approved, caller.owner, reason),
        )
        return await self.views.view(job_id, caller, selection=selection)

    async def _settle(self, job_id: str, caller: Caller, call_id: str, act: Callable[[Broker], None]) -> None:
        """Do ``act`` (an answer or a decision about ``call_id``) to a live job's broker, then let the job's task
        record it before its view is taken: wait for the job to change, at most 1 s.

        Raises:
            JobNotFound: no such job, or another owner's.
            CallNotPending: the job has ended, or ``act`` found no such call waiting (the broker's refusal).
        """
        job = self.views.live(job_id, caller)
        if job is None:
            await self.views.stored_view(job_id, caller)
            raise CallNotPending(call_id)
        if job.broker is None:
            raise CallNotPending(call_id)
        changed = job.changed()
        act(job.broker)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), 1.0)

    async def stop(self, job_id: str, caller: Caller, selection: Selection = FULL) -> Body:
        """Stop the job (SIGTERM to its processes, SIGKILL after the grace); returns its view.

        Idempotent: on an ended job it only returns the final view. The answer is the saved final view (the one
        ``GET`` and ``wait`` serve), whatever ended the job: the script may have exited by itself first. It waits
        for the grace and the SIGKILL's confirmation; only a sandbox slower than that gets the live view.
        Raises JobNotFound (another owner's too).
        """
        job = self.views.live(job_id, caller)
        if job is not None:
            await self._runner.stop(job)
        return await self.views.view(job_id, caller, selection=selection)


@dataclass(frozen=True)
class EngineSite:
    """What an engine is built from (``ENGINES``): the settings, the sandbox backend, the host's room, the folder
    its sandboxes' folders go under, this instance's labels, and the report of a removed sandbox."""

    settings: Settings
    backend: SandboxBackend
    capacity: HostCapacity
    folder: Path
    instance_labels: dict[str, str]
    on_stop: StopHook | None = None


def container_engine(site: EngineSite) -> Engine:
    """Today's engine (``engines.container``): resident containers on ``site.backend``, with the warm pools of
    ``PTC_WARM_POOL_*`` (their profile: the default limits and image)."""
    settings = site.settings
    jobs_dir = site.folder / "jobs"
    defaults = resolve_limits(ExecuteRequest(script=""), settings)  # the default profile
    pool = WarmPools(
        site.backend,
        sandbox_spec(settings, defaults, {}, jobs_dir, site.instance_labels),
        site.folder / "pool",
        settings.warm_pool_size,
        settings.warm_pool_max_age_s,
        settings.warm_pool_max_profiles,
        capacity=site.capacity,
        image_names={ref: name for name, ref in settings.images.items()},
        on_stop=site.on_stop,
    )
    images = Images(site.backend, settings.images)
    return ContainerEngine(
        settings, site.backend, pool, site.capacity, images, jobs_dir, site.folder / "sessions",
        site.instance_labels, site.on_stop,
    )  # fmt: skip


EngineFactory = Callable[[EngineSite], Engine]
ENGINES: dict[str, EngineFactory] = {CONTAINER: container_engine}
"""The script engines a service runs, by name (``service.engines``); a new engine is one module and one row here."""


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
    instance = settings.instance()
    instance_labels = labels_of(instance)
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
    live, events, tasks, cache = LiveJobs(), Events(), Tasks(), ViewCache(settings.view_cache_bytes)
    ending = _SessionEnd()
    sessions = SessionManager(settings.max_sessions, before_end=ending, on_count=metrics.set_sessions)
    admission = Admission(settings, quotas, Slots(settings.concurrency()), lambda: sessions.queued)
    sandboxes = Sandboxes(built, admission, sessions, set())
    toolsets = Toolsets(store, manifests, endpoints, settings.max_tools)
    secrets = callbacks.load_secrets(settings)
    intake = Intake(settings, admission, toolsets, sessions, endpoints, secrets, output_dir, live, built)
    call_memory = CallMemory(settings.max_record_bytes_total, settings.max_call_bytes_in_flight_total)
    runner = Runner(
        settings, store, events, sandboxes, endpoints, call_memory, checks, live, cache, tasks, instance, replicas
    )
    if waiters is not None:
        waiters.on_ended = cache.drop
    elsewhere = Elsewhere(store, replicas, waiters)
    views = JobViews(store, live, output_dir, cache, elsewhere)
    ending.jobs = SessionJobs(settings, sessions, sandboxes, admission, toolsets, runner, live, replicas, elsewhere)
    recovery = Recovery(settings, built, store, folders, quotas, events, cache, instance, replicas)
    webhooks = Webhooks(
        settings, store, views, cache, secrets, endpoints.egress, metrics, tasks, instance, replicas, single_tenant
    )
    _observe(events, metrics, webhooks)
    metrics.track_jobs(live)
    metrics.track_pools(built.warm)
    parts = JobParts(
        intake, runner, views, toolsets, ending.jobs, recovery, webhooks, tasks, sandboxes, sessions, built, folders,
        manifests, checks,
    )  # fmt: skip
    if waiters is not None:
        _wake_webhooks(waiters, webhooks)
    if store.shares_output:  # replicas (docs/scaling.md, step 5): SQLite serves one, which nothing fences
        reaper = Reaper(store, replicas, events, settings.replica_scan_s, settings.output_retention_bytes, metrics)
        progress = ProgressSaver(store, live, runner.save, settings.progress_save_s)
        parts.background += [reaper.loop, progress.loop]
        replicas.on_fenced.append(SelfFence(recovery.sweep, tasks))
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
    events.subscribe(JobLost, lambda _: metrics.job_lost())


def _wake_webhooks(waiters: Waiters, webhooks: Webhooks) -> None:
    """Due callbacks are claimed at once: a job marked lost, a replica that left or expired."""
    waiters.on_callbacks = webhooks.wake
    on_replicas = waiters.on_replicas

    def replicas_changed() -> None:
        on_replicas()
        webhooks.wake()

    waiters.on_replicas = replicas_changed


@dataclass
class Services:
    """Everything the app serves, in the order ``open_services`` started it; ``close`` ends it in reverse.

    Attributes:
        backend: the sandbox backend (the engines' sandboxes run on it).
        endpoints: the shared endpoint clients and egress rules.
        store: the job store, open.
        replicas: this replica's registration (started: its lease is renewed).
        jobs: the job service, started.
        idempotency: the ``Idempotency-Key`` claims and bindings.
        remote: the peers' client (with ``PTC_INTERNAL_SECRET``), else None.
        listener: the store's notifications (PostgreSQL), else None.
    """

    backend: SandboxBackend
    endpoints: EndpointClients
    store: JobStore
    replicas: Replicas
    jobs: JobManager
    idempotency: IdempotencyKeys
    remote: Remote | None
    listener: Listener | None

    async def close(self) -> None:
        """Stop the jobs, release the claims, leave the registry, flush the spans, close clients, store, backend."""
        if self.listener is not None:
            await self.listener.close()
        await self.jobs.close()
        await self.idempotency.drain()  # claims of requests that failed: released before the store closes
        await self.replicas.close()  # after its jobs' last saves: ``left``
        await asyncio.to_thread(telemetry.flush)  # the spans of the jobs just ended too
        await self.endpoints.aclose()
        if self.remote is not None:
            await self.remote.aclose()
        await self.store.close()
        await self.backend.close()


def docker_backend(settings: Settings) -> SandboxBackend:
    """The Docker backend on ``settings.docker_host`` (its SDK imported only now: tests run without it)."""
    from service.sandbox.docker import DockerBackend

    return DockerBackend(settings.docker_host, max_workers=4 * settings.concurrency() + 8, runtime=settings.runtime)


async def open_services(
    settings: Settings,
    metrics: Metrics,
    verifier: Verifier,
    secrets: list[bytes],
    *,
    backend: SandboxBackend | None = None,
    single_tenant: bool = False,
    engines: Mapping[str, EngineFactory] = ENGINES,
    default_engine: str = CONTAINER,
) -> Services:
    """Build and start everything the app serves, in order: the backend (``docker_backend`` unless given), the
    endpoint clients, the store (opened: migrations first), the replica's registration, the job service
    (``build_jobs``, started: recovery, the engines), the egress rules' refusal of the replicas' own addresses,
    idempotency, the peers' client (``secrets``: ``PTC_INTERNAL_SECRET``'s), and with PostgreSQL the listener.
    ``verifier`` is aimed at this replica's incarnation once it is registered.

    Raises:
        WorkDirBusy: another running instance holds the work dir.
        StoreUnavailable: the store cannot be opened (a PostgreSQL down refuses the start).
        ValueError: ``default_engine`` is not one of ``engines``.
    """
    backend = backend if backend is not None else docker_backend(settings)
    endpoints = EndpointClients(
        settings.tool_timeout_s,
        settings.max_tool_result_bytes,
        EgressPolicy(settings.egress_allow, own=[OwnAddress.of(settings.host, settings.port)]),
    )
    store = job_store(settings)
    await store.open()  # migrations first (docs/operations.md, Job store); a PostgreSQL down refuses the start
    replicas = Replicas(settings, store, on_count=metrics.set_replicas, on_renewal=metrics.lease_renewal)
    waiters = Waiters() if settings.store_url is not None else None
    if waiters is not None:
        waiters.on_replicas = replicas.refresh_soon
    jobs = build_jobs(
        settings, backend, endpoints, store, metrics, replicas, waiters,
        single_tenant=single_tenant, engines=engines, default_engine=default_engine,
    )  # fmt: skip
    await jobs.start()  # registers this replica (after the work-dir lock, before the sweep)
    incarnation = replicas.incarnation
    verifier.target = f"{incarnation.instance_id}.{incarnation.epoch}"  # signed calls to this incarnation only
    replicas.on_registry.append(
        lambda rows: endpoints.egress.refuse_peers(row.internal_url for row in rows if row.holds_lease)
    )  # the egress rules refuse every live replica's internal address, as this one's own
    endpoints.egress.refuse_peers(row.internal_url for row in replicas.registry.values() if row.holds_lease)
    replicas.start()
    idempotency = IdempotencyKeys(store, replicas.incarnation)  # claims carry this incarnation
    if waiters is not None:
        waiters.on_keys = idempotency.wake_digest  # ptc_keys: another replica bound or released a claim
    remote = None
    if secrets:
        remote = Remote(secrets[0], settings.instance(), single_tenant=single_tenant)
        remote.alive = lambda owner: replicas.holds_now(owner.instance_id, owner.epoch)
    listener = None
    if waiters is not None and settings.store_url is not None:  # LISTEN: wait on other replicas' jobs
        listener = Listener(
            settings.store_url.get_secret_value(), waiters, settings.store_timeout_s, metrics.listener_reconnected
        )
        listener.start()
        try:  # a wait must not miss an end for want of a listener; a slow store only delays it
            await asyncio.wait_for(listener.listening.wait(), settings.store_timeout_s)
        except TimeoutError:
            log.warning("the store's notifications are not received yet: waits on other replicas' jobs lag")
    return Services(backend, endpoints, store, replicas, jobs, idempotency, remote, listener)
