"""BFCL's stateful multi-turn tools served for real: over plain HTTP and as an MCP server (tests only).

The tools are BFCL's own implementations
(``bfcl_eval/eval_checker/multi_turn_eval/func_source_code``: ``GorillaFileSystem``,
``TradingBot``, ``TwitterAPI``, ...), one instance per server, set up the way
BFCL's executor does it (``_load_scenario(deepcopy(initial_config[class]))``).
Their schemas are BFCL's ``multi_turn_func_doc/*.json`` (BFCL dialect).

- ``BfclHttpServer``: stdlib ``http.server`` on 127.0.0.1. ``POST /<method>``
  with a JSON object of arguments answers ``200`` with the JSON result;
  ``404`` for an unknown method, ``400`` for a body that is not a JSON object,
  ``500`` ``{"error": "<Type>: <text>"}`` when the method raises.
- ``BfclMcpServer``: the ``mcp`` SDK's (2.x) low-level ``Server`` behind its
  ``StreamableHTTPSessionManager`` (stateful sessions, SSE answers), in a
  Starlette app served by uvicorn at ``http://127.0.0.1:<port>/mcp``.
  ``tools/list`` gives each method with ``inputSchema`` = its BFCL schema
  mapped to JSON Schema; ``tools/call`` answers a dict result as
  ``structuredContent`` (and its JSON text), any other result as JSON text
  only; an unknown tool or a method that raises gives ``isError: true``
  (built here: the 2.x low-level server answers a raised exception as a
  JSON-RPC error).

Both start in a background thread on a free port when entered as a context
manager and stop on exit. Results are made JSON-safe by ``to_json`` (a JSON
round trip; non-JSON values become ``str``), so a result read over either
transport equals ``to_json`` of the same call made in Python.

Which classes can be served depends on what is installed: ``servable_classes``
imports each class of BFCL's table and keeps those that import
(``bfcl-eval`` is installed with ``--no-deps``; ``MathAPI`` needs ``mpmath``,
the memory classes ``overrides``/``numpy``/..., ``WebSearchAPI`` ``html2text``).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import functools
import importlib
import inspect
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

import uvicorn
from mcp import ClientSession
from mcp import types as mcp_types
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from service.toolkit.schema import to_json_schema
from tests.bfcl_data import bfcl_data_dir

START_S = 10.0  # a server must be up within this many seconds
STOP_GRACE_S = 2  # uvicorn closes connections still open (an MCP client's GET stream) after this


@functools.cache
def servable_classes() -> dict[str, type[Any]]:
    """BFCL multi-turn classes that import with what is installed, by BFCL class name.

    Raises:
        RuntimeError: when ``bfcl_eval`` is not installed (from ``bfcl_data_dir``).
    """
    bfcl_data_dir()
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    classes: dict[str, type[Any]] = {}
    for class_name, module_name in CLASS_FILE_PATH_MAPPING.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        classes[class_name] = vars(module)[class_name]
    return classes


def function_docs(class_name: str) -> list[dict[str, Any]]:
    """BFCL's function docs of ``class_name`` (``name``, ``description``, ``parameters``, ``response``)."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    path = bfcl_data_dir() / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def new_instance(class_name: str, initial_config: dict[str, Any]) -> Any:
    """A fresh instance set up as BFCL's executor does (stateless classes get no scenario)."""
    from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

    instance = servable_classes()[class_name]()
    if class_name not in STATELESS_CLASSES:
        instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})), long_context=False)
    return instance


def public_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """The instance's tools: its public methods by name (the dispatch table of both servers)."""
    return {
        name: method
        for name, method in inspect.getmembers(instance, predicate=inspect.ismethod)
        if not name.startswith("_")
    }


def state(instance: Any) -> dict[str, Any]:
    """What BFCL's state checker compares: the instance's public attributes."""
    return {key: value for key, value in vars(instance).items() if not key.startswith("_")}


def to_json(value: Any) -> Any:
    """``value`` as JSON gives it back (int keys become strings, tuples lists, other objects ``str``)."""
    return json.loads(json.dumps(value, default=str))


def parse_call(call: str, methods: dict[str, Callable[..., Any]]) -> tuple[str, dict[str, Any]]:
    """One BFCL ground-truth call string (``"cd(folder='document')"``, ``"sort('a.pdf')"``) -> (name, kwargs).

    Positional arguments are named from the method's signature.

    Raises:
        ValueError: not a call of a known method with literal arguments, or arguments that do not bind.
    """
    node = ast.parse(call.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in methods:
        raise ValueError(f"not a call of a known method: {call!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    if len(kwargs) != len(node.keywords):
        raise ValueError(f"**kwargs in a ground-truth call: {call!r}")
    try:
        bound = inspect.signature(methods[node.func.id]).bind(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{call!r}: {exc}") from exc
    return node.func.id, dict(bound.arguments)


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class BfclHttpServer:
    """One BFCL class instance behind ``POST /<method>`` on 127.0.0.1 (see the module docstring).

    Args:
        class_name: a key of ``servable_classes()``.
        initial_config: a BFCL entry's ``initial_config`` (all classes; this one's part is used).

    Attributes:
        instance: the served instance (read its state after the calls).
        calls: ``(method, args)`` of every request, in order.
    """

    def __init__(self, class_name: str, initial_config: dict[str, Any]) -> None:
        self.instance = new_instance(class_name, initial_config)
        self.methods = public_methods(self.instance)
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                try:
                    args = json.loads(self.rfile.read(length) or b"null")
                except ValueError:
                    args = None
                status, body = server.answer(self.path.lstrip("/"), args)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def answer(self, name: str, args: Any) -> tuple[int, Any]:
        """(status, JSON body) for one call; calls run one at a time (BFCL's classes are not thread-safe)."""
        method = self.methods.get(name)
        if method is None:
            return 404, {"error": f"no method {name!r}"}
        if not isinstance(args, dict):
            return 400, {"error": "the body must be a JSON object of arguments"}
        with self._lock:
            self.calls.append((name, args))
            try:
                return 200, to_json(method(**args))
            except Exception as exc:
                return 500, {"error": f"{type(exc).__name__}: {exc}"}

    def url(self, method: str) -> str:
        """The endpoint URL of one method."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/{method}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class _McpApp:
    """The ASGI endpoint at ``/mcp``: notes sessions and headers, then hands the request to the SDK."""

    def __init__(self, server: BfclMcpServer, manager: StreamableHTTPSessionManager) -> None:
        self._server = server
        self._manager = manager

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        self._server.requests.append((scope.get("method", ""), headers))
        if "mcp-session-id" in headers:
            self._server.session_ids.add(headers["mcp-session-id"])
        await self._manager.handle_request(scope, receive, send)


class BfclMcpServer:
    """One BFCL class instance as an MCP server over Streamable HTTP on 127.0.0.1 (see the module docstring).

    Args:
        class_name: a key of ``servable_classes()``.
        initial_config: a BFCL entry's ``initial_config`` (all classes; this one's part is used).

    Attributes:
        url: the MCP endpoint, ``http://127.0.0.1:<port>/mcp``.
        instance: the served instance (read its state after the calls).
        tools: what ``tools/list`` answers.
        calls: ``(tool, arguments)`` of every ``tools/call``, in order.
        requests: ``(HTTP method, headers)`` of every HTTP request to ``/mcp``.
        session_ids: the MCP session ids clients used (one per session they opened).
    """

    def __init__(self, class_name: str, initial_config: dict[str, Any]) -> None:
        self.instance = new_instance(class_name, initial_config)
        self.methods = public_methods(self.instance)
        self.tools = [
            mcp_types.Tool(
                name=doc["name"], description=doc["description"], input_schema=to_json_schema(doc["parameters"])
            )
            for doc in function_docs(class_name)
            if doc["name"] in self.methods
        ]
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.session_ids: set[str] = set()

        server: Server[Any] = Server(f"bfcl-{class_name}", on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        manager = StreamableHTTPSessionManager(app=server)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with manager.run():
                yield

        app = Starlette(routes=[Route("/mcp", endpoint=_McpApp(self, manager))], lifespan=lifespan)
        self._socket = _free_socket()
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/mcp"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=STOP_GRACE_S)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]}, daemon=True)

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: mcp_types.PaginatedRequestParams | None
    ) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(tools=self.tools)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: mcp_types.CallToolRequestParams
    ) -> mcp_types.CallToolResult:
        name, arguments = params.name, dict(params.arguments or {})
        method = self.methods.get(name)
        if method is None:
            return _tool_error(f"unknown tool {name!r}")
        self.calls.append((name, arguments))
        try:
            result = to_json(method(**arguments))
        except Exception as exc:
            return _tool_error(str(exc))
        return mcp_types.CallToolResult(
            content=[mcp_types.TextContent(type="text", text=json.dumps(result))],
            structured_content=result if isinstance(result, dict) else None,
        )

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + START_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the MCP server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(START_S + STOP_GRACE_S)
        self._socket.close()


def _tool_error(text: str) -> mcp_types.CallToolResult:
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)], is_error=True)


async def _list_tools(url: str) -> list[dict[str, Any]]:
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = await session.list_tools()
    return [tool.model_dump(mode="json", by_alias=True, exclude_none=True) for tool in listed.tools]


def list_tools(url: str) -> list[dict[str, Any]]:
    """An MCP server's ``tools/list`` entries as JSON (``name``, ``description``, ``inputSchema``, ...)."""
    return asyncio.run(_list_tools(url))


@contextlib.contextmanager
def serve(kind: str, class_names: list[str], initial_config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Serve each class on its own server of ``kind`` (``http`` or ``mcp``); yields servers by class name."""
    factory: dict[str, Callable[[str, dict[str, Any]], BfclHttpServer | BfclMcpServer]] = {
        "http": BfclHttpServer,
        "mcp": BfclMcpServer,
    }
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(factory[kind](name, initial_config)) for name in class_names}


def main() -> None:
    """``python -m tests.bfcl_servers CLASS [--kind mcp|http] [--manifest FILE]``: serve one class until interrupted.

    Prints the server's URL; with ``--manifest``, writes a ptc-sandbox manifest for it (the MCP server's
    ``tools/list`` entries, or the BFCL docs, each with its endpoint) to FILE. The instance starts from
    BFCL's first ``multi_turn_base`` scenario that uses the class (the MCP example of docs/tools-and-manifests.md).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("cls", help="e.g. GorillaFileSystem, TradingBot")
    parser.add_argument("--kind", choices=("mcp", "http"), default="mcp")
    parser.add_argument("--manifest", help="write the manifest (JSON) here")
    args = parser.parse_args()
    config: dict[str, Any] = {}
    with open(bfcl_data_dir() / "BFCL_v4_multi_turn_base.json", encoding="utf-8") as f:
        for line in f:
            entry = json.loads(line)
            if args.cls in entry.get("involved_classes", []):
                config = entry.get("initial_config", {})
                break
    with serve(args.kind, [args.cls], config) as servers:
        server = servers[args.cls]
        if args.kind == "mcp":
            entries = [{**tool, "endpoint": {"kind": "mcp", "url": server.url}} for tool in list_tools(server.url)]
        else:
            entries = [
                {**doc, "endpoint": {"kind": "http", "url": f"{server.url}/{doc['name']}"}}
                for doc in function_docs(args.cls)
            ]
        if args.manifest:
            with open(args.manifest, "w", encoding="utf-8") as out:
                json.dump(entries, out, indent=1)
        print(f"{args.cls} over {args.kind} at {server.url} ({len(entries)} tools)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
