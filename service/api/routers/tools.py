"""The tools resource: ``POST /stubs`` (the module a sandbox would import, or the tools' TypeScript declarations)
and ``POST /toolsets``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppSettings, Key, Toolsets, Who
from service.errors import InvalidField
from service.limits import check_manifest_request
from service.schemas.toolset_models import ManifestRequest, StubsView, ToolsetView
from service.toolkit.cache import CompiledManifest
from service.toolkit.stubs import USAGE
from service.toolkit.ts_stubs import JS_USAGE, TS_USAGE
from service.toolkit.validation import CheckScheduler

router = APIRouter(route_class=ParsedOffLoop)

USAGES = {"python": USAGE, "javascript": JS_USAGE, "typescript": TS_USAGE}
"""The usage text of ``POST /stubs`` by ``language`` (none: python)."""


@router.post("/stubs", response_model=StubsView, responses={422: {}})
async def stubs(
    body: ManifestRequest, registry: Toolsets, who: Who, settings: AppSettings, key: Key, request: Request
) -> StubsView:
    """The exact ``tools`` module a sandbox would import for this manifest (``language`` javascript or typescript:
    the TypeScript declarations of its tools), and a usage text for the prompt."""
    check_manifest_request(body, settings, key)
    if body.mcp_servers:
        raise InvalidField("register MCP servers with POST /toolsets, then pass its toolset", ("body", "mcp_servers"))
    compiled = await registry.manifest(body.tools, body.toolset, who)
    language = body.language or "python"
    module = compiled.stub_source if language == "python" else await _declarations(compiled, request, key)
    return StubsView(module=module, usage=USAGES[language], toolset_id=compiled.toolset_id or "", language=language)


async def _declarations(compiled: CompiledManifest, request: Request, key: str | None) -> str:
    """The manifest's TypeScript declarations, kept with it once made. They are made on the request-body threads
    (``app.state.bodies``: in turn between keys), not on the event loop (four small tools take 0.4 ms, long
    descriptions more) nor on the default executor that jobs' file work uses."""
    if compiled.declarations_ready():
        return compiled.declarations()
    bodies: CheckScheduler = request.app.state.bodies
    return await bodies.run(key or "", request, compiled.declarations)


@router.post("/toolsets", response_model=ToolsetView, responses={422: {}})
async def toolsets(body: ManifestRequest, registry: Toolsets, who: Who, settings: AppSettings, key: Key) -> ToolsetView:
    """Register a manifest once; pass the answer's ``toolset_id`` as ``toolset`` instead of re-sending it."""
    check_manifest_request(body, settings, key)
    if body.toolset is not None:
        raise InvalidField("POST /toolsets takes tools, not a toolset", ("body", "toolset"))
    if body.language is not None:
        raise InvalidField("language is for POST /stubs; a toolset serves every language", ("body", "language"))
    compiled = await registry.register(body.tools, body.mcp_servers, who.owner)
    return ToolsetView(toolset_id=compiled.toolset_id or "", tools=list(compiled.tools))
