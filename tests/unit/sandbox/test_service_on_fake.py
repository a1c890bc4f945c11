"""The whole service on the fake backend, no engine: an ``/execute`` runs its script with a tool call through the
real broker, cold and pooled, and a script past its time limit is killed."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from service.api import create_app
from service.sandbox.fake import FakeBackend
from service.settings import Settings

TOOLS = [{"name": "t", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]


@pytest.fixture(params=[0, 1], ids=["cold", "pooled"])
async def api(request: pytest.FixtureRequest) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend]]:
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        auth="disabled",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=request.param,
        instance_id="fake-" + work_dir.name,
    )
    backend = FakeBackend()
    app = create_app(settings, backend)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as client:
                yield client, backend
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    assert await backend.labelled({}) == []


async def test_a_script_runs_with_a_tool_call(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    client, _ = api
    script = "import tools\nprint(tools.t(x=1)['args'])\n"
    answer = await client.post("/execute", json={"script": script, "tools": TOOLS})
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["status"], view["stdout"], view["exit_code"]) == ("succeeded", "{'x': 1}\n", 0), view
    assert [call["status"] for call in view["calls"]] == ["ok"]


async def test_a_script_past_its_time_limit_is_timed_out(api: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    client, _ = api
    script = "import time\nprint('start', flush=True)\ntime.sleep(60)\n"
    view = (await client.post("/execute", json={"script": script, "timeout_s": 1})).json()
    assert (view["status"], view["stdout"], view["error"]["type"]) == ("timed_out", "start\n", "timeout"), view
