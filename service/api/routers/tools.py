"""The tools resource: ``POST /stubs`` (the module a sandbox would import) and ``POST /toolsets``."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppSettings, Key, Toolsets, Who
from service.errors import InvalidField
from service.limits import check_manifest_request
from service.schemas.toolset_models import ManifestRequest, StubsView, ToolsetView
from service.toolkit.stubs import USAGE

router = APIRouter(route_class=ParsedOffLoop)


@router.post("/stubs", response_model=StubsView, responses={422: {}})
async def stubs(body: ManifestRequest, registry: Toolsets, who: Who, settings: AppSettings, key: Key) -> StubsView:
    """The exact ``tools`` module a sandbox would import for this manifest, and a usage text for the prompt."""
    check_manifest_request(body, settings, key)
    if body.mcp_servers:
        raise InvalidField("register MCP servers with POST /toolsets, then pass its toolset", ("body", "mcp_servers"))
    compiled = await registry.manifest(body.tools, body.toolset, who)
    return StubsView(module=compiled.stub_source, usage=USAGE, toolset_id=compiled.toolset_id or "")


@router.post("/toolsets", response_model=ToolsetView, responses={422: {}})
async def toolsets(body: ManifestRequest, registry: Toolsets, who: Who, settings: AppSettings, key: Key) -> ToolsetView:
    """Register a manifest once; pass the answer's ``toolset_id`` as ``toolset`` instead of re-sending it."""
    check_manifest_request(body, settings, key)
    if body.toolset is not None:
        raise InvalidField("POST /toolsets takes tools, not a toolset", ("body", "toolset"))
    compiled = await registry.register(body.tools, body.mcp_servers, who.owner)
    return ToolsetView(toolset_id=compiled.toolset_id or "", tools=list(compiled.tools))
