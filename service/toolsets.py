"""Toolsets: the compiled manifest of a request (its ``tools`` or a registered ``toolset``), and registration.

A toolset is a manifest kept in the job store under its content id (keyed by a secret salt of the installation,
so the id leaks nothing of the manifest), for the owners that registered it. For anyone else it is unknown, so
its endpoint credentials never serve another key.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import orjson

from service.errors import InvalidField, RequestLimitError
from service.schemas.toolset_models import McpServer
from service.store import JobStore
from service.tenancy import Caller
from service.toolkit.cache import CompiledManifest, ManifestCache
from service.toolkit.endpoints import EndpointClients, ToolCallFailed

SALT_FILE = ".toolset-salt"


def installation_salt(work_dir: Path) -> bytes:
    """A secret random key kept in ``work_dir`` (32 bytes, created once, mode 0600): keys toolset ids
    (blocking: call it before the event loop serves, or in a thread)."""
    path = work_dir / SALT_FILE
    work_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()


class Toolsets:
    """Compiles manifests (cached) and keeps registered toolsets.

    Args:
        store: where registered toolsets are kept.
        manifests: the compiled-manifest cache (closed by its owner).
        endpoints: asks MCP servers for their ``tools/list`` at registration.
        max_tools: the most tools a registered manifest may hold (``PTC_MAX_TOOLS``, MCP listings included).
    """

    def __init__(self, store: JobStore, manifests: ManifestCache, endpoints: EndpointClients, max_tools: int) -> None:
        self._store = store
        self._manifests = manifests
        self._endpoints = endpoints
        self._max_tools = max_tools

    async def manifest(self, tools: list[dict[str, Any]], toolset: str | None, caller: Caller) -> CompiledManifest:
        """The compiled manifest of a request: its ``tools``, or the registered ``toolset``.

        A toolset is usable only by the owners that registered it (and the admin role).

        Raises:
            ManifestError: a tool entry is unusable.
            InvalidField: both, or an unknown toolset (another owner's included, with the same message).
        """
        if toolset is not None:
            if tools:
                raise InvalidField("give tools or toolset, not both", ("body", "toolset"))
            raw = await self._store.toolsets.get(toolset, caller.only_owner)
            if raw is None:
                raise InvalidField(
                    f"no toolset {toolset!r}; register the manifest with POST /toolsets", ("body", "toolset")
                )
            tools = orjson.loads(raw)
        return await self._manifests.compile(tools, caller.owner)

    async def register(self, tools: list[dict[str, Any]], servers: list[McpServer], owner: str) -> CompiledManifest:
        """Check a manifest and keep it under its content id for ``owner`` (registering it again is a no-op).

        Each of ``servers`` is asked for its ``tools/list``; its tools join the manifest with an ``mcp`` endpoint.

        Raises:
            ManifestError / InvalidField: as for any manifest; InvalidField when a server cannot list its tools.
            RequestLimitError: more than ``max_tools`` tools.
        """
        tools = list(tools)
        for i, server in enumerate(servers):
            try:
                listed = await self._endpoints.list_mcp_tools(server.url, server.headers, server.timeout_s or 30.0)
            except ToolCallFailed as exc:
                raise InvalidField(f"{exc.type}: {exc.message}", ("body", "mcp_servers", i)) from exc
            endpoint: dict[str, Any] = {"kind": "mcp", "url": server.url, "headers": server.headers}
            if server.timeout_s:
                endpoint["timeout_s"] = server.timeout_s
            tools += [{**entry, "endpoint": endpoint} for entry in listed]
        if len(tools) > self._max_tools:
            raise RequestLimitError(
                f"{len(tools)} tools (MCP listings included) exceed the server maximum of {self._max_tools}",
                ("body", "mcp_servers"),
            )
        compiled = await self._manifests.compile(tools, owner)
        if compiled.toolset_id is None:
            raise InvalidField("this manifest cannot be stored as JSON (lone surrogates?)", ("body", "tools"))
        await self._store.toolsets.put(compiled.toolset_id, orjson.dumps(tools), owner)
        return compiled
