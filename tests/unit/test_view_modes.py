"""Views a harness can hand to a model, on the whole service with the fake backend (no engine): ``calls=summary``
and ``calls=none`` carry no argument or result bytes (asserted on the raw bytes, with marker strings), the full
view is unchanged, ``fields=`` selects top-level fields (unknown ones: 422 before anything runs), the event
stream follows the selection, and ``201``/``202`` carry ``Location``.

Resuming the event stream by ``Last-Event-ID`` (ids, cursor checks, reconnects mid-job and after the end) is in
``tests/unit/jobs/test_resume.py``; against the real engine in ``tests/integration/test_resumable_events.py``."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.composition.job_manager import JobManager
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.views.render import SUMMARY_FIELDS, SUMMARY_MESSAGE_CHARS, VIEW_FIELDS

TOOLS = [
    {"name": "echo", "parameters": {"properties": {"text": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
    {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}},
]
ARG = "ARGMARK"  # in every call's arguments (and so in the echo tool's results)
RESULT = "RESMARK"  # in the client's answers only
SCRIPT = f"""
import asyncio
import tools
print("start", flush=True)
for i in range(3):
    tools.echo(text="{ARG}-echo-" + str(i))
answers = await asyncio.gather(*(tools.aio.ask(q="{ARG}-ask-" + str(i)) for i in range(3)))
for i in range(40):
    print("line", i, "\\u00e9" * i)
print(len(answers))
"""


@contextlib.asynccontextmanager
async def fake_service() -> AsyncIterator[FastAPI]:
    """The service on the fake backend, started (authentication disabled), in a scratch work dir."""
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    settings = Settings(work_dir=work_dir, auth="disabled", sandbox_folders_tmpfs_mb=0, warm_pool_size=0)
    application = create_app(settings, FakeBackend())
    try:
        async with application.router.lifespan_context(application):
            yield application
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


@pytest.fixture
async def app() -> AsyncIterator[FastAPI]:
    async with fake_service() as application:
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as c:
        yield c


async def wait_for_pending(client: httpx.AsyncClient, job_id: str, count: int) -> list[dict[str, Any]]:
    for _ in range(600):
        view = (await client.get(f"/jobs/{job_id}", params={"calls": "none"})).json()
        if len(view["pending_calls"]) == count:
            pending: list[dict[str, Any]] = view["pending_calls"]
            return pending
        assert view["status"] in ("queued", "running", "waiting"), view
        await asyncio.sleep(0.05)
    raise AssertionError("the client calls never all waited")


async def run_job(client: httpx.AsyncClient, order: tuple[int, ...] = (2, 0, 1)) -> dict[str, Any]:
    """Submit SCRIPT, answer its three client calls in ``order`` (so they end out of order), wait for the end."""
    answer = await client.post("/execute", json={"script": SCRIPT, "tools": TOOLS, "wait_s": 0})
    assert answer.status_code == 202, answer.text
    job_id = answer.json()["job_id"]
    pending = await wait_for_pending(client, job_id, 3)
    by_arg = {call["args"]["q"]: call["call_id"] for call in pending}
    for i in order:
        call_id = by_arg[f"{ARG}-ask-{i}"]
        done = await client.post(f"/jobs/{job_id}/calls/{call_id}", json={"result": f"{RESULT}-{i}"})
        assert done.status_code == 200, done.text
    final: dict[str, Any] = (await client.post(f"/jobs/{job_id}/wait", params={"timeout_s": 30})).json()
    assert final["status"] == "succeeded", final
    return final


async def test_summary_and_none_carry_no_argument_or_result_bytes(client: httpx.AsyncClient) -> None:
    final = await run_job(client)
    job_id = final["job_id"]
    full = (await client.get(f"/jobs/{job_id}")).content
    assert ARG.encode() in full and RESULT.encode() in full  # the markers are there to be left out
    assert (await client.get(f"/jobs/{job_id}", params={"calls": "full"})).content == full
    assert (await client.post(f"/jobs/{job_id}/wait", params={"calls": "full"})).content == full
    for mode in ("summary", "none"):
        for answer in (
            await client.get(f"/jobs/{job_id}", params={"calls": mode}),
            await client.post(f"/jobs/{job_id}/wait", params={"calls": mode}),
            await client.get(f"/jobs/{job_id}", params={"calls": mode, "stdout_offset": 3}),
            await client.get(f"/jobs/{job_id}", params={"calls": mode, "fields": "calls,calls_total"}),
        ):
            assert answer.status_code == 200, answer.text
            assert ARG.encode() not in answer.content and RESULT.encode() not in answer.content, mode
            assert b"_dropped_bytes" not in answer.content
        view = (await client.get(f"/jobs/{job_id}", params={"calls": mode})).json()
        assert view["calls_total"] == 6 and view["calls_by_status"] == {"ok": 6}
        assert view["stdout"] == final["stdout"] and view["pending_calls"] == []
        if mode == "none":
            assert "calls" not in view
        else:
            assert [list(call) for call in view["calls"]] == [list(SUMMARY_FIELDS)] * 6
            assert [call["seq"] for call in view["calls"]] == [1, 2, 3, 4, 5, 6]
            expected = [{name: call[name] for name in SUMMARY_FIELDS} for call in final["calls"]]
            assert view["calls"] == expected
        assert {name: value for name, value in view.items() if name != "calls"} == {
            name: value for name, value in final.items() if name != "calls"
        }


async def test_a_summary_of_a_view_read_back_from_the_store_decodes_the_same(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    final = await run_job(client)
    job_id = final["job_id"]
    cached = (await client.get(f"/jobs/{job_id}", params={"calls": "summary"})).content
    full = (await client.get(f"/jobs/{job_id}")).content
    jobs: JobManager = app.state.jobs
    jobs.views._views.drop(job_id)  # the view cache forgets it: read back from the store
    assert (await client.get(f"/jobs/{job_id}")).content == full
    assert (await client.get(f"/jobs/{job_id}", params={"calls": "summary"})).content == cached


async def test_a_live_view_under_summary_keeps_the_pending_calls_a_harness_must_answer(
    client: httpx.AsyncClient,
) -> None:
    answer = await client.post("/execute", json={"script": SCRIPT, "tools": TOOLS, "wait_s": 0})
    job_id = answer.json()["job_id"]
    assert answer.headers["location"] == f"/jobs/{job_id}"
    await wait_for_pending(client, job_id, 3)
    for mode in ("summary", "none"):
        raw = (await client.get(f"/jobs/{job_id}", params={"calls": mode})).content
        view = orjson.loads(raw)
        assert view["status"] == "waiting"
        assert sorted(call["args"]["q"] for call in view["pending_calls"]) == [f"{ARG}-ask-{i}" for i in range(3)]
        assert raw.count(ARG.encode()) == 3  # only the pending calls' arguments, nothing of the ended calls
        if mode == "summary":
            assert [call["status"] for call in view["calls"]] == ["ok"] * 3 + ["pending"] * 3
    view = (await client.get(f"/jobs/{job_id}", params={"calls": "summary", "fields": "status"})).json()
    assert view == {"job_id": job_id, "status": "waiting"}  # fields= may leave pending_calls out
    for call in (await client.get(f"/jobs/{job_id}")).json()["pending_calls"]:
        await client.post(f"/jobs/{job_id}/calls/{call['call_id']}", json={"result": 1}, params={"calls": "none"})
    assert (await client.post(f"/jobs/{job_id}/wait", params={"fields": "exit_code"})).json() == {
        "job_id": job_id,
        "status": "succeeded",
        "exit_code": 0,
    }


async def test_execute_with_a_selection_answers_it(client: httpx.AsyncClient) -> None:
    script = f"import tools\nprint(tools.echo(text='{ARG}'))"
    answer = await client.post("/execute", params={"calls": "summary"}, json={"script": script, "tools": TOOLS})
    assert answer.status_code == 200 and "location" not in answer.headers
    assert answer.content.count(ARG.encode()) == 1  # in stdout (the script printed it), not in a call record
    view = answer.json()
    assert view["calls"][0]["tool"] == "echo" and ARG in view["stdout"]
    answer = await client.post(
        "/execute", params={"fields": "stdout,exit_code", "calls": "full"}, json={"script": "print(7)"}
    )
    assert list(answer.json()) == ["job_id", "status", "exit_code", "stdout"]  # the view's own order


async def test_a_summary_cuts_a_refusals_message_that_quotes_the_argument(client: httpx.AsyncClient) -> None:
    # A refused call's message quotes the value it refused (up to 2,000 characters): the summary keeps its start.
    tools = [{"name": "n", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]
    script = (
        "import tools\ntry:\n    tools.n(x='" + ARG + "-" + "y" * 3000 + "')\nexcept tools.ToolError as e:\n    pass\n"
    )
    full = await client.post("/execute", json={"script": script, "tools": tools})
    message = full.json()["calls"][0]["error"]["message"]
    assert len(message) > 1000 and "y" * 1000 in message  # the full record's message quotes the argument
    summary = await client.post("/execute", params={"calls": "summary"}, json={"script": script, "tools": tools})
    error = summary.json()["calls"][0]["error"]
    assert error["type"] == full.json()["calls"][0]["error"]["type"]
    assert error["message"] == message[:SUMMARY_MESSAGE_CHARS] + "…"
    assert len(summary.content) < 2000 + len(full.json()["stdout"]) + len(full.json()["stderr"]) * 2


async def test_unknown_fields_are_a_problem_naming_the_allowed_ones_and_nothing_runs(
    client: httpx.AsyncClient,
) -> None:
    answer = await client.post("/execute", params={"fields": "stdout,argz"}, json={"script": "print(1)"})
    assert answer.status_code == 422
    problem = answer.json()
    assert answer.headers["content-type"] == "application/problem+json"
    assert problem["errors"][0]["loc"] == ["query", "fields"]
    assert "argz" in problem["detail"] and all(name in problem["detail"] for name in VIEW_FIELDS)
    assert (await client.get("/jobs")).json()["jobs"] == []  # refused before the job was made
    answer = await client.get("/jobs/job_0", params={"calls": "some"})
    assert answer.status_code == 422 and answer.json()["errors"][0]["loc"] == ["query", "calls"]


async def test_the_event_stream_follows_the_selection(client: httpx.AsyncClient) -> None:
    final = await run_job(client)
    job_id = final["job_id"]
    streams = {}
    for mode in ("full", "summary", "none"):
        answer = await client.get(f"/jobs/{job_id}/events", params={"calls": mode})
        assert answer.status_code == 200
        streams[mode] = answer.content
        events = parse_sse(answer.content)
        calls = [data for event, data, _ in events if event == "call"]
        assert len(calls) == (0 if mode == "none" else 6)
        end = orjson.loads(events[-1][1])
        assert events[-1][0] == "end" and end["status"] == "succeeded"
        if mode == "summary":
            assert all(list(orjson.loads(call)) == list(SUMMARY_FIELDS) for call in calls)
        if mode != "full":
            assert ARG.encode() not in answer.content and RESULT.encode() not in answer.content
    assert ARG.encode() in streams["full"] and RESULT.encode() in streams["full"]
    full_end = parse_sse(streams["full"])[-1][1]
    assert full_end == (await client.get(f"/jobs/{job_id}")).content  # the end event's view: the stored one
    answer = await client.get(f"/jobs/{job_id}/events", params={"fields": "exit_code"})
    assert orjson.loads(parse_sse(answer.content)[-1][1]) == {"job_id": job_id, "status": "succeeded", "exit_code": 0}


def parse_sse(raw: bytes) -> list[tuple[str, bytes, str]]:
    """(event, data, id) of each event of a raw ``text/event-stream`` body (comments skipped)."""
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        fields: dict[bytes, bytes] = {}
        for line in block.split(b"\n"):
            name, _, value = line.partition(b": ")
            if name in (b"event", b"data", b"id"):
                fields[name] = value
        if b"data" in fields:
            events.append((fields.get(b"event", b"message").decode(), fields[b"data"], fields.get(b"id", b"").decode()))
    return events


async def test_201_and_202_carry_the_resource_location(client: httpx.AsyncClient) -> None:
    created = await client.post("/sessions", json={})
    assert created.status_code == 201, created.text
    location = created.headers["location"]
    assert location == f"/sessions/{created.json()['session_id']}"
    assert (await client.get(location)).json()["session_id"] == created.json()["session_id"]
    accepted = await client.post("/execute", json={"script": "import time\ntime.sleep(30)", "wait_s": 0})
    assert accepted.status_code == 202
    location = accepted.headers["location"]
    assert location == f"/jobs/{accepted.json()['job_id']}"
    assert (await client.post(f"{location}/stop")).json()["status"] == "stopped"
    assert (await client.delete(f"/sessions/{created.json()['session_id']}")).status_code == 200
