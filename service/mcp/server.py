"""The MCP server's tools, shared by its two fronts: ``/mcp`` in the service (``mcp.front``, jobs run
in-process as the request's API key) and ``ptc-sandbox mcp`` over stdio (``mcp.stdio``, forwarding to a running
service over HTTP).

Tools: ``execute`` (run a script against a toolset; answers stdout, status, error and a compact call summary),
``get_job``, ``wait_job`` and ``stop_job``; and the resource template ``ptc://toolsets/{toolset_id}/stubs``: the
``tools`` module a script of that toolset imports (its typed signatures). A failed operation is an MCP tool error
whose text is ``<problem type>: <message>``.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError as OperationFailed  # re-exported for the fronts

from service.toolkit.stubs import USAGE

__all__ = ["EXECUTE_DESCRIPTION", "STUBS_URI", "OperationFailed", "Operations", "build_server", "compact"]

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
STUBS_URI = "ptc://toolsets/{toolset_id}/stubs"
MAX_TEXT_CHARS = 100_000  # stdout or stderr in one MCP answer at most (the rest: get_job's full view over HTTP)
MAX_CALL_LINES = 200  # call lines in one MCP answer at most (the first ones; calls_total counts them all)
EXECUTE_DESCRIPTION = """\
Run a Python script in a sandbox of ptc-sandbox; the script calls the toolset's tools as Python functions.
Answers the job's status, stdout, stderr, error and one line per tool call. A job still running after wait_s
answers status "running" with its job_id: call wait_job or get_job later, or stop_job.
"""


class Operations(Protocol):
    """What the tools ask of the service, as the caller (``ctx``: the MCP request, whose key acts). Each returns the
    job's view (``JobView`` as JSON, calls as summaries) and raises ``OperationFailed`` (the SDK's ``ToolError``: an
    MCP tool error) whose text is ``<problem type>: <message>`` when the service refuses."""

    async def execute(
        self,
        ctx: Context[Any, Any],
        script: str,
        toolset: str | None,
        timeout_s: float | None,
        wait_s: float | None,
    ) -> dict[str, Any]:
        """Start a job and wait up to ``wait_s`` (s) for its end."""
        ...

    async def get(self, ctx: Context[Any, Any], job_id: str) -> dict[str, Any]:
        """A job's view now."""
        ...

    async def wait(self, ctx: Context[Any, Any], job_id: str, timeout_s: float | None) -> dict[str, Any]:
        """A job's view once it ends or ``timeout_s`` (s) passes."""
        ...

    async def stop(self, ctx: Context[Any, Any], job_id: str) -> dict[str, Any]:
        """Stop a job; its final view."""
        ...

    async def stubs(self, ctx: Context[Any, Any], toolset: str) -> str:
        """The stub module of a toolset."""
        ...


def _text(value: object) -> str:
    """A stream's text, cut at ``MAX_TEXT_CHARS`` with a note."""
    text = value if isinstance(value, str) else ""
    if len(text) > MAX_TEXT_CHARS:
        return text[:MAX_TEXT_CHARS] + f"\n[... {len(text) - MAX_TEXT_CHARS} more characters: see get_job]"
    return text


def compact(view: dict[str, Any]) -> dict[str, Any]:
    """The MCP answer of a job view: ``job_id``, ``status``, ``exit_code``, ``stdout``, ``stderr``, ``error``
    (``{type, message}`` or None), ``calls`` (``"<seq> <tool> <status> <ms>ms[ <error type>]"`` each),
    ``calls_total`` and ``pending_calls`` (the ids of calls waiting for a client or an approval). Only the first
    ``MAX_CALL_LINES`` calls have a line: a job may make ``PTC_MAX_TOOL_CALLS`` (10,000) calls."""
    calls = []
    for record in (view.get("calls") or [])[:MAX_CALL_LINES]:
        line = f"{record.get('seq')} {record.get('tool')} {record.get('status')} {record.get('duration_ms')}ms"
        error = record.get("error")
        if isinstance(error, dict) and error.get("type"):
            line += f" {error['type']}"
        calls.append(line)
    return {
        "job_id": view.get("job_id"),
        "status": view.get("status"),
        "exit_code": view.get("exit_code"),
        "stdout": _text(view.get("stdout")),
        "stderr": _text(view.get("stderr")),
        "error": view.get("error"),
        "calls": calls,
        "calls_total": view.get("calls_total", len(view.get("calls") or [])),
        "pending_calls": [call.get("call_id") for call in view.get("pending_calls") or []],
    }


def build_server(
    ops: Operations, default_toolset: str | None, *, name: str = "ptc-sandbox", log_level: LogLevel = "INFO"
) -> MCPServer[Any]:
    """An ``MCPServer`` (the SDK's high-level server) whose tools call ``ops``.

    Args:
        default_toolset: the toolset ``execute`` uses when the call names none (``PTC_MCP_TOOLSET``); None: a call
            with no ``toolset_id`` runs with no tools.
        log_level: the SDK's logging level; it only applies when the root logger has no handler yet (the service's
            own logging, configured first, is kept).
    """
    description = EXECUTE_DESCRIPTION
    if default_toolset:
        description += (
            f"Without toolset_id the script's tools are those of toolset {default_toolset} "
            f"(their signatures: resource ptc://toolsets/{default_toolset}/stubs).\n"
        )
    else:
        description += "Pass toolset_id (POST /toolsets); its signatures: resource ptc://toolsets/{toolset_id}/stubs.\n"
    server: MCPServer[Any] = MCPServer(
        name,
        instructions=USAGE,
        log_level=log_level,
        # No subscriptions/listen: the tools never change, and a listen stream is an answer held open for nothing
        # (the method is answered -32601, method not found).
        subscriptions=False,
    )

    @server.tool(description=description + "\n" + USAGE)
    async def execute(
        script: str,
        ctx: Context[Any, Any],
        toolset_id: str | None = None,
        timeout_s: float | None = None,
        wait_s: float | None = None,
    ) -> dict[str, Any]:
        return compact(await ops.execute(ctx, script, toolset_id or default_toolset, timeout_s, wait_s))

    @server.tool(description="A job's status, stdout, stderr, error and call summary now.")
    async def get_job(job_id: str, ctx: Context[Any, Any]) -> dict[str, Any]:
        return compact(await ops.get(ctx, job_id))

    @server.tool(description="Wait until a job ends (or timeout_s seconds pass), then answer as get_job.")
    async def wait_job(job_id: str, ctx: Context[Any, Any], timeout_s: float | None = None) -> dict[str, Any]:
        return compact(await ops.wait(ctx, job_id, timeout_s))

    @server.tool(description="Stop a job (SIGTERM, then SIGKILL after a grace); answers its final state.")
    async def stop_job(job_id: str, ctx: Context[Any, Any]) -> dict[str, Any]:
        return compact(await ops.stop(ctx, job_id))

    @server.resource(
        STUBS_URI,
        name="toolset stubs",
        description="The Python module `tools` a script of this toolset imports: one typed function per tool.",
        mime_type="text/x-python",
    )
    async def stubs(toolset_id: str, ctx: Context) -> str:
        # A bare Context: a template's handler is wrapped in pydantic.validate_call, which detaches a
        # parametrized Context from its request (the SDK's migration guide).
        return await ops.stubs(ctx, toolset_id)

    return server
