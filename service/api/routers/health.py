"""Health and metrics: ``GET /healthz`` (liveness), ``GET /readyz`` (readiness), ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppMetrics, AppSettings, Backend, Key, Keys, Store
from service.api.problems import FORBIDDEN, NOT_READY
from service.errors import SandboxError, StoreUnavailable
from service.observability.metrics import CONTENT_TYPE
from service.replicas.notify import Listener
from service.replicas.registration import Replicas
from service.sandbox.images import Images
from service.settings import DEFAULT_IMAGE
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
async def readyz(request: Request, backend: Backend, settings: AppSettings, store: Store) -> Response:
    """Readiness (docs/scaling.md, Operability): this replica holds its lease (``Replicas.ready``: not fenced, not
    within a heartbeat of its deadline) and is not draining, the job store answers ``SELECT 1`` (within
    ``PTC_STORE_TIMEOUT_S``), its listener is connected (PostgreSQL), the engine answers, the sandbox image is
    present, and so is every other image of ``PTC_IMAGES`` (with the ``session`` feature).

    A 503 names the failing part in ``reason`` (``READY_PARTS``: ``lease``, ``draining``, ``store``,
    ``listener``, ``engine``, ``images``), each missing image by its name (``missing_images``), and never the
    store's URL. The 200 lists the names requests may choose (``images``), the default image's reference
    (``image``), the store's kind (``store``: ``postgresql`` or ``sqlite``) and the replicas holding their lease
    in the registry at this replica's last read (``replicas``).
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
    ok, why = await backend.ready(settings.sandbox_image)
    if not ok:
        return NOT_READY.response(why, reason="engine")
    others = Images(backend, {name: ref for name, ref in settings.images.items() if name != DEFAULT_IMAGE})
    try:
        missing = await others.missing()
    except SandboxError as exc:
        return NOT_READY.response(str(exc), reason="engine")
    if missing:
        return NOT_READY.response("; ".join(missing.values()), reason="images", missing_images=sorted(missing))
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
