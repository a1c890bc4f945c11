"""Health and metrics: ``GET /healthz`` (liveness), ``GET /readyz`` (readiness), ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppMetrics, AppSettings, Backend, Key, Keys, Store
from service.api.problems import FORBIDDEN, NOT_READY
from service.auth import may_scrape
from service.errors import SandboxError, StoreUnavailable
from service.metrics import CONTENT_TYPE
from service.replicas import Replicas
from service.sandbox.images import Images
from service.settings import DEFAULT_IMAGE

router = APIRouter(route_class=ParsedOffLoop)


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
    """Readiness: this replica holds its lease (``Replicas.ready``: not fenced, not within a heartbeat of its
    deadline), the job store answers (PostgreSQL: within ``PTC_STORE_TIMEOUT_S``), the engine answers, the
    sandbox image is present, and so is every other image of ``PTC_IMAGES`` (with the ``session`` feature); a 503
    names each image that is not, by its name, and says when the store does not answer (never its URL).

    The answer lists the names requests may choose (``images``), and the default image's reference (``image``).
    """
    replicas = request.app.state.replicas
    lease = replicas.ready() if isinstance(replicas, Replicas) else None
    if lease is not None:
        return NOT_READY.response(lease)
    try:
        await store.ping()
    except StoreUnavailable as exc:
        return NOT_READY.response(str(exc))
    ok, reason = await backend.ready(settings.sandbox_image)
    if not ok:
        return NOT_READY.response(reason)
    others = Images(backend, {name: ref for name, ref in settings.images.items() if name != DEFAULT_IMAGE})
    try:
        missing = await others.missing()
    except SandboxError as exc:
        return NOT_READY.response(str(exc))
    if missing:
        return NOT_READY.response("; ".join(missing.values()), missing_images=sorted(missing))
    return JSONResponse({"status": "ready", "image": settings.sandbox_image, "images": sorted(settings.images)})
