"""The runner's own guarantees, through the whole service on the fake backend (no engine; issue 25, point 7).

Each test here defends one thing the runner and its wiring must do and that the helpers' unit tests cannot see:
the job's ``error`` is the service's verdict and never the script's own report, the inline output cap and the
retained-output cap are the ones the request and the settings give, and a deleted session's sandbox is removed.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import create_app
from service.output import ELISION_MARK
from service.sandbox.fake import FakeBackend
from service.sandbox.labels import LABEL_SESSION
from service.settings import Settings

Served = tuple[httpx.AsyncClient, FakeBackend]
SESSION_SANDBOX = {LABEL_SESSION: "1"}


@asynccontextmanager
async def _served(**overrides: Any) -> AsyncIterator[Served]:
    work_dir = Path(tempfile.mkdtemp(prefix="ptcr", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        auth="disabled",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
        **overrides,
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


@pytest.fixture
def served() -> Callable[..., AbstractAsyncContextManager[Served]]:
    """A service on a fake backend with the given settings overrides (no warm pool, no authentication)."""
    return _served


async def _execute(client: httpx.AsyncClient, script: str, **body: Any) -> dict[str, Any]:
    answer = await client.post("/execute", json={"script": script, **body})
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


async def test_the_scripts_own_report_never_becomes_the_verdict(
    served: Callable[..., AbstractAsyncContextManager[Served]],
) -> None:
    """A script that raises ``MemoryError`` (its runtime reports it) and one that exits 3 after raising: the job's
    ``error`` is what the service saw (``nonzero_exit`` with the exit code), the report rides along only."""
    async with served() as (client, _):
        view = await _execute(client, "raise MemoryError('claimed, not true')\n")
        assert view["status"] == "failed", view
        assert view["error"]["type"] == "nonzero_exit", view["error"]
        assert view["error"]["message"] == f"the script exited with code {view['exit_code']}", view["error"]
        assert view["error"]["script_report"]["type"] == "MemoryError", view["error"]
        assert view["error"]["script_report"]["message"] == "claimed, not true", view["error"]


async def test_the_inline_output_cap_is_the_requests(
    served: Callable[..., AbstractAsyncContextManager[Served]],
) -> None:
    """``limits.output_bytes`` 1024: the view keeps 1024 bytes of each stream (head and tail), counts them all."""
    script = "import sys\nsys.stdout.write('o' * 10000)\nsys.stderr.write('e' * 10000)\n"
    async with served() as (client, _):
        view = await _execute(client, script, limits={"output_bytes": 1024})
        assert view["status"] == "succeeded", view
        for stream, letter in (("stdout", "o"), ("stderr", "e")):
            assert view[f"{stream}_truncated"] is True, view
            assert view[f"{stream}_bytes"] == 10000, view
            assert view[stream] == letter * 512 + ELISION_MARK.format(n=10000 - 1024) + letter * 512, view[stream]
        small = await _execute(client, "print('x' * 900)\n", limits={"output_bytes": 1024})
        assert (small["stdout_truncated"], small["stdout"]) == (False, "x" * 900 + "\n"), small


async def test_the_retained_output_cap_is_the_settings(
    served: Callable[..., AbstractAsyncContextManager[Served]],
) -> None:
    """``output_retention_bytes`` 4096: a stream of 10000 bytes keeps its first 4096 on disk, readable by offset."""
    script = "import sys\nsys.stdout.write(''.join(chr(97 + i % 26) for i in range(10000)))\n"
    async with served(output_retention_bytes=4096) as (client, _):
        view = await _execute(client, script)
        assert view["status"] == "succeeded", view
        assert (view["stdout_bytes"], view["stdout_retained_bytes"]) == (10000, 4096), view
        raw = await client.get(f"/jobs/{view['job_id']}/output/stdout", params={"offset": 0})
        assert raw.status_code == 200, raw.text
        assert raw.content == "".join(chr(97 + i % 26) for i in range(4096)).encode()


async def test_a_deleted_sessions_sandbox_is_removed(
    served: Callable[..., AbstractAsyncContextManager[Served]],
) -> None:
    """DELETE /sessions/{id}: the session's sandbox is gone from the engine at once (not at the service's stop)."""
    async with served() as (client, backend):
        created = await client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        view = await _execute(client, "print('in the session')\n", session_id=session_id)
        assert view["status"] == "succeeded", view
        assert len(await backend.labelled(SESSION_SANDBOX)) == 1  # the only session, with no warm pool
        deleted = await client.delete(f"/sessions/{session_id}")
        assert deleted.status_code == 200, deleted.text
        for _ in range(100):  # removal may finish just after the answer
            if not await backend.labelled(SESSION_SANDBOX):
                break
            await asyncio.sleep(0.05)
        assert await backend.labelled(SESSION_SANDBOX) == []
