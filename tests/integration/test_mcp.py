"""The MCP front against the real service (issue 16, point 2), with the ``mcp`` SDK's own client: over
Streamable HTTP at ``/mcp`` and over stdio (``ptc-sandbox mcp`` spawned, pointing at the service). Each lists
the tools, runs a script calling two tools of a toolset (echo endpoints), and waits on a background job;
requests without a valid key are refused. Sandboxes started: four trivial scripts."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from tests.conftest import ROOT, Service

TOOLS = [
    {"name": "echo", "parameters": {"properties": {"text": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
    {"name": "shout", "parameters": {"properties": {"text": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
]
TWO_CALLS = "import tools\nprint(tools.echo(text='one'), tools.shout(text='two'))\n"
BACKGROUND = "import time\nimport tools\ntime.sleep(2)\nprint(tools.echo(text='late'))\n"


def answer(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def toolset_of(service: Service) -> str:
    with service.client() as client:
        response = client.post("/toolsets", json={"tools": TOOLS})
        assert response.status_code == 200, response.text
        toolset: str = response.json()["toolset_id"]
        return toolset


async def exercise(session: ClientSession | Client, toolset: str, service: Service) -> None:
    """List the tools, run two tool calls, wait on a background job; the jobs are the key's."""
    assert {tool.name for tool in (await session.list_tools()).tools} == {"execute", "get_job", "wait_job", "stop_job"}
    ran = answer(await session.call_tool("execute", {"script": TWO_CALLS, "toolset_id": toolset, "wait_s": 60}))
    assert ran["status"] == "succeeded", ran
    assert [line.split()[1:3] for line in ran["calls"]] == [["echo", "ok"], ["shout", "ok"]]
    started = answer(await session.call_tool("execute", {"script": BACKGROUND, "toolset_id": toolset, "wait_s": 0}))
    assert started["status"] in ("queued", "running")
    ended = answer(await session.call_tool("wait_job", {"job_id": started["job_id"], "timeout_s": 120}))
    assert ended["status"] == "succeeded", ended
    assert "late" in ended["stdout"]
    with service.client() as client:  # the job is the key's, seen through the HTTP API too
        assert client.get(f"/jobs/{started['job_id']}").json()["stdout"] == ended["stdout"]


@contextlib.asynccontextmanager
async def over_http(service: Service) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers=service.headers, timeout=180) as client,
        streamable_http_client(f"{service.url}/mcp", http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()  # the handshake of protocol versions up to 2025-11-25
        yield session


async def test_streamable_http(service: Service) -> None:
    async with over_http(service) as session:
        await exercise(session, toolset_of(service), service)


async def test_stdio(service: Service) -> None:
    parameters = StdioServerParameters(
        command=sys.executable,
        args=["-m", "service", "mcp", "--url", service.url],
        env={**os.environ, "PTC_TOKEN": service.token},
        cwd=str(ROOT),
    )
    async with stdio_client(parameters) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await exercise(session, toolset_of(service), service)


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_client_of_the_2026_protocol(service: Service, transport: str) -> None:
    """The SDK's ``Client`` probes ``server/discover`` and speaks 2026-07-28 when the server does (both fronts)."""
    if transport == "http":
        async with (
            httpx2.AsyncClient(headers=service.headers, timeout=180) as http_client,
            Client(streamable_http_client(f"{service.url}/mcp", http_client=http_client)) as client,
        ):
            assert client.protocol_version == "2026-07-28"
            await exercise(client, toolset_of(service), service)
        return
    parameters = StdioServerParameters(
        command=sys.executable,
        args=["-m", "service", "mcp", "--url", service.url],
        env={**os.environ, "PTC_TOKEN": service.token},
        cwd=str(ROOT),
    )
    async with Client(parameters) as client:
        assert client.protocol_version == "2026-07-28"
        await exercise(client, toolset_of(service), service)


async def test_stdio_with_a_wrong_token_gets_unauthorized(service: Service) -> None:
    parameters = StdioServerParameters(
        command=sys.executable,
        args=["-m", "service", "mcp", "--url", service.url],
        env={**os.environ, "PTC_TOKEN": "not-a-key"},
        cwd=str(ROOT),
    )
    async with stdio_client(parameters) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("execute", {"script": "print(1)"})
        assert result.is_error
        assert "unauthorized: " in str(result.content[0])


def test_unauthenticated_http_refused(service: Service) -> None:
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"Accept": "application/json, text/event-stream"}
    for headers in ({}, {"Authorization": "Bearer not-a-key"}):
        response = httpx.post(f"{service.url}/mcp", json=message, headers={**accept, **headers}, timeout=30)
        assert response.status_code == 401
        assert response.headers["content-type"] == "application/problem+json"
