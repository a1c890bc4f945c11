"""What the routes depend on, as ``Annotated`` aliases: a route names ``jobs: Jobs`` or ``who: Who`` and FastAPI
passes the app's object. Each is read from ``app.state``, where the app factory (``app.create_app``) and its
lifespan put them; none is built here.

- ``Jobs``: the job service (``JobManager``); ``Sessions`` and ``Toolsets``: the sessions and toolsets
  resources, each typed by the small protocol below (the routes' needs), served today by the same manager.
- ``AppSettings``: the ``Settings`` the app was built from.
- ``Key``: the name of the caller's API key (None with authentication disabled, and on an open path);
  ``Who``: the caller as an owner (``auth.Caller``); ``Keys``: every API key (None: authentication disabled).
- ``AppMetrics``, ``ScriptEngines``: the metrics and the script engines (``engines.Engines``), for the health
  routes.
- ``Idempotency``: the bindings of ``Idempotency-Key`` headers (``idempotency.IdempotencyKeys``).
- ``Reads``: each key's answers under way, bounded (``api.reads.ReadSlots``).

Until the lifespan has started the services, ``Jobs``, ``Sessions``, ``Toolsets``, ``ScriptEngines`` and
``Idempotency`` are ``NOT_STARTED``, which fails on first use: a request served without the lifespan (an in-process
test) gets every answer that needs no service (validation, limits, 413) as a running service would.
"""

from __future__ import annotations

from typing import Annotated, Any, NoReturn, Protocol

from fastapi import Depends, Request

from service.api.reads import ReadSlots
from service.composition.job_manager import JobManager
from service.engines import Engines
from service.idempotency import IdempotencyKeys
from service.observability.metrics import Metrics
from service.output import OutputRange
from service.schemas.session_models import SessionRequest
from service.schemas.toolset_models import McpServer
from service.settings import Settings
from service.store import JobStore
from service.tenancy import Caller, KeyRing, caller
from service.toolkit.cache import CompiledManifest


class SessionService(Protocol):
    """What the sessions routes ask of the sessions resource (views are JSON-ready dicts)."""

    async def create_session(self, request: SessionRequest, owner: str, *, admin: bool = False) -> dict[str, Any]:
        """Start a session's sandbox; raises TooManySessions, QuotaExceeded, SandboxError, InvalidField."""
        ...

    async def sessions(self, caller: Caller) -> list[dict[str, Any]]:
        """The caller's open sessions, oldest first."""
        ...

    async def session_view(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """One session's view; raises SessionNotFound, OwnerElsewhere."""
        ...

    async def delete_session(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """End a session (idempotent); raises SessionNotFound."""
        ...

    async def put_file(self, session_id: str, caller: Caller, path: str, data: bytes) -> dict[str, Any]:
        """Write a file under the session's /tmp; raises SessionNotFound, SessionClosed, FileRefused."""
        ...

    async def get_file(self, session_id: str, caller: Caller, path: str) -> OutputRange:
        """A file under the session's /tmp, as a range to send a slice at a time (the caller closes it); raises
        SessionNotFound, SessionClosed, NoSuchFile, FileRefused."""
        ...

    async def list_files(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """What is under the session's /tmp; raises SessionNotFound, SessionClosed."""
        ...


class ToolsetService(Protocol):
    """What the tools routes ask of the toolsets resource."""

    async def manifest(self, tools: list[dict[str, Any]], toolset: str | None, caller: Caller) -> CompiledManifest:
        """A request's compiled manifest; raises ManifestError, InvalidField."""
        ...

    async def register(self, tools: list[dict[str, Any]], servers: list[McpServer], owner: str) -> CompiledManifest:
        """Check and keep a manifest under its content id; raises ManifestError, InvalidField."""
        ...


class NotStarted:
    """Stands for a service until the app's lifespan starts it; any use raises RuntimeError."""

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(f"the service is not started (its lifespan builds it): no {name} yet")


NOT_STARTED = NotStarted()


async def job_service(request: Request) -> JobManager:
    """``app.state.jobs``."""
    service: JobManager = request.app.state.jobs
    return service


async def session_service(request: Request) -> SessionService:
    """``app.state.sessions``."""
    service: SessionService = request.app.state.sessions
    return service


async def toolset_service(request: Request) -> ToolsetService:
    """``app.state.toolsets``."""
    service: ToolsetService = request.app.state.toolsets
    return service


async def app_settings(request: Request) -> Settings:
    """``app.state.settings``."""
    settings: Settings = request.app.state.settings
    return settings


async def key_name(request: Request) -> str | None:
    """The name of the request's API key, as ``auth.BearerAuth`` identified it (None: no key needed)."""
    name: str | None = request.state.key_name
    return name


async def key_ring(request: Request) -> KeyRing | None:
    """``app.state.keys``: the API keys (None: authentication disabled)."""
    keys: KeyRing | None = request.app.state.keys
    return keys


async def who(request: Request) -> Caller:
    """The request's caller: the owner of what it creates, and whether it may act on every owner's.

    Raises:
        ValueError: authentication is on and the request has no key (only open paths have none).
    """
    keys: KeyRing | None = request.app.state.keys
    return caller(keys, request.state.key_name, internal=getattr(request.state, "internal", None) is not None)


async def app_metrics(request: Request) -> Metrics:
    """``app.state.metrics``."""
    metrics: Metrics = request.app.state.metrics
    return metrics


async def read_slots(request: Request) -> ReadSlots:
    """``app.state.reads``: each key's answers under way (``api.reads``)."""
    reads: ReadSlots = request.app.state.reads
    return reads


async def script_engines(request: Request) -> Engines:
    """``app.state.engines``: the script engines, for ``GET /readyz``."""
    engines: Engines = request.app.state.engines
    return engines


async def job_store(request: Request) -> JobStore:
    """``app.state.store``: the job store, for ``GET /readyz``."""
    store: JobStore = request.app.state.store
    return store


async def idempotency_keys(request: Request) -> IdempotencyKeys:
    """``app.state.idempotency``."""
    keys: IdempotencyKeys = request.app.state.idempotency
    return keys


Jobs = Annotated[JobManager, Depends(job_service)]
Sessions = Annotated[SessionService, Depends(session_service)]
Toolsets = Annotated[ToolsetService, Depends(toolset_service)]
AppSettings = Annotated[Settings, Depends(app_settings)]
Key = Annotated[str | None, Depends(key_name)]
Keys = Annotated[KeyRing | None, Depends(key_ring)]
Who = Annotated[Caller, Depends(who)]
AppMetrics = Annotated[Metrics, Depends(app_metrics)]
ScriptEngines = Annotated[Engines, Depends(script_engines)]
Idempotency = Annotated[IdempotencyKeys, Depends(idempotency_keys)]
Store = Annotated[JobStore, Depends(job_store)]
Reads = Annotated[ReadSlots, Depends(read_slots)]
