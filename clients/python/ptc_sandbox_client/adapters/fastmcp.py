"""A sandbox provider for FastMCP's code mode that runs the code in the service (docs/adapters/fastmcp.md).

FastMCP (4.x, tested with 4.2.3) has a code mode: the transform ``fastmcp.experimental.transforms.code_mode.
CodeMode`` replaces a server's tools by discovery tools and one ``execute(code)`` tool, and runs the code through a
pluggable ``SandboxProvider`` (a protocol: ``async run(code, *, inputs, external_functions) -> Any``; the default is
``MontySandboxProvider``, pydantic-monty's Python subset). :class:`PtcSandboxProvider` is such a provider: the code
runs as a script in the service, in full CPython, and each tool of the server is a typed stub of the manifest (its
``inputs`` JSON Schema), a client-executed tool whose calls the broker records and this process answers through
code mode's own ``call_tool`` (so its tool-call limit, its catalog lookup and the server's middleware apply).

The code is what code mode's ``execute`` documents: the body of an async function, ``await call_tool(name, params)``
in scope, ``return`` (or a last expression) giving the result. Here the server's tools are also globals
(``await get_weather(city="Oslo")``) and ``tools.<name>`` (``tools.aio.<name>`` to await), as in any script of the
service (docs/tools-and-manifests.md). The result crosses as JSON (a value JSON cannot carry comes back as its
``repr()``); print output stays in the job's view. An exception in the code, or a job that did not end normally, is
raised as FastMCP's ``ToolError`` with its last line, which FastMCP hands to the model.

Without a catalog (a provider not made by :func:`code_mode` nor given ``code_mode=``, or called outside a request)
the manifest has one client-executed tool, ``call_tool(tool_name, params)``, answered by the same function.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastmcp.exceptions import ToolError
from fastmcp.experimental.transforms.code_mode import CodeMode
from fastmcp.server.dependencies import get_context

from .._tools import client_manifest
from ..client import AsyncClient
from ..models import JobView

logger = logging.getLogger(__name__)

RESULT_PATH = "outputs/ptc-code-mode-result.json"
"""Where the script leaves its outcome (it comes back with the job: docs/files.md)."""

CALL_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tool_name": {"type": "string"}, "params": {"type": "object"}},
    "required": ["tool_name"],
}


class PtcSandboxProvider:
    """A FastMCP ``SandboxProvider`` that runs code mode's code as a job of the service (see the module docstring).

    ``client`` is an :class:`~ptc_sandbox_client.AsyncClient`; ``code_mode`` the transform whose catalog becomes the
    manifest (:func:`code_mode` sets it); ``timeout_s`` bounds each script; ``body`` takes other ``/execute`` fields
    (``limits``, ``image``, ``env``, ``metadata``, ...). ``views`` keeps each job's final view, in order (a cancelled
    request's job: the view its stop answered).
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        code_mode: CodeMode | None = None,
        timeout_s: float | None = None,
        wait_s: float = 30.0,
        **body: Any,
    ) -> None:
        self.client = client
        self.code_mode = code_mode
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.body = body
        self.views: list[JobView] = []
        self.stopping: set[asyncio.Task[None]] = set()  # stops of cancelled requests' jobs, under way

    async def _stop(self, script: str, manifest: list[dict[str, Any]], body: dict[str, Any]) -> None:
        try:
            view = await self.client.execute(script, tools=manifest, wait_s=self.wait_s, **body)
            self.views.append(view if view.ended else await self.client.stop(view.job_id))
        except Exception:  # the job still ends at its timeout_s
            logger.warning("could not stop the job of a cancelled code-mode request", exc_info=True)

    async def manifest(
        self, call_tool: Callable[..., Awaitable[Any]]
    ) -> tuple[dict[str, Callable[..., Awaitable[Any]]], dict[str, dict[str, Any]]]:
        """The callables (name -> async function answering a call through ``call_tool``) and their parameter
        schemas: each tool of the catalog, else the one generic ``call_tool``."""
        catalog = None
        if self.code_mode is not None:
            try:
                ctx = get_context()
            except RuntimeError:  # outside a request: no catalog to read
                ctx = None
            if ctx is not None:
                catalog = await self.code_mode.get_tool_catalog(ctx)
        if catalog is None:
            return {"call_tool": _generic(call_tool)}, {"call_tool": CALL_TOOL_SCHEMA}
        functions = {tool.name: _forward(call_tool, tool.name, tool.description) for tool in catalog}
        return functions, {tool.name: dict(tool.parameters or {"type": "object"}) for tool in catalog}

    async def run(
        self,
        code: str,
        *,
        inputs: dict[str, Any] | None = None,
        external_functions: dict[str, Callable[..., Any]] | None = None,
    ) -> Any:
        """Runs ``code`` in the service with ``inputs`` as globals; the value it returns. Raises ``ToolError`` when
        the code raised or its job did not end normally, ``ProblemError`` when the service refused the request."""
        call_tool = (external_functions or {}).get("call_tool")
        if call_tool is None:
            raise ToolError("code mode passed no call_tool function")
        functions, schemas = await self.manifest(_awaiting(call_tool))
        body = dict(self.body)
        if self.timeout_s is not None:
            body["timeout_s"] = self.timeout_s
        # The key makes the job findable again: when the request is cancelled, the same request answers the job's
        # view (docs/idempotency.md), and the job is stopped.
        body["idempotency_key"] = f"ptc-code-mode-{uuid.uuid4().hex}"
        script = code_script(code, inputs or {}, generic="call_tool" in schemas and len(schemas) == 1)
        try:
            view = await self.client.run_with_tools(script, functions, schemas=schemas, wait_s=self.wait_s, **body)
        except asyncio.CancelledError:
            manifest = client_manifest(functions, schemas)
            task = asyncio.get_running_loop().create_task(self._stop(script, manifest, body))
            self.stopping.add(task)
            task.add_done_callback(self.stopping.discard)
            raise
        self.views.append(view)
        if any(f.path == RESULT_PATH for f in view.files):
            outcome = json.loads(await self.client.job_file(view.job_id, RESULT_PATH))
            if isinstance(outcome, dict) and "error" in outcome:
                raise ToolError(str(outcome["error"]))
            if isinstance(outcome, dict):
                return outcome.get("value")
        detail = (view.error or {}).get("message") or "".join(view.stderr.strip().splitlines()[-1:])
        raise ToolError(f"the code's job ended {view.status}: {detail}")


def code_mode(client: AsyncClient, *, provider: Mapping[str, Any] | None = None, **options: Any) -> CodeMode:
    """FastMCP's ``CodeMode`` transform (``options``: its ``discovery_tools``, ``execute_tool_name``,
    ``execute_description``, ``max_tool_calls``, ...) with a :class:`PtcSandboxProvider` bound to its catalog
    (``provider``: the provider's keyword arguments): ``FastMCP("x", transforms=[code_mode(client)])``."""
    sandbox = PtcSandboxProvider(client, **dict(provider or {}))
    transform = CodeMode(sandbox_provider=sandbox, **options)
    sandbox.code_mode = transform
    return transform


def _awaiting(function: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def call(*args: Any) -> Any:
        value = function(*args)
        return await value if isinstance(value, Awaitable) else value

    return call


def _forward(call_tool: Callable[..., Awaitable[Any]], name: str, description: str | None) -> Callable[..., Any]:
    async def answer(**params: Any) -> Any:
        return await call_tool(name, params)

    answer.__doc__ = description or name
    return answer


def _generic(call_tool: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    async def answer(tool_name: str, params: dict[str, Any] | None = None) -> Any:
        return await call_tool(tool_name, params or {})

    answer.__doc__ = "Calls one of the server's tools by name with its parameters."
    return answer


def code_script(code: str, inputs: Mapping[str, Any], *, generic: bool = False) -> str:
    """The script that runs code mode's ``code`` (an async function's body) with ``inputs`` as globals."""
    return f"_ptc_code = {code!r}\n_ptc_inputs = {json.dumps(dict(inputs))!r}\n_ptc_generic = {generic!r}\n{_PROGRAM}"


# Standard library only; runs in the sandbox as the script's top level.
_PROGRAM = r'''
def _ptc_run():
    import ast, asyncio, builtins, json, linecache, os, sys, traceback

    g = sys.modules["__main__"].__dict__
    try:
        import tools
        from ptc_runtime.client import client as broker

        g["tools"] = tools
        for name, value in tools._ptc_toolbox.script_globals().items():
            if name not in vars(builtins) and not name.startswith("__"):
                g[name] = value
    except Exception:
        broker = None

    async def call_tool(tool_name, params=None):
        """Code mode's call_tool(name, params): the tool's result (a ToolError when it failed)."""
        if _ptc_generic:
            return await g["tools"].aio.call_tool(tool_name=tool_name, params=params or {})
        return await broker().arequest({"tool": tool_name, "args": dict(params or {})})

    g["call_tool"] = call_tool
    g.update(json.loads(_ptc_inputs))
    code = _ptc_code
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    try:
        tree = ast.parse(code, "<code>")
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = tree.body[-1]
            tree.body[-1] = ast.copy_location(ast.Return(value=last.value), last)
        wrapper = ast.parse("async def _ptc_main():\n    pass\n")
        wrapper.body[0].body = tree.body or [ast.Pass()]
        ast.fix_missing_locations(wrapper)
        exec(compile(wrapper, "<code>", "exec"), g)
        value = asyncio.run(g.pop("_ptc_main")())
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        outcome = {"value": value}
    except BaseException as exc:
        traceback.print_exc()
        outcome = {"error": "".join(traceback.format_exception_only(type(exc), exc)).strip()}
    os.makedirs("/tmp/outputs", exist_ok=True)
    with open("/tmp/outputs/ptc-code-mode-result.json", "w") as f:
        json.dump(outcome, f)
    return "error" not in outcome


if not _ptc_run():
    raise SystemExit(1)
'''
