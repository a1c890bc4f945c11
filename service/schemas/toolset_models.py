"""The manifests' request and response models: ``POST /stubs``, ``POST /toolsets`` and the MCP servers a toolset
takes over."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.egress import header_problem, url_problem
from service.schemas.common import Language
from service.settings import MAX_TOOLS


class McpServer(BaseModel):
    """An MCP server whose tools a toolset takes over (discovered with ``tools/list`` at registration)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048, description="Streamable HTTP endpoint, e.g. http://127.0.0.1:8765/mcp")
    headers: dict[str, str] = Field(default_factory=dict, description="Sent with every request; stay on the host.")
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Limit of one call (s).")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.lower().startswith(("http://", "https://")):
            raise ValueError("url must be an absolute http(s) URL")
        problem = url_problem(url)
        if problem:
            raise ValueError(problem)
        return url

    @field_validator("headers")
    @classmethod
    def _allowed_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            problem = header_problem(name)
            if problem:
                raise ValueError(problem)
        return headers


class ManifestRequest(BaseModel):
    """Body of ``POST /stubs`` and ``POST /toolsets``: a manifest, or (for /stubs) a registered toolset."""

    model_config = ConfigDict(extra="forbid")

    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_TOOLS)
    toolset: str | None = Field(None, max_length=64, description="Id from POST /toolsets (instead of tools).")
    mcp_servers: list[McpServer] = Field(
        default_factory=list,
        max_length=32,
        description="For POST /toolsets: MCP servers whose tools/list entries join the manifest.",
    )
    language: Language | None = Field(
        None,
        description="For POST /stubs: the language of the scripts; javascript or typescript answer the tools' "
        "TypeScript declarations and a usage text for such scripts. Default python (the tools package).",
    )


class StubsView(BaseModel):
    """Answer of ``POST /stubs``."""

    module: str = Field(
        description="python: the exact source of the `tools` package the sandbox imports; javascript, typescript: "
        'the TypeScript declarations of the tools (`declare module "tools"` and the globals).'
    )
    usage: str = Field(description="A short text for the model's system prompt, for scripts in `language`.")
    language: str = Field(description="The language the module and usage are for: python, javascript or typescript.")
    toolset_id: str = Field(description="The manifest's content id (what POST /toolsets would return).")


class ToolsetView(BaseModel):
    """Answer of ``POST /toolsets``."""

    toolset_id: str = Field(description="Pass as toolset in /execute or /stubs; the same manifest gives the same id.")
    tools: list[str] = Field(description="The tools' original names.")
