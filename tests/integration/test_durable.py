"""Durable jobs (docs/durability.md): a service killed with ``kill -9`` resumes its durable jobs when it starts
again, by replaying their call logs in fresh sandboxes; a replay that makes a call its log does not hold ends
``replay_diverged`` without reaching the tool; ``durable: false`` keeps ``lost``. Real engine, a real HTTP tool
server that keeps every call's ``Idempotency-Key``."""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import Service, start_service, stop_clean, wait_until
from tests.toolserver import ToolServer

# Calls in the order of a set of strings: a replay must hash them as the first run did (PYTHONHASHSEED kept).
SCRIPT = """
import time, tools
names = {"alpha", "bravo", "charlie", "delta", "echo"}
order = [name for name in names][:3]
for i, name in enumerate(order):
    print("calling", i, flush=True)
    answer = tools.remember(name=name, i=i)
    print("got", answer["args"]["name"], answer["args"]["i"], flush=True)
    time.sleep(1.5)
print("done")
"""


@pytest.fixture
def durable_service(engine: docker.DockerClient, scratch: Path) -> Iterator[tuple[str, Path]]:
    """An instance id and work dir for a service that the test starts, kills and starts again; at the end no
    container of it may remain."""
    instance, work_dir = f"pytest-durable-{secrets.token_hex(3)}", scratch / f"durable-{secrets.token_hex(3)}"
    yield instance, work_dir
    stop_clean(engine, start_service(instance, work_dir))  # the last start removes what the kills left


def remember_tool(tool_server: ToolServer) -> dict[str, Any]:
    return {
        "name": "remember",
        "parameters": {"properties": {"name": {"type": "string"}, "i": {"type": "integer"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
    }


def calls_seen(tool_server: ToolServer, marker: str) -> list[tuple[dict[str, Any], str | None]]:
    """The tool server's requests whose arguments carry ``marker``, with their ``Idempotency-Key``."""
    seen = []
    for (path, args), headers in zip(tool_server.requests, tool_server.headers, strict=True):
        if path == "/echo" and isinstance(args, dict) and args.get("marker") == marker:
            key = next((value for name, value in headers.items() if name.lower() == "idempotency-key"), None)
            seen.append((args, key))
    return seen


def submit(svc: Service, script: str, tools: list[dict[str, Any]], **body: Any) -> str:
    with svc.client() as api:
        answer = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 0, **body})
        assert answer.status_code in (200, 202), answer.text
        job_id: str = answer.json()["job_id"]
        return job_id


def final_view(svc: Service, job_id: str) -> dict[str, Any]:
    with svc.client(timeout=90) as api:
        view: dict[str, Any] = api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60}).json()
        return view


def with_marker(script: str, marker: str) -> str:
    return script.replace("tools.remember(name=name, i=i)", f"tools.remember(name=name, i=i, marker={marker!r})")


def test_a_durable_job_killed_with_the_service_resumes_and_ends_as_if_never_interrupted(
    durable_service: tuple[str, Path], tool_server: ToolServer
) -> None:
    instance, work_dir = durable_service
    marker = secrets.token_hex(4)
    tool = remember_tool(tool_server)
    tool["parameters"]["properties"]["marker"] = {"type": "string"}
    script = with_marker(SCRIPT, marker)
    first = start_service(instance, work_dir)
    job_id = submit(first, script, [tool])
    wait_until(lambda: len(calls_seen(tool_server, marker)) >= 2, 60)
    time.sleep(0.3)  # the second call's outcome stored, the script asleep before the third
    first.kill()
    again = start_service(instance, work_dir)
    try:
        view = final_view(again, job_id)
        assert view["status"] == "succeeded", view
        names = [args["name"] for args, _ in calls_seen(tool_server, marker)]
        order = list(dict.fromkeys(names))
        expected = "".join(f"calling {i}\ngot {name} {i}\n" for i, name in enumerate(order)) + "done\n"
        assert view["stdout"] == expected and len(order) == 3, (view["stdout"], names)
        assert view["durable"] is True and [r["reason"] for r in view["resumes"]] == ["service_restarted"]
        ids = [call["call_id"] for call in view["calls"]]
        assert [call["status"] for call in view["calls"]] == ["ok"] * 3 and len(set(ids)) == 3
        keys = [key for _, key in calls_seen(tool_server, marker)]
        assert set(keys) == set(ids), (keys, ids)  # every request carried its call's id; a repeat, the same one
        assert len(keys) <= 4
        with again.client() as api:
            output = api.get(f"/jobs/{job_id}/output/stdout")
            assert output.text == expected
    finally:
        again.stop()


def test_a_replay_that_makes_another_call_ends_replay_diverged_and_the_tool_never_sees_it(
    durable_service: tuple[str, Path], tool_server: ToolServer
) -> None:
    instance, work_dir = durable_service
    marker = secrets.token_hex(4)
    tool = {
        "name": "stamp",
        "parameters": {"properties": {"t": {"type": "number"}, "marker": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
    }
    script = f"import time, tools\ntools.stamp(t=time.time(), marker={marker!r})\ntime.sleep(30)\n"
    first = start_service(instance, work_dir)
    job_id = submit(first, script, [tool])
    wait_until(lambda: len(calls_seen(tool_server, marker)) >= 1, 60)
    time.sleep(0.5)
    first.kill()
    again = start_service(instance, work_dir)
    try:
        view = final_view(again, job_id)
        assert view["status"] == "failed" and view["error"]["type"] == "replay_diverged", view
        assert "stamp(" in view["error"]["message"]
        assert len(calls_seen(tool_server, marker)) == 1  # the divergent call never reached the tool
    finally:
        again.stop()


def test_a_job_that_is_not_durable_is_lost_with_the_service(
    durable_service: tuple[str, Path], tool_server: ToolServer
) -> None:
    instance, work_dir = durable_service
    marker = secrets.token_hex(4)
    tool = remember_tool(tool_server)
    tool["parameters"]["properties"]["marker"] = {"type": "string"}
    first = start_service(instance, work_dir)
    job_id = submit(first, with_marker(SCRIPT, marker), [tool], durable=False)
    wait_until(lambda: len(calls_seen(tool_server, marker)) >= 1, 60)
    first.kill()
    again = start_service(instance, work_dir)
    try:
        view = final_view(again, job_id)
        assert view["status"] == "lost" and view["durable"] is False and view["resumes"] == [], view
        assert len(calls_seen(tool_server, marker)) == 1
    finally:
        again.stop()


def test_a_session_script_cannot_be_durable(api: httpx.Client) -> None:
    session = api.post("/sessions", json={}).json()["session_id"]
    try:
        answer = api.post("/execute", json={"script": "print(1)", "session_id": session, "durable": True})
        assert answer.status_code == 422 and "durable" in answer.text
        view = api.post("/execute", json={"script": "print(1)", "session_id": session}).json()
        assert view["status"] == "succeeded" and view["durable"] is False
    finally:
        api.delete(f"/sessions/{session}")


def test_sigterm_drains_then_parks_durable_jobs_and_the_next_start_resumes_them(
    durable_service: tuple[str, Path], tool_server: ToolServer
) -> None:
    instance, work_dir = durable_service
    marker = secrets.token_hex(4)
    tool = remember_tool(tool_server)
    tool["parameters"]["properties"]["marker"] = {"type": "string"}
    first = start_service(instance, work_dir, PTC_DRAIN_S="2", PTC_MAX_CONCURRENT_SANDBOXES="2")
    durable = submit(first, with_marker(SCRIPT, marker), [tool])
    lost = submit(first, "import time\nprint('x', flush=True)\ntime.sleep(60)\n", [], durable=False)
    queued = submit(first, "print('never started before the stop')\n", [])  # both slots are taken
    wait_until(lambda: len(calls_seen(tool_server, marker)) >= 1, 60)
    first.process.terminate()
    with first.client() as api:  # during the drain: no new work, /readyz says why
        refused = api.post("/execute", json={"script": "print(1)"})
        assert refused.status_code == 503 and refused.json()["type"].endswith("/draining"), refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert api.post("/sessions", json={}).status_code == 503
        ready = api.get("/readyz")
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
    assert first.process.wait(30) is not None
    assert "parked" in first.log()
    again = start_service(instance, work_dir)
    try:
        started_later = final_view(again, queued)  # parked before its script started: its first run now
        assert started_later["status"] == "succeeded" and started_later["stdout"] == "never started before the stop\n"
        assert [r["reason"] for r in started_later["resumes"]] == ["drained"]
        gone = final_view(again, lost)
        assert gone["status"] == "lost" and gone["resumes"] == [], gone
        view = final_view(again, durable)
        assert view["status"] == "succeeded", view
        names = list(dict.fromkeys(args["name"] for args, _ in calls_seen(tool_server, marker)))
        expected = "".join(f"calling {i}\ngot {name} {i}\n" for i, name in enumerate(names)) + "done\n"
        assert view["stdout"] == expected and [r["reason"] for r in view["resumes"]] == ["drained"], view
        assert view["parked_at"] is None
        assert view["active_ms"] > 6000, view  # the drained run's time (at least the 2 s drain) and the replay's 4.5 s
        with again.client() as api:
            metrics = api.get("/metrics").text
        assert 'ptc_job_resumes_total{outcome="succeeded",reason="drained"} 2.0' in metrics  # it and the queued one
    finally:
        again.stop()


def test_a_job_waiting_for_a_client_call_when_the_service_died_waits_again_for_the_same_call(
    durable_service: tuple[str, Path],
) -> None:
    instance, work_dir = durable_service
    tools = [
        {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}},
    ]
    script = "import tools\nprint('asking', flush=True)\nprint('answer:', tools.ask(q='deploy?'))\n"
    first = start_service(instance, work_dir)
    job_id = submit(first, script, tools)
    with first.client() as api:
        wait_until(lambda: api.get(f"/jobs/{job_id}").json()["status"] == "waiting", 30)
        [pending] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
    first.kill()
    again = start_service(instance, work_dir)
    try:
        with again.client() as api:
            wait_until(lambda: api.get(f"/jobs/{job_id}").json()["status"] == "waiting", 30)
            [waiting] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
            assert waiting["call_id"] == pending["call_id"] and waiting["args"] == {"q": "deploy?"}
            answered = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "yes"})
            assert answered.status_code == 200, answered.text
        view = final_view(again, job_id)
        assert view["status"] == "succeeded" and view["stdout"] == "asking\nanswer: yes\n", view
        assert [r["reason"] for r in view["resumes"]] == ["service_restarted"]
    finally:
        again.stop()


def test_a_run_spec_this_version_cannot_read_marks_its_job_lost_and_the_service_starts(
    durable_service: tuple[str, Path],
) -> None:
    instance, work_dir = durable_service
    first = start_service(instance, work_dir)
    job_id = submit(first, "import time\nprint('started', flush=True)\ntime.sleep(60)\n", [])
    with first.client() as api:
        wait_until(lambda: api.get(f"/jobs/{job_id}").json()["stdout"] == "started\n", 30)
    first.kill()
    with sqlite3.connect(work_dir / "jobs.sqlite3") as db:
        assert db.execute("UPDATE job_runs SET spec = ? WHERE job_id = ?", (b'{"version": 1}', job_id)).rowcount
    again = start_service(instance, work_dir)
    try:
        view = final_view(again, job_id)
        assert view["status"] == "lost" and view["error"]["type"] == "service_restarted", view
        with sqlite3.connect(work_dir / "jobs.sqlite3") as db:  # nothing of it is kept to resume it
            assert db.execute("SELECT COUNT(*) FROM job_runs WHERE job_id = ?", (job_id,)).fetchone() == (0,)
    finally:
        again.stop()


def test_a_job_whose_owners_key_is_gone_is_not_resumed(durable_service: tuple[str, Path]) -> None:
    instance, work_dir = durable_service
    token = secrets.token_urlsafe(32)
    first = start_service(instance, work_dir, PTC_API_KEYS=f"gone:{hash_token(token)}", PTC_METRICS_KEYS="")
    with httpx.Client(base_url=first.url, headers={"Authorization": f"Bearer {token}"}) as api:
        script = "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
        job_id = api.post("/execute", json={"script": script, "wait_s": 0}).json()["job_id"]
        wait_until(lambda: api.get(f"/jobs/{job_id}").json()["stdout"] == "started\n", 30)
    first.kill()
    again = start_service(instance, work_dir, PTC_ADMIN_KEYS="pytest")  # only the key pytest now
    try:
        view = final_view(again, job_id)
        assert view["status"] == "lost" and "'gone' is no longer configured" in view["error"]["message"], view
    finally:
        again.stop()
