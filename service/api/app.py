"""The app factory, ``create_app``. It reads the settings, installs the middleware (metrics, authentication, body
size), the error handler (``problems``) and the served OpenAPI document, includes one router per resource
(``routers/``), and runs the lifespan: what it serves is built, started and closed by the composition root
(``service.composition.root.open_services``). Routes reach the services through ``deps``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import State
from starlette.routing import BaseRoute

from service import __version__, callbacks, collector
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
from service.composition.engine_table import ENGINES, EngineFactory
from service.composition.job_manager import JobManager
from service.composition.root import open_services
from service.engines import CONTAINER, Engines
from service.errors import InsecureConfig, SandboxError
from service.mcp import front as mcp_front
from service.observability import telemetry
from service.observability.metrics import HttpObserver, Metrics
from service.observability.stages import StageTiming
from service.replicas import internal
from service.sandbox.backend import SandboxBackend
from service.settings import Settings
from service.tenancy import configure, single_tenant
from service.toolkit.validation import CheckScheduler

log = logging.getLogger(__name__)

# One router per resource, included in this order (the OpenAPI document's).
RESOURCES = (jobs_router, sessions_router, tools_router, health_router, docs_router)


def create_app(
    settings: Settings | None = None,
    backend: SandboxBackend | None = None,
    *,
    engines: Mapping[str, EngineFactory] = ENGINES,
    default_engine: str = CONTAINER,
) -> FastAPI:
    """Build the service: its middleware, routers and lifespan; the lifespan builds and starts what it serves
    (``composition.root.open_services``) and closes it.

    Args:
        settings: configuration; default: read from ``PTC_*`` environment variables.
        backend: sandbox backend; default: ``DockerBackend`` on ``settings.docker_host``.
        engines: the script engines (name -> factory, ``composition.engine_table.ENGINES``); ``default_engine``
            runs every request (tests register their own).

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
        services = await open_services(
            settings, metrics, verifier, secrets,
            backend=backend, single_tenant=single_tenant(keys), engines=engines, default_engine=default_engine,
        )  # fmt: skip
        state = app.state
        state.store, state.replicas, state.remote, state.listener = (
            services.store, services.replicas, services.remote, services.listener,
        )  # fmt: skip  # /readyz: not ready while the listener re-opens
        state.jobs, state.backend, state.idempotency = services.jobs, services.backend, services.idempotency
        state.engines = services.jobs.engines  # /readyz asks them
        _serve(state, services.jobs)
        await _check_engines(services.jobs.engines, settings)
        collector.freeze_startup()
        log.info(
            "ptc-sandbox %s ready: instance %s, image %s, store %s",
            __version__,
            settings.instance(),
            settings.sandbox_image,
            services.store.describe(),  # never the password
        )
        try:
            async with mcp_front.lifespan(app, mcp_endpoint, settings.mcp_toolset):
                yield
        finally:
            await services.close()
            state.bodies.close()

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
    app.state.idempotency = app.state.store = app.state.replicas = app.state.engines = NOT_STARTED
    app.state.listener = None  # PostgreSQL store only
    app.state.remote, app.state.verifier = None, verifier
    for resource in RESOURCES:
        app.include_router(resource.router)
    return app


async def _check_engines(engines: Engines, settings: Settings) -> None:
    """Log each engine that cannot run scripts now (``Engine.ready``), each image of ``PTC_IMAGES`` an engine cannot
    run (``Engine.missing_images``), and the names requests may choose. Never raises: what is missing is reported by
    ``GET /readyz`` and refused per request (503) until it is fixed."""
    for engine in engines.values():
        ok, reason = await engine.ready()
        if not ok:
            log.warning(
                "not ready yet: engine %r: %s (GET /readyz answers 503 until this is fixed)", engine.name, reason
            )
    checked = True
    for engine in engines.values():
        try:
            missing = await engine.missing_images()
        except SandboxError as exc:
            log.warning("images of PTC_IMAGES not checked by engine %r: %s", engine.name, exc)
            checked = False
            continue
        for name, problem in missing.items():
            ref = settings.images.get(name, name)
            log.warning("%s: %s (GET /readyz answers 503 until this is fixed)", ref, problem)
    if checked and len(settings.images) > 1:
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
