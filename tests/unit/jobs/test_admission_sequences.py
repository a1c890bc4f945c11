"""Admission's counts after hostile sequences of requests, on the whole service over the fake backend: queued
session scripts stopped, a session deleted while scripts wait for its turn, clients that give up (the request
cancelled) while their job waits or while it is admitted. Every place in a queue and every quota unit comes back."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import tempfile
import threading
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from service import normalize
from service.api import create_app
from service.normalize import prepare
from service.sandbox.fake import FakeBackend
from service.settings import Settings


@pytest.fixture
async def app() -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    work_dir = Path(tempfile.mkdtemp(prefix="ptcq", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        auth="disabled",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        max_queue=4,
        quota_queued_jobs=20,
        instance_id="fake-" + work_dir.name,
    )
    backend = FakeBackend()
    application = create_app(settings, backend)
    try:
        async with application.router.lifespan_context(application):
            transport = httpx.ASGITransport(app=application)
            async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as client:
                yield application, client
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def counts(application: FastAPI) -> tuple[int, int, int]:
    """(one-shot jobs admitted, session scripts queued, jobs the quota counts for the anonymous owner)."""
    parts: Any = application.state.jobs._parts
    admission = parts.intake._admission
    owners = admission.quotas._usage
    return admission.admitted, parts.session_manager.queued, sum(usage.jobs for usage in owners.values())


async def settled(application: FastAPI) -> tuple[int, int, int]:
    for _ in range(200):
        if counts(application) == (0, 0, 0):
            break
        await asyncio.sleep(0.05)
    return counts(application)


async def test_stop_delete_and_give_up_leave_no_place_taken(app: tuple[FastAPI, httpx.AsyncClient]) -> None:
    application, client = app
    session = (await client.post("/sessions", json={})).json()["session_id"]
    first = await client.post(
        "/execute", json={"script": "import time\ntime.sleep(30)\n", "session_id": session, "wait_s": 0}
    )
    first_id = first.json()["job_id"]
    queued = []
    for _ in range(3):
        answer = await client.post("/execute", json={"script": "print(1)", "session_id": session, "wait_s": 0})
        assert answer.status_code == 202, answer.text
        queued.append(answer.json()["job_id"])
    assert counts(application) == (0, 3, 4)  # not vacuous: the places are taken now
    assert (await client.post(f"/jobs/{queued[0]}/stop")).json()["status"] == "stopped"
    # a client that gives up while its script waits for the session's turn
    waiting = asyncio.ensure_future(
        client.post("/execute", json={"script": "print(2)", "session_id": session, "wait_s": 30})
    )
    await asyncio.sleep(0.3)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert (await client.delete(f"/sessions/{session}")).status_code == 200
    assert (await client.post(f"/jobs/{first_id}/stop")).status_code == 200
    # one-shot jobs whose clients give up at once, before or after admission
    for delay in (0.0, 0.01, 0.05):
        request = asyncio.ensure_future(client.post("/execute", json={"script": "print(3)", "wait_s": 30}))
        await asyncio.sleep(delay)
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    assert await settled(application) == (0, 0, 0)


async def test_a_client_that_gives_up_while_its_output_files_are_made_leaves_none_open(
    app: tuple[FastAPI, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    application, client = app
    entered, release = threading.Event(), threading.Event()

    def held(script: str, enabled: bool) -> Any:  # the worker thread's normalization, held until released
        entered.set()
        release.wait(10)
        return prepare(script, enabled)

    monkeypatch.setattr(normalize, "prepare", held)  # the container engine's preparation (``Engine.prepare``)
    request = asyncio.ensure_future(client.post("/execute", json={"script": "print(3)", "wait_s": 30}))
    assert await asyncio.to_thread(entered.wait, 10)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        release.set()  # the thread now makes the job's folder and opens its two output files
        output = application.state.settings.work_dir / "output"
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not any(output.iterdir()):
                break
        gc.collect()
    assert not any(output.iterdir())  # before: the folder stayed, its stdout and stderr open until collected
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert await settled(application) == (0, 0, 0)
