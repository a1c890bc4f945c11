"""Health and metrics: ``GET /healthz`` (liveness), ``GET /readyz`` (readiness), ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppMetrics, AppSettings, Key, Keys, ScriptEngines, Store
from service.api.problems import FORBIDDEN, NOT_READY
from service.errors import SandboxError, StoreUnavailable
from service.observability.metrics import CONTENT_TYPE
from service.replicas.notify import Listener
from service.replicas.registration import Replicas
from service.tenancy import may_scrape

router = APIRouter(route_class=ParsedOffLoop)

READY_PARTS = ("lease", "draining", "store", "listener", "engine", "images")
"""The values of a ``/readyz`` 503's ``reason``: the part that is not ready."""


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}, 403: {}})
async def metrics_route(metrics: AppMetrics, keys: Keys, key: Key) -> Response:
    """Prometheus metrics (text format 0.0.4); the names and labels are listed in docs/operations.md ("Metrics").

    With authentication, only the admin role and the keys in ``PTC_METRICS_KEYS`` may read them
    (unless ``PTC_METRICS_AUTH=open``); another key gets 403.
    """
    if not may_scrape(keys, key):
        return FORBIDDEN.response(
            "this API key may not read /metrics: it needs the admin role (PTC_ADMIN_KEYS) or to be named in "
            "PTC_METRICS_KEYS"
        )
    return Response(metrics.exposition(), media_type=CONTENT_TYPE)


@router.get("/readyz", responses={503: {}})
async def readyz(request: Request, engines: ScriptEngines, settings: AppSettings, store: Store) -> Response:
    """Readiness (docs/scaling.md, Operability): this replica holds its lease (``Replicas.ready``: not fenced, not
    within a heartbeat of its deadline) and is not draining, the job store answers ``SELECT 1`` (within
    ``PTC_STORE_TIMEOUT_S``), its listener is connected (PostgreSQL), and every script engine is ready
    (``Engine.ready``: the container engine's backend answers and the sandbox image is present) and can run every
    other image of ``PTC_IMAGES`` (``Engine.missing_images``: present, with the ``session`` feature).

    A 503 names the failing part in ``reason`` (``READY_PARTS``: ``lease``, ``draining``, ``store``,
    ``listener``, ``engine``, ``images``), the engine at fault in ``detail``, each missing image by its name
    (``missing_images``), and never the store's URL. The 200 lists the names requests may choose (``images``), the
    default image's reference (``image``), the store's kind (``store``: ``postgresql`` or ``sqlite``) and the
    replicas holding their lease in the registry at this replica's last read (``replicas``).
    """
    replicas = request.app.state.replicas
    registered = isinstance(replicas, Replicas)
    lease = replicas.ready() if registered else None
    if lease is not None:
        return NOT_READY.response(lease, reason="lease")
    if registered and replicas.draining:
        return NOT_READY.response("this replica is draining: it takes no new work", reason="draining")
    try:
        await store.ping()
    except StoreUnavailable as exc:
        return NOT_READY.response(str(exc), reason="store")
    listener = getattr(request.app.state, "listener", None)
    if isinstance(listener, Listener) and not listener.listening.is_set():
        return NOT_READY.response(
            "the job store's notifications are not received (its listening connection is re-opening)",
            reason="listener",
        )
    for engine in engines.values():
        ok, why = await engine.ready()
        if not ok:
            return NOT_READY.response(f"engine {engine.name!r}: {why}", reason="engine")
    for engine in engines.values():
        try:
            missing = await engine.missing_images()
        except SandboxError as exc:
            return NOT_READY.response(f"engine {engine.name!r}: {exc}", reason="engine")
        if missing:
            detail = f"engine {engine.name!r}: " + "; ".join(missing.values())
            return NOT_READY.response(detail, reason="images", missing_images=sorted(missing))
    live = sum(1 for row in replicas.registry.values() if row.holds_lease) if registered else 0
    return JSONResponse(
        {
            "status": "ready",
            "image": settings.sandbox_image,
            "images": sorted(settings.images),
            "store": "sqlite" if settings.store_url is None else "postgresql",
            "replicas": live,
        }
    )
