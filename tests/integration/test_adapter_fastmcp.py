"""FastMCP's code mode with ``PtcSandboxProvider`` (clients/python/ptc_sandbox_client/adapters/fastmcp.py) against the
real service: FastMCP's in-memory ``Client(server)`` plays the model and calls the code-mode ``execute`` tool with code
that fans out over three of the server's tools; the tools run in this process, and the result, the calls made here and
the job's call records are exact."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fastmcp
import pytest
from fastmcp.experimental.transforms.code_mode import CodeMode
from ptc_sandbox_client import AsyncClient
from ptc_sandbox_client.adapters.fastmcp import PtcSandboxProvider, code_mode

from tests.conftest import Service

FAN_OUT = """
import asyncio
weather, population, zone = await asyncio.gather(
    call_tool("get_weather", {"city": "Oslo"}),
    get_population(city="Oslo", year=2024),
    tools.aio.get_timezone(city="Oslo"),
)
print("three calls made")
return {"weather": weather, "population": population, "zone": zone, "big": 2**70}
"""


def make_server(calls: list[tuple[str, dict[str, Any]]], transform: CodeMode) -> fastmcp.FastMCP:
    server = fastmcp.FastMCP("cities", transforms=[transform])

    @server.tool
    def get_weather(city: str) -> dict[str, Any]:
        """The weather of a city now."""
        calls.append(("get_weather", {"city": city}))
        return {"city": city, "temp_c": 4}

    @server.tool
    def get_population(city: str, year: int = 2025) -> int:
        """The population of a city in a year."""
        calls.append(("get_population", {"city": city, "year": year}))
        return 709_000

    @server.tool
    def get_timezone(city: str) -> str:
        """The IANA time zone of a city."""
        calls.append(("get_timezone", {"city": city}))
        return "Europe/Oslo"

    return server


async def test_code_mode_runs_the_code_in_the_service_with_the_servers_tools(service: Service) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    async with AsyncClient(service.url, service.token, timeout=120) as client:
        transform = code_mode(client, provider={"timeout_s": 60})
        server = make_server(calls, transform)
        async with fastmcp.Client(server) as model:
            listed = {t.name for t in await model.list_tools()}
            assert listed == {"search", "get_schema", "execute"}
            result = await model.call_tool("execute", {"code": FAN_OUT})
        # FastMCP gives a scalar result an output schema that wraps it ({"result": ...}); code mode's call_tool
        # passes a structured result on as it is.
        assert result.structured_content == {
            "weather": {"city": "Oslo", "temp_c": 4},
            "population": {"result": 709_000},
            "zone": {"result": "Europe/Oslo"},
            "big": 2**70,
        }
        assert sorted(calls) == [
            ("get_population", {"city": "Oslo", "year": 2024}),
            ("get_timezone", {"city": "Oslo"}),
            ("get_weather", {"city": "Oslo"}),
        ]
        provider = transform.sandbox_provider
        assert isinstance(provider, PtcSandboxProvider)
        (view,) = provider.views
        assert view.status == "succeeded" and view.stdout == "three calls made\n", view
        records = (await client.get(view.job_id, calls="full")).call_records
        assert sorted((r.tool, r.args, r.status) for r in records) == [
            ("get_population", {"city": "Oslo", "year": 2024}, "ok"),
            ("get_timezone", {"city": "Oslo"}, "ok"),
            ("get_weather", {"city": "Oslo"}, "ok"),
        ]


async def test_a_failing_tool_and_a_failing_script_come_back_as_tool_errors(service: Service) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    async with AsyncClient(service.url, service.token, timeout=120) as client:
        transform = code_mode(client, provider={"timeout_s": 60}, max_tool_calls=1)
        server = make_server(calls, transform)
        code = (
            "try:\n    await call_tool('no_such_tool', {})\nexcept tools.ToolError as e:\n    first = e.type\n"
            "await get_timezone(city='Lima')\n"
            "try:\n    await get_timezone(city='Pune')\nexcept tools.ToolError as e:\n    third = e.message\n"
            "return [first, third]"
        )
        async with fastmcp.Client(server) as model:
            result = await model.call_tool("execute", {"code": code})
            failed = await model.call_tool(
                "execute", {"code": "x = 1\nraise ValueError('no luck')"}, raise_on_error=False
            )
        # A list result has no structured form: FastMCP sends it as JSON text.
        first, third = json.loads(result.content[0].text)
        assert first == "unknown_tool"
        assert "Tool call limit exceeded: at most 1" in third
        assert calls == [("get_timezone", {"city": "Lima"})]
        assert failed.is_error and "ValueError: no luck" in failed.content[0].text
        provider = transform.sandbox_provider
        assert isinstance(provider, PtcSandboxProvider)
        records = (await client.get(provider.views[0].job_id, calls="full")).call_records
        assert [(r.tool, r.status) for r in records] == [
            ("no_such_tool", "rejected"),
            ("get_timezone", "ok"),
            ("get_timezone", "error"),
        ]
        assert provider.views[1].status == "failed"


async def test_a_provider_without_a_catalog_offers_one_generic_call_tool(service: Service) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    async with AsyncClient(service.url, service.token, timeout=120) as client:
        provider = PtcSandboxProvider(client, timeout_s=60)
        server = make_server(calls, CodeMode(sandbox_provider=provider))
        async with fastmcp.Client(server) as model:
            result = await model.call_tool("execute", {"code": "await call_tool('get_timezone', {'city': 'Oslo'})"})
        assert result.structured_content == {"result": "Europe/Oslo"}
        assert calls == [("get_timezone", {"city": "Oslo"})]
        records = (await client.get(provider.views[0].job_id, calls="full")).call_records
        assert [(r.tool, r.args) for r in records] == [
            ("call_tool", {"tool_name": "get_timezone", "params": {"city": "Oslo"}})
        ]


def test_the_example_runs(service: Service) -> None:
    """clients/python/examples/fastmcp_code_mode.py (docs/adapters/fastmcp.md's program) as it is: its printed lines
    are its comments."""
    path = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples" / "fastmcp_code_mode.py"
    env = {**os.environ, "PTC_URL": service.url, "PTC_TOKEN": service.token}
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in path.read_text().splitlines()]
    expected = [line.split("# ", 1)[1] for line in lines if line.startswith("print(") and "# " in line]
    assert done.stdout.splitlines() == expected, done.stdout


async def test_a_cancelled_request_stops_its_job(service: Service) -> None:
    async def call_tool(name: str, params: dict[str, Any]) -> Any:
        raise AssertionError("no call expected")

    async with AsyncClient(service.url, service.token, timeout=120) as client:
        provider = PtcSandboxProvider(client, timeout_s=120, wait_s=5, metadata={"test": "cancel"})
        code = "import time\nprint('started', flush=True)\ntime.sleep(100)"
        run = asyncio.create_task(provider.run(code, external_functions={"call_tool": call_tool}))
        await asyncio.sleep(3)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        (stopping,) = provider.stopping
        await stopping
        # The job, found again by the same request (its Idempotency-Key), stopped.
        (view,) = provider.views
        assert view.status == "stopped" and view.metadata == {"test": "cancel"}, view
