"""The manifests' request and response models: ``POST /stubs``, ``POST /toolsets`` and the MCP servers a toolset
takes over."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.egress import header_problem, url_problem
from service.schemas.common import Language
from service.settings import MAX_SCRIPT_CHARS, MAX_TOOLS


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


class CheckRequest(BaseModel):
    """Body of ``POST /check``: a script and its tools (a manifest, or a registered toolset)."""

    model_config = ConfigDict(extra="forbid")

    script: str = Field(..., max_length=MAX_SCRIPT_CHARS, description="The Python script to check (UTF-8).")
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_TOOLS)
    toolset: str | None = Field(None, max_length=64, description="Id from POST /toolsets (instead of tools).")
    language: Language | None = Field(None, description="The script's language: python (the only one checked).")
    engine: Literal["container", "monty"] | None = Field(
        None,
        description="The engine the script is meant for (default: the server's): under monty, tools.ToolError does "
        "not exist, and the check says so.",
    )


class Diagnostic(BaseModel):
    """One finding of the type check: where (lines and columns of the script as sent, from 1) and what."""

    line: int
    column: int
    end_line: int
    end_column: int
    code: str = Field(description="The checker's rule, e.g. invalid-argument-type, unresolved-attribute.")
    severity: str = Field(description="error or warning.")
    message: str


class CheckView(BaseModel):
    """Answer of ``POST /check``."""

    ok: bool = Field(description="No error: /execute with check: true would accept the script.")
    diagnostics: list[Diagnostic]
    engine: str = Field(description="The engine the script was checked for.")
