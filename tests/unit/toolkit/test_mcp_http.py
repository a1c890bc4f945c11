"""MCP endpoints on the mcp 2.x SDK: its ``httpx2`` client through the egress rules (``toolkit.mcp_http``), and
what an MCP server's HTTP answers become (``toolkit.endpoints``), against real servers on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
import uvicorn
from mcp.server.mcpserver import MCPServer
from starlette.types import Receive, Scope, Send

from service.egress import EgressDenied, EgressPolicy
from service.toolkit.endpoints import EndpointClients, ToolCallFailed
from service.toolkit.manifest import parse_tool
from service.toolkit.mcp_http import EgressBridge, mcp_client
from tests.conftest import free_port
from tests.toolserver import ToolServer


def allowing(*urls: str) -> EgressPolicy:
    return EgressPolicy([url.rsplit("/", 1)[0] for url in urls])


async def test_the_bridge_answers_as_the_server_did(tool_server: ToolServer) -> None:
    url = tool_server.url("echo")
    async with mcp_client({"x-k": "v"}, httpx2.Timeout(5), allowing(url)) as client:
        response = await client.post(url, json={"a": 1})
    assert response.status_code == 200 and response.json() == {"args": {"a": 1}}
    assert tool_server.headers[-1]["x-k"] == "v"


async def test_transport_errors_come_back_as_httpx2_errors(tool_server: ToolServer) -> None:
    refused = f"http://127.0.0.1:{free_port()}/mcp"
    trickle = tool_server.url("trickle")
    async with mcp_client({}, httpx2.Timeout(5, read=0.2), allowing(refused, trickle)) as client:
        with pytest.raises(httpx2.ConnectError) as caught:
            await client.post(refused, json={})
        assert isinstance(caught.value.__cause__, httpx.ConnectError)
        with pytest.raises(httpx2.ReadTimeout):  # while the body is read: one byte every 0.5 s
            await client.post(trickle, json={})


async def test_a_refused_destination_is_egress_denied_and_nothing_is_sent(tool_server: ToolServer) -> None:
    url = tool_server.url("echo")
    before = len(tool_server.requests)
    bridge = EgressBridge(EgressPolicy([f"http://127.0.0.1:{free_port()}"]))
    async with httpx2.AsyncClient(transport=bridge) as client:
        with pytest.raises(EgressDenied):
            await client.post(url, json={})
    assert len(tool_server.requests) == before


class _Failing:
    """An ASGI app in front of an MCP server: a ``tools/call`` of ``boom`` is answered HTTP 500 without reaching
    it; anything else passes."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if b'"tools/call"' in body and b'"boom"' in body:
            await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"down"})
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)


@pytest.fixture
def mcp_server() -> Iterator[str]:
    """An MCPServer (mcp 2.x) with tools ``add`` and ``boom`` behind ``_Failing``; yields its URL."""
    server = MCPServer("t")

    @server.tool()
    def add(a: int, b: int) -> dict[str, int]:
        return {"sum": a + b}

    @server.tool()
    def boom() -> str:
        return "never"

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_Failing(server.streamable_http_app()), log_level="warning", lifespan="on")
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not runner.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the MCP server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    runner.should_exit = True
    thread.join(10)
    sock.close()


async def test_an_http_error_status_fails_that_call_only(mcp_server: str) -> None:
    """Before (mcp 1.x) an HTTP error status ended the whole MCP session; the 2.x SDK fails the one request: it
    is ``http_error``, and the session keeps serving."""
    clients = EndpointClients(5, 1024 * 1024, allowing(mcp_server))

    def tool(name: str) -> Any:
        return parse_tool({"name": name, "endpoint": {"kind": "mcp", "url": mcp_server}}, ("tools", 0))

    try:
        assert await clients.call(tool("add"), {"a": 2, "b": 3}) == {"sum": 5}
        with pytest.raises(ToolCallFailed) as caught:
            await clients.call(tool("boom"), {})
        assert caught.value.type == "http_error", caught.value
        assert await clients.call(tool("add"), {"a": 1, "b": 1}) == {"sum": 2}
        (session,) = clients._mcp_sessions.values()
        assert not session.ended
        listed = await clients.list_mcp_tools(mcp_server, {}, 5)
        assert {entry["name"] for entry in listed} == {"add", "boom"}
        assert all("inputSchema" in entry for entry in listed)  # the wire's names, as manifests take them
    finally:
        await clients.aclose()


async def test_no_mcp_endpoint_at_the_url_is_http_error_404(tool_server: ToolServer) -> None:
    url = tool_server.url("no_such_route")  # the tool server answers 404
    clients = EndpointClients(5, 1024 * 1024, allowing(url))
    try:
        with pytest.raises(ToolCallFailed) as caught:
            await clients.call(parse_tool({"name": "t", "endpoint": {"kind": "mcp", "url": url}}, ("tools", 0)), {})
        assert caught.value.type == "http_error" and "404" in caught.value.message, caught.value
        with pytest.raises(ToolCallFailed) as caught:
            await clients.list_mcp_tools(url, {}, 5)
        assert caught.value.type == "http_error" and "404" in caught.value.message, caught.value
    finally:
        await clients.aclose()
