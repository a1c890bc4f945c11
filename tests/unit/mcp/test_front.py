"""The MCP server front at ``/mcp`` (issue 16, point 2), with the ``mcp`` SDK's own client over Streamable HTTP,
in-process on the whole app with the fake backend (no engine): tools listed, a script calling two tools of a
toolset, a background job waited on and stopped, the key acting (another key's job is not found), requests
without a valid key refused with the 401 problem, and /mcp absent from the OpenAPI document."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from fastapi import FastAPI
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, TextContent, TextResourceContents

from service.api import create_app
from service.mcp import front as mcp_front
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.tenancy import hash_token

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
TOOLS = [
    {"name": "echo", "parameters": {"properties": {"text": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
    {"name": "shout", "parameters": {"properties": {"text": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
]
TWO_CALLS = """
import tools
a = tools.echo(text="one")
b = tools.shout(text="two")
print(a, b)
"""


@contextlib.asynccontextmanager
async def service(work_dir: Path | None = None, **overrides: Any) -> AsyncIterator[FastAPI]:
    """The app on the fake backend, started, with keys alice and bob (a scratch work dir unless given: then kept)."""
    scratch = work_dir is None
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    keys = ",".join(f"{name}:{hash_token(token)}" for name, token in TOKENS.items())
    settings = Settings(work_dir=work_dir, api_keys=keys, sandbox_folders_tmpfs_mb=0, warm_pool_size=0, **overrides)
    application = create_app(settings, FakeBackend())
    try:
        async with application.router.lifespan_context(application):
            yield application
    finally:
        if scratch:
            shutil.rmtree(work_dir, ignore_errors=True)


def http(app: FastAPI, token: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers, timeout=30
    )


def mcp_http(app: FastAPI, token: str) -> httpx2.AsyncClient:
    """The SDK's HTTP client (httpx2) on the app in-process."""
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app),
        base_url="http://test",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


@contextlib.asynccontextmanager
async def mcp_session(app: FastAPI, name: str) -> AsyncIterator[ClientSession]:
    async with (
        mcp_http(app, TOKENS[name]) as client,
        streamable_http_client("http://test/mcp", http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def answer(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    assert result.is_error
    content = result.content[0]
    assert isinstance(content, TextContent)
    return content.text


async def toolset_of(app: FastAPI, name: str) -> str:
    async with http(app, TOKENS[name]) as client:
        response = await client.post("/toolsets", json={"tools": TOOLS})
        assert response.status_code == 200, response.text
        toolset: str = response.json()["toolset_id"]
        return toolset


async def test_tools_listed_and_a_script_calls_two_tools_of_a_toolset() -> None:
    async with service() as app:
        toolset = await toolset_of(app, "alice")
        async with mcp_session(app, "alice") as session:
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
            assert set(tools) == {"execute", "get_job", "wait_job", "stop_job"}
            assert "tools.ToolError" in (tools["execute"].description or "")  # the stub usage text
            result = answer(await session.call_tool("execute", {"script": TWO_CALLS, "toolset_id": toolset}))
            assert result["status"] == "succeeded"
            assert result["error"] is None
            assert [line.split()[1:3] for line in result["calls"]] == [["echo", "ok"], ["shout", "ok"]]
            assert result["calls_total"] == 2
            stubs = await session.read_resource(f"ptc://toolsets/{toolset}/stubs")
            content = stubs.contents[0]
            assert isinstance(content, TextResourceContents)
            assert "def shout(" in content.text
        async with http(app, TOKENS["alice"]) as client:  # the job is alice's
            view = (await client.get(f"/jobs/{result['job_id']}")).json()
            assert view["stdout"] == result["stdout"]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A work dir with a short path (the sandboxes' unix sockets are under it)."""
    path = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_default_toolset_and_a_background_job_waited_on(short_dir: Path) -> None:
    async with service(short_dir) as app:
        toolset = await toolset_of(app, "alice")
    async with service(short_dir, mcp_toolset=toolset) as app:  # the same store: alice's toolset is kept
        async with mcp_session(app, "alice") as session:
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
            assert toolset in (tools["execute"].description or "")
            script = "import time\nimport tools\ntime.sleep(1.5)\nprint(tools.echo(text='late'))\n"
            started = answer(await session.call_tool("execute", {"script": script, "wait_s": 0}))
            assert started["status"] in ("queued", "running")
            ended = answer(await session.call_tool("wait_job", {"job_id": started["job_id"], "timeout_s": 60}))
            assert ended["status"] == "succeeded"
            assert "late" in ended["stdout"]
            assert answer(await session.call_tool("get_job", {"job_id": started["job_id"]}))["status"] == "succeeded"
            running = answer(await session.call_tool("execute", {"script": "import time\ntime.sleep(60)", "wait_s": 0}))
            stopped = answer(await session.call_tool("stop_job", {"job_id": running["job_id"]}))
            assert stopped["status"] not in ("queued", "running")
        async with mcp_session(app, "bob") as session:  # alice's job, seen by bob: not found
            text = error_text(await session.call_tool("get_job", {"job_id": started["job_id"]}))
            assert "job-not-found: " in text, text
            text = error_text(await session.call_tool("execute", {"script": "print(1)"}))  # alice's toolset
            assert "invalid-request: " in text and "toolset" in text, text


@pytest.mark.parametrize("token", [None, "not-a-key"])
async def test_unauthenticated_requests_refused(token: str | None) -> None:
    async with service() as app, http(app, token) as client:
        response = await client.post(
            "/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"Accept": "application/json, text/event-stream"},
        )
        assert response.status_code == 401
        assert response.headers["content-type"] == "application/problem+json"
        assert json.loads(response.content)["status"] == 401
        labels = {"method": "POST", "route": "/mcp", "status": "401"}
        value = app.state.metrics.registry.get_sample_value("ptc_http_requests_total", labels)
        assert value == 1  # counted under its route, not "unmatched"


async def test_mcp_is_not_in_the_openapi_document() -> None:
    async with service() as app, http(app, None) as client:
        document = (await client.get("/openapi.json")).json()
        assert not any(path.startswith("/mcp") for path in document["paths"])


def test_cli_mcp_needs_a_url(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from service.__main__ import main

    monkeypatch.delenv("PTC_URL", raising=False)
    assert main(["mcp"]) == 2
    assert "PTC_URL" in capsys.readouterr().err


@pytest.mark.parametrize("job_id", ["../execute", "a/b", "x?y", ""])
async def test_stdio_front_refuses_ids_that_are_not_one_path_segment(job_id: str) -> None:
    from mcp.server.mcpserver.exceptions import ToolError

    from service.mcp.stdio import OverHttp

    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no request may be sent: {request.url}")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="http://test") as client:
        with pytest.raises(ToolError, match="job-not-found"):
            await OverHttp(client).get(None, job_id)  # type: ignore[arg-type]  # the context is not used


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def _get_job_message(pad: str) -> bytes:
    """A tools/call of get_job with an extra argument ``pad`` (raw JSON), which the tool ignores."""
    return (
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"get_job","arguments":'
        b'{"job_id":"job_x","pad":' + pad.encode() + b"}}}"
    )


@pytest.mark.parametrize(
    "pad",
    [
        "[" + ",".join(["[]"] * 20_000) + "]",  # many small values: the SDK parsed 4 MiB of them on the loop for 1 s
        "[" * 5_000 + "]" * 5_000,  # deeper than the stdlib's recursion: a 500 from the SDK
        "1" * 5_000,  # an integer past Python's digit limit: a 500 from the SDK
    ],
    ids=["many-values", "deep", "long-integer"],
)
async def test_a_costly_message_is_refused_before_the_sdk_parses_it_on_the_loop(pad: str) -> None:
    from service.api import bodies

    parsed_on_threads: list[bytes] = []
    real = bodies.parse_body

    def spy(raw: bytes, *args: Any) -> Any:
        parsed_on_threads.append(raw)
        return real(raw, *args)

    async with service() as app, http(app, TOKENS["alice"]) as client:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("service.mcp.front.parse_body", spy)
            response = await client.post("/mcp", content=_get_job_message(pad), headers=MCP_HEADERS)
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert json.loads(response.content)["type"].endswith("/invalid-request")
        assert len(parsed_on_threads) == 1


async def test_an_ordinary_message_passes_the_check_and_a_large_string_is_not_refused_below_the_body_limit() -> None:
    async with service() as app, http(app, TOKENS["alice"]) as client:
        small = await client.post("/mcp", content=_get_job_message('"x"'), headers=MCP_HEADERS)
        # 5 MiB: above the SDK's own 4 MiB default, below PTC_MAX_BODY_BYTES (8 MiB), as POST /execute takes it
        large = await client.post("/mcp", content=_get_job_message('"' + "x" * (5 << 20) + '"'), headers=MCP_HEADERS)
        for response in (small, large):
            assert response.status_code == 200, response.text[:300]
            result = response.json()["result"]
            assert result["isError"] and "job-not-found" in result["content"][0]["text"]
        over = _get_job_message('"' + "x" * (9 << 20) + '"')
        too_large = await client.post("/mcp", content=over, headers=MCP_HEADERS)
        assert too_large.status_code == 413
        assert too_large.headers["content-type"] == "application/problem+json"


async def test_a_get_stream_is_refused_not_held_open() -> None:
    async with service() as app, http(app, TOKENS["alice"]) as client:
        with anyio.fail_after(10):  # before: a stream of pings, never ending
            response = await client.get("/mcp", headers={"Accept": "text/event-stream"})
        assert response.status_code == 405
        assert response.headers["allow"] == "POST"
        assert response.headers["content-type"] == "application/problem+json"
        async with mcp_session(app, "alice") as session:  # the SDK's client takes the 405 in its stride
            assert {tool.name for tool in (await session.list_tools()).tools} >= {"execute"}


async def test_a_client_of_the_2026_protocol_runs_a_script_and_reads_the_stubs() -> None:
    """The SDK's own ``Client`` probes ``server/discover`` and speaks 2026-07-28 (one self-contained POST per
    request, no handshake); before (mcp 1.x): the version was refused."""
    from mcp import Client

    async with service() as app:
        toolset = await toolset_of(app, "alice")
        async with (
            mcp_http(app, TOKENS["alice"]) as http_client,
            Client(streamable_http_client("http://test/mcp", http_client=http_client)) as client,
        ):
            assert client.protocol_version == "2026-07-28"
            assert {tool.name for tool in (await client.list_tools()).tools} == {
                "execute",
                "get_job",
                "wait_job",
                "stop_job",
            }
            result = answer(await client.call_tool("execute", {"script": TWO_CALLS, "toolset_id": toolset}))
            assert result["status"] == "succeeded" and result["calls_total"] == 2
            stubs = await client.read_resource(f"ptc://toolsets/{toolset}/stubs")
            content = stubs.contents[0]
            assert isinstance(content, TextResourceContents) and "def shout(" in content.text
        async with (
            mcp_http(app, TOKENS["bob"]) as http_client,
            Client(streamable_http_client("http://test/mcp", http_client=http_client)) as client,
        ):  # the key acts on this path too
            text = error_text(await client.call_tool("get_job", {"job_id": result["job_id"]}))
            assert "job-not-found: " in text, text


async def test_a_subscription_stream_is_refused_not_held_open() -> None:
    """``subscriptions/listen`` (2026-07-28) would hold a stream open per request for change notifications that
    never come (the tools do not change): the method is not served."""
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "subscriptions/listen",
        "params": {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            },
            "notifications": {"toolsListChanged": True},
        },
    }
    headers = MCP_HEADERS | {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "subscriptions/listen"}
    async with service() as app, http(app, TOKENS["alice"]) as client:
        with anyio.fail_after(10):  # with the SDK's default: a stream held open until the client leaves
            response = await client.post("/mcp", json=message, headers=headers)
        assert response.json()["error"]["code"] == -32601  # method not found


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"])
async def test_a_message_that_is_not_sent_as_json_is_a_problem(content_type: str | None) -> None:
    message = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
    headers = {"Accept": "application/json, text/event-stream"} | (
        {"Content-Type": content_type} if content_type else {}
    )
    async with service() as app, http(app, TOKENS["alice"]) as client:
        response = await client.post("/mcp", content=message, headers=headers)  # before: the SDK's plain-text 400
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"].endswith("/bad-request")


async def test_the_call_lines_of_an_answer_are_capped() -> None:
    from service.mcp.server import MAX_CALL_LINES

    # before: one line per call, up to PTC_MAX_TOOL_CALLS (10,000: 250 KB of lines, twice, in one tool result)
    script = f"import tools\nfor i in range({MAX_CALL_LINES + 50}):\n    tools.echo(text='x')\nprint('done')\n"
    async with service() as app:
        toolset = await toolset_of(app, "alice")
        async with mcp_session(app, "alice") as session:
            result = answer(await session.call_tool("execute", {"script": script, "toolset_id": toolset}))
            assert result["status"] == "succeeded", result
            assert result["calls_total"] == MAX_CALL_LINES + 50
            assert len(result["calls"]) == MAX_CALL_LINES
            assert result["calls"][0].split()[:3] == ["1", "echo", "ok"]


async def test_a_large_view_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's calls can make a view of megabytes: it is parsed on a worker thread, a small one in place."""
    threads: list[str] = []
    real = json.loads

    def loads(data: bytes) -> Any:
        threads.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(json, "loads", loads)  # the module mcp_front parses with
    small = b'{"job_id": "job_1", "calls": []}'
    large = b'{"job_id": "job_1", "stdout": "' + b"x" * (mcp_front.INLINE_PARSE_BYTES + 1) + b'"}'
    assert (await mcp_front._json(small))["job_id"] == (await mcp_front._json(large))["job_id"] == "job_1"
    assert threads[0] == threading.main_thread().name != threads[1]
