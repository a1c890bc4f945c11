"""The app factory, ``create_app``: the composition root. It reads the settings, builds the services (in the
lifespan: backend, endpoint clients, store, job manager), the middleware (metrics, authentication, body size),
the error handler (``problems``) and the served OpenAPI document, and includes one router per resource
(``routers/``). Routes reach the services through ``deps``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import State
from starlette.routing import BaseRoute

from service import __version__, callbacks
from service.api import forward, problems
from service.api.auth import BearerAuth, open_paths
from service.api.bodies import BODY_THREADS, BodyLimit, ParsedOffLoop
from service.api.deps import NOT_STARTED, SessionService, ToolsetService
from service.api.openapi import document
from service.api.problems import OWNER_UNAVAILABLE, UNAUTHORIZED
from service.api.reads import ReadSlots
from service.api.routers import docs as docs_router
from service.api.routers import health as health_router
from service.api.routers import jobs as jobs_router
from service.api.routers import sessions as sessions_router
from service.api.routers import tools as tools_router
from service.composition import JobManager, build_jobs
from service.egress import EgressPolicy, OwnAddress
from service.errors import InsecureConfig, SandboxError
from service.idempotency import IdempotencyKeys
from service.mcp import front as mcp_front
from service.observability import telemetry
from service.observability.metrics import HttpObserver, Metrics
from service.observability.stages import StageTiming
from service.replicas import internal
from service.replicas.notify import Listener, Waiters
from service.replicas.registration import Replicas
from service.replicas.remote import Remote
from service.sandbox.backend import SandboxBackend
from service.sandbox.images import Images
from service.settings import DEFAULT_IMAGE, Settings
from service.store import job_store
from service.tenancy import configure, single_tenant
from service.toolkit.endpoints import EndpointClients
from service.toolkit.validation import CheckScheduler

log = logging.getLogger(__name__)

# One router per resource, included in this order (the OpenAPI document's).
RESOURCES = (jobs_router, sessions_router, tools_router, health_router, docs_router)


def create_app(settings: Settings | None = None, backend: SandboxBackend | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: configuration; default: read from ``PTC_*`` environment variables.
        backend: sandbox backend; default: ``DockerBackend`` on ``settings.docker_host``.

    Raises:
        InsecureConfig: the authentication settings are unusable or unsafe (``auth.configure``).
        ModuleNotFoundError: ``fastapi-offline`` (the assets of ``/docs`` and ``/redoc``) is not installed.
        pydantic.ValidationError: ``settings`` not given and the ``PTC_*`` variables are invalid (e.g. a default
            above its maximum).
    """
    settings = settings or Settings()
    keys = configure(settings)
    try:  # here, not in a validator of Settings: pydantic's errors would show the value
        given = settings.internal_secret.get_secret_value() if settings.internal_secret else ""
        secrets = internal.parse_secrets(given) if given.strip() else []
    except ValueError as exc:
        raise InsecureConfig(str(exc)) from None
    if settings.store_url is not None and not secrets:
        raise InsecureConfig(
            "a PostgreSQL store (PTC_STORE_URL) needs PTC_INTERNAL_SECRET: the replicas sign their internal calls "
            "with it (at least 32 characters, the same on every replica)"
        )
    verifier = internal.Verifier(secrets)
    telemetry.configure_from_env()  # off unless the OTEL_* variables ask for traces (docs/telemetry.md)
    callbacks.load_secrets(settings)  # a malformed PTC_CALLBACK_SECRETS refuses the start now, not at the lifespan

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal backend
        if backend is None:
            from service.sandbox.docker import DockerBackend

            backend = DockerBackend(
                settings.docker_host, max_workers=4 * settings.concurrency() + 8, runtime=settings.runtime
            )
        endpoints = EndpointClients(
            settings.tool_timeout_s,
            settings.max_tool_result_bytes,
            EgressPolicy(settings.egress_allow, own=[OwnAddress.of(settings.host, settings.port)]),
        )
        store = job_store(settings)
        await store.open()  # migrations first (docs/operations.md, Job store); a PostgreSQL down refuses the start
        app.state.store = store
        replicas = app.state.replicas = Replicas(
            settings, store, on_count=metrics.set_replicas, on_renewal=metrics.lease_renewal
        )
        waiters = Waiters() if settings.store_url is not None else None
        if waiters is not None:
            waiters.on_replicas = replicas.refresh_soon
        jobs = build_jobs(
            settings, backend, endpoints, store, metrics, replicas, waiters, single_tenant=single_tenant(keys)
        )
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
        if secrets:
            app.state.remote = Remote(secrets[0], settings.instance(), single_tenant=single_tenant(keys))
            app.state.remote.alive = lambda owner: replicas.holds_now(owner.instance_id, owner.epoch)
        listener = None
        if waiters is not None and settings.store_url is not None:  # LISTEN: wait on other replicas' jobs
            listener = Listener(
                settings.store_url.get_secret_value(), waiters, settings.store_timeout_s, metrics.listener_reconnected
            )
            app.state.listener = listener  # /readyz: not ready while it re-opens
            listener.start()
            try:  # a wait must not miss an end for want of a listener; a slow store only delays it
                await asyncio.wait_for(listener.listening.wait(), settings.store_timeout_s)
            except TimeoutError:
                log.warning("the store's notifications are not received yet: waits on other replicas' jobs lag")
        app.state.jobs, app.state.backend = jobs, backend
        app.state.idempotency = idempotency
        _serve(app.state, jobs)
        ok, reason = await backend.ready(settings.sandbox_image)
        if not ok:
            log.warning("not ready yet: %s (GET /readyz answers 503 until this is fixed)", reason)
        await _check_images(backend, settings)
        log.info(
            "ptc-sandbox %s ready: instance %s, image %s, store %s",
            __version__,
            settings.instance(),
            settings.sandbox_image,
            store.describe(),  # never the password
        )
        try:
            async with mcp_front.lifespan(app, mcp_endpoint, settings.mcp_toolset):
                yield
        finally:
            if listener is not None:
                await listener.close()
            await jobs.close()
            await idempotency.drain()  # claims of requests that failed: released before the store closes
            await replicas.close()  # after its jobs' last saves: ``left``
            await asyncio.to_thread(telemetry.flush)  # the spans of the jobs just ended too
            app.state.bodies.close()
            await endpoints.aclose()
            if app.state.remote is not None:
                await app.state.remote.aclose()
            await store.close()
            await backend.close()

    # No trailing-slash redirects: Starlette would build their Location from the request's Host header.
    # /docs and /redoc are docs_router's: FastAPI's own would load their scripts from a CDN.
    app = FastAPI(
        title="ptc-sandbox",
        version=__version__,
        lifespan=lifespan,
        redirect_slashes=False,
        docs_url=None,
        redoc_url=None,
    )
    app.router.route_class = ParsedOffLoop
    mcp_endpoint = mcp_front.mount(app)  # /mcp, outside the OpenAPI document; before HttpObserver takes the routes
    app.state.bodies = CheckScheduler(BODY_THREADS, budget_s=3600.0)  # parsing does not count ticks: no budget
    metrics = app.state.metrics = Metrics(settings)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.state.docs_assets = docs_router.load_assets()
    opened = open_paths(settings) | docs_router.OPEN_PATHS  # the API documents hold no tenant's data
    verifier.on_outcome = metrics.internal_request
    app.add_middleware(
        BearerAuth,
        keys=keys,
        open_paths=opened,
        deny=UNAUTHORIZED.response,
        verifier=verifier if secrets else None,
        unavailable=OWNER_UNAVAILABLE.response,
        body_limit=settings.max_body_bytes,
    )  # before the body
    app.add_middleware(HttpObserver, metrics=metrics, routes=_observed_routes(app))  # outermost: sees every answer
    app.add_middleware(StageTiming, admin=lambda name: keys is None or name in keys.admins)  # admins' X-PTC-Stages
    document(app, opened, authenticated=keys is not None)
    problems.install(app)
    forward.install(app)  # OwnerElsewhere: relayed to the owner (after problems: the nearer class wins)
    telemetry.instrument_app(app)  # a span per request, outermost (tracing on only)
    app.state.settings, app.state.keys = settings, keys
    app.state.reads = ReadSlots(settings.max_reads_per_key, settings.retry_after_s)
    app.state.jobs = app.state.sessions = app.state.toolsets = app.state.backend = NOT_STARTED  # deps.NotStarted
    app.state.idempotency = app.state.store = app.state.replicas = NOT_STARTED
    app.state.listener = None  # PostgreSQL store only
    app.state.remote, app.state.verifier = None, verifier
    for resource in RESOURCES:
        app.include_router(resource.router)
    return app


async def _check_images(backend: SandboxBackend, settings: Settings) -> None:
    """Log each image of ``PTC_IMAGES`` (the default one aside: checked with the engine) that cannot run scripts
    now, and the names requests may choose. Never raises: a missing image is reported by ``GET /readyz`` and
    refused per request (503) until it is built."""
    others = {name: ref for name, ref in settings.images.items() if name != DEFAULT_IMAGE}
    if not others:
        return
    try:
        missing = await Images(backend, others).missing()
    except SandboxError as exc:
        log.warning("images of PTC_IMAGES not checked: %s", exc)
        return
    for name, problem in missing.items():
        log.warning("%s: %s (GET /readyz answers 503 until this is fixed)", others[name], problem)
    log.info("images requests may choose: %s", ", ".join(sorted(settings.images)))


def _observed_routes(app: FastAPI) -> list[BaseRoute]:
    """The routes ``HttpObserver`` matches a request against when the router did not run (a body refused by
    ``BodyLimit``, a key refused by ``BearerAuth``): FastAPI's own (``/openapi.json``) and each
    resource's, as declared (an app's included router is one opaque route in recent FastAPI versions)."""
    return [*app.router.routes, *(route for resource in RESOURCES for route in resource.router.routes)]


def _serve(state: State, manager: JobManager) -> None:
    """The sessions and toolsets resources of ``deps``: the job service's own parts."""
    sessions: SessionService = manager.sessions
    toolsets: ToolsetService = manager.toolsets
    state.sessions, state.toolsets = sessions, toolsets
