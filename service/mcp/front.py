"""The MCP server front of the service: ``/mcp`` over Streamable HTTP (stateless, JSON answers), behind the
same ``BearerAuth`` as every route. Its tools (``mcp.tools``) run in-process on the app's job service as the
request's API key: a job created through MCP belongs to that key, and another key's jobs are not found.

``mount(app)`` adds the route (outside the OpenAPI document); ``lifespan(app)`` runs the MCP session manager
while the app runs (the app's lifespan enters it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import FastAPI
from mcp.server.mcpserver import Context
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from service.api.bodies import parse_body
from service.api.problems import (
    BAD_REQUEST,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    LIMIT_EXCEEDED,
    METHOD_NOT_ALLOWED,
    UNAUTHORIZED,
    rule_for,
)
from service.composition.job_manager import JobManager
from service.errors import OwnerElsewhere, PtcError
from service.jobs.live import wait_for_end_or_client
from service.limits import check_execute
from service.mcp.server import OperationFailed, build_server
from service.replicas.remote import Remote
from service.schemas.job_models import ExecuteRequest
from service.settings import Settings
from service.tenancy import Caller, caller
from service.toolkit.validation import CheckScheduler
from service.views.render import Body, select

log = logging.getLogger(__name__)

PATH = "/mcp"
SUMMARY = select("summary")  # call records without arguments or results
MAX_MESSAGE_VALUES = 10_000
"""JSON values (objects, arrays, keys, strings, numbers, ...) in one MCP message at most. The SDK parses and
validates each message on the event loop: 4 MiB of empty arrays held it for a second. A tool call has a few dozen;
its script is one string however long."""
T = TypeVar("T")


INLINE_PARSE_BYTES = 64 * 1024
"""A view up to this size is parsed on the event loop (well under a millisecond); a larger one (a job's calls can
make megabytes: 11 ms for 3 MB) on a worker thread, so one key's reads of large views do not stall the loop."""


async def _json(body: Body) -> dict[str, Any]:
    """A job view's body (bytes, or pieces as rendered) as a dict."""
    if isinstance(body, bytes):
        data = body
    else:
        data = b"".join([piece async for piece in body])
    view: dict[str, Any] = (
        json.loads(data) if len(data) <= INLINE_PARSE_BYTES else await asyncio.to_thread(json.loads, data)
    )
    return view


class InProcess:
    """``mcp_tools.Operations`` on the app's own services, as the MCP request's key."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app

    def _who(self, ctx: Context[Any, Any]) -> tuple[Caller, str | None]:
        """The caller of the HTTP request carrying this MCP message, and its key's name."""
        request = ctx.request_context.request
        if not isinstance(request, Request):
            raise OperationFailed(f"{UNAUTHORIZED.name}: no HTTP request carries this call")
        key: str | None = request.state.key_name
        return caller(self._app.state.keys, key, internal=getattr(request.state, "internal", None) is not None), key

    @property
    def _jobs(self) -> JobManager:
        jobs: JobManager = self._app.state.jobs
        return jobs

    @property
    def _settings(self) -> Settings:
        settings: Settings = self._app.state.settings
        return settings

    async def _guard(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work``; a service error becomes ``OperationFailed`` with its problem type and message (anything
        else is logged and reported as ``internal-error`` without its text)."""
        try:
            return await work()
        except OperationFailed:
            raise
        except PtcError as exc:
            rule = rule_for(type(exc))
            name = (rule.type if rule is not None else INTERNAL_ERROR).name
            raise OperationFailed(f"{name}: {exc}") from None
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise OperationFailed(f"{INVALID_REQUEST.name}: {errors}") from None
        except Exception:
            log.exception("MCP tool failed")
            raise OperationFailed(f"{INTERNAL_ERROR.name}: the service failed; the error is in its log") from None

    async def execute(
        self,
        ctx: Context[Any, Any],
        script: str,
        toolset: str | None,
        timeout_s: float | None,
        wait_s: float | None,
    ) -> dict[str, Any]:
        """Submit a job as ``POST /execute`` would, wait up to ``wait_s`` (or until a client call waits), and
        answer its view (raises OperationFailed)."""
        who, key = self._who(ctx)

        async def run() -> dict[str, Any]:
            body = ExecuteRequest(script=script, toolset=toolset, timeout_s=timeout_s, wait_s=wait_s)
            check_execute(body, self._settings, key)
            job = await self._jobs.submit(body, who.owner, admin=who.admin)
            await wait_for_end_or_client(job, job.limits.wait_s)
            return await _json(await self._jobs.views.view(job.id, who, selection=SUMMARY))

        return await self._guard(run)

    async def _relayed(
        self, key: str | None, work: Callable[[], Awaitable[Body]], method: str, path: str
    ) -> dict[str, Any]:
        """``work``'s view; for a job running on another replica (``OwnerElsewhere``), the owner's answer to the
        signed internal call ``method path`` (its JSON; a problem becomes OperationFailed)."""

        async def view() -> dict[str, Any]:
            try:
                return await self._view(work())
            except OwnerElsewhere as elsewhere:
                remote: Remote | None = self._app.state.remote
                if remote is None:
                    raise elsewhere.unavailable() from None
                status, answer = await remote.call_json(elsewhere, method, path + "calls=summary", key)
                if status >= 400:
                    name = str(answer.get("type", "")).rsplit("/", 1)[-1] or INTERNAL_ERROR.name
                    raise OperationFailed(f"{name}: {answer.get('detail', '')}") from None
                return answer

        return await self._guard(view)

    async def get(self, ctx: Context[Any, Any], job_id: str) -> dict[str, Any]:
        """``GET /jobs/{id}`` (raises OperationFailed)."""
        who, key = self._who(ctx)
        quoted = quote(job_id, safe="")
        return await self._relayed(
            key, lambda: self._jobs.views.view(job_id, who, selection=SUMMARY), "GET", f"/jobs/{quoted}?"
        )

    async def wait(self, ctx: Context[Any, Any], job_id: str, timeout_s: float | None) -> dict[str, Any]:
        """``POST /jobs/{id}/wait`` (raises OperationFailed: also for a timeout above ``PTC_MAX_WAIT_S``)."""
        who, key = self._who(ctx)
        settings = self._settings
        seconds = settings.default_wait_s if timeout_s is None else timeout_s
        if not 0 <= seconds <= settings.max_wait_s:
            raise OperationFailed(f"{LIMIT_EXCEEDED.name}: timeout_s must be within 0 and {settings.max_wait_s}")
        quoted = quote(job_id, safe="")
        # wait waits here (notifications); a job still running elsewhere then gets its live view: one GET
        return await self._relayed(
            key, lambda: self._jobs.views.wait(job_id, who, seconds, SUMMARY), "GET", f"/jobs/{quoted}?"
        )

    async def stop(self, ctx: Context[Any, Any], job_id: str) -> dict[str, Any]:
        """``POST /jobs/{id}/stop`` (raises OperationFailed)."""
        who, key = self._who(ctx)
        quoted = quote(job_id, safe="")
        return await self._relayed(key, lambda: self._jobs.stop(job_id, who, SUMMARY), "POST", f"/jobs/{quoted}/stop?")

    async def stubs(self, ctx: Context[Any, Any], toolset: str) -> str:
        """The stub module of the caller's toolset (raises OperationFailed)."""
        who, _ = self._who(ctx)

        async def module() -> str:
            compiled = await self._jobs.toolsets.manifest([], toolset, who)
            return compiled.stub_source

        return await self._guard(module)

    @staticmethod
    async def _view(body: Awaitable[Body]) -> dict[str, Any]:
        return await _json(await body)


def few_values(value: Any) -> tuple[Any, list[dict[str, Any]]]:
    """``parse_body``'s check of an MCP message: no error while it holds at most ``MAX_MESSAGE_VALUES`` JSON
    values (keys counted), else one ``too_many_values`` error (the walk stops there)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1 + (len(item) if isinstance(item, dict) else 0)
        if count > MAX_MESSAGE_VALUES:
            msg = f"an MCP message holds at most {MAX_MESSAGE_VALUES} JSON values"
            return value, [{"type": "too_many_values", "loc": ("body",), "msg": msg}]
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value, []


class McpEndpoint:
    """The ASGI app of ``/mcp``: hands each request to the session manager the app's lifespan started.

    A POST's body is parsed first on the app's body threads (``app.state.bodies``, round-robin between keys, as
    every route's): not JSON, nested deeper than ``bodies.MAX_BODY_DEPTH`` or holding more than
    ``MAX_MESSAGE_VALUES`` values is the ``422`` ``invalid-request`` problem, so what the SDK then parses again on
    the event loop is small. A GET (the stream of server-initiated messages, which a stateless server never sends)
    is the ``405`` ``method-not-allowed`` problem rather than a stream held open for nothing, and a POST whose
    ``Content-Type`` is not ``application/json`` the ``400`` ``bad-request`` problem.

    Raises:
        RequestValidationError: the body is refused (the app's handler answers the problem).
    """

    def __init__(self) -> None:
        self.manager: StreamableHTTPSessionManager | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.manager is None:
            raise RuntimeError("the MCP session manager is not started (the app's lifespan starts it)")
        if scope["method"] == "GET":
            response = METHOD_NOT_ALLOWED.response("a stateless MCP server sends nothing on a GET stream: POST")
            response.headers["Allow"] = "POST"
            await response(scope, receive, send)
            return
        if scope["method"] == "POST":
            request = Request(scope, receive)
            if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/json":
                # the SDK would answer this in plain text
                await BAD_REQUEST.response("an MCP message is JSON: Content-Type: application/json")(
                    scope, receive, send
                )
                return
            try:
                raw = await request.body()
            except ClientDisconnect:
                return
            if raw:
                bodies: CheckScheduler = request.app.state.bodies
                group = getattr(request.state, "key_name", None) or ""
                await bodies.run(group, request, parse_body, raw, few_values)
            receive = _replay(raw, receive)
        await self.manager.handle_request(scope, receive, send)


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read once, then what ``receive`` gives (the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


def mount(app: FastAPI) -> McpEndpoint:
    """Add ``/mcp`` to ``app`` (not in its OpenAPI document); returns its endpoint, for ``lifespan``."""
    endpoint = McpEndpoint()
    app.router.routes.append(Route(PATH, endpoint=endpoint, include_in_schema=False))
    return endpoint


@asynccontextmanager
async def lifespan(app: FastAPI, endpoint: McpEndpoint, default_toolset: str | None) -> AsyncIterator[None]:
    """Serve ``endpoint`` with a new MCP server and session manager while the context is open."""
    server = build_server(InProcess(app), default_toolset)
    settings: Settings = app.state.settings
    manager = StreamableHTTPSessionManager(
        app=server._lowlevel_server,  # MCPServer's own streamable_http_app does the same
        json_response=True,
        stateless=True,  # each POST stands alone: no MCP session another key could name
        # The front is behind the service's API keys, on whatever host it is deployed: no Host/Origin lists.
        security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        # BodyLimit refuses larger bodies first (a problem); the SDK's own 4 MiB would refuse a script of 1 MiB
        # in JSON escapes (up to 6 bytes a character) that POST /execute takes, in plain text.
        max_request_body_size=settings.max_body_bytes,
    )
    # The manager's task group is entered and left in a task of its own: a lifespan may be entered in one task and
    # left in another (an async test fixture's set-up and tear-down), which an anyio cancel scope refuses.
    started, stop = asyncio.Event(), asyncio.Event()

    async def serve() -> None:
        async with manager.run():
            endpoint.manager = manager
            started.set()
            try:
                await stop.wait()
            finally:
                endpoint.manager = None

    serving = asyncio.create_task(serve(), name="mcp session manager")
    ready = asyncio.ensure_future(started.wait())
    await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if serving.done():
        serving.result()  # it failed before serving: raise its error
        raise RuntimeError("the MCP session manager ended before it started serving")
    try:
        yield
    finally:
        stop.set()
        await serving
