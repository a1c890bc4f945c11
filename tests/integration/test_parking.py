"""Parking (docs/durability.md): a durable job whose calls all wait for the harness longer than ``PTC_PARK_AFTER_S``
gives its sandbox and script slot back; an answer, a decision or an expiry resumes it by replay, and it ends as if it
had waited in its sandbox; its ``timeout_s`` does not count the time it was parked; it stays parked across a
restart. Real engine, a real HTTP tool server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.broker.paused import client_answer
from service.jobs.parking import store_answer
from service.store.sqlite import SQLiteJobStore
from service.tenancy import hash_token
from tests.conftest import Service, labelled_containers, start_service, wait_until
from tests.integration.test_javascript import node_images
from tests.toolserver import ToolServer

ASK = {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}}
ASK_SCRIPT = "import tools\nprint('asking', flush=True)\nprint('answer:', tools.ask(q='deploy?'))\n"
GATHER = (
    "import asyncio, tools\n"
    "async def main():\n"
    "    a, b = await asyncio.gather(tools.aio.ask(q='a'), tools.aio.ask(q='b'))\n"
    "    print(a, b)\n"
    "asyncio.run(main())\n"
)
OTHER = secrets.token_urlsafe(32)  # a second key: a parked job is not its to see or answer


@pytest.fixture(scope="module")
def parking(engine: docker.DockerClient, scratch: Path, tool_server: ToolServer) -> Iterator[Service]:
    """A service that parks after 1 s, with one script slot (a parked job must give it back), and a second key."""
    port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    svc = start_service(
        f"pytest-parking-{secrets.token_hex(3)}",
        scratch / "parking",
        PTC_PARK_AFTER_S="1",
        PTC_MAX_CONCURRENT_SANDBOXES="1",
        PTC_WARM_POOL_SIZE="0",
        PTC_EGRESS_ALLOW=f"http://127.0.0.1:{port}",
        PTC_IMAGES=node_images(engine),  # JavaScript jobs park and resume too
    )
    yield svc
    svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


def parked_view(api: httpx.Client, job_id: str, within_s: float = 30) -> dict[str, Any]:
    """The job's view once it is parked."""
    wait_until(lambda: api.get(f"/jobs/{job_id}").json()["parked_at"] is not None, within_s)
    view: dict[str, Any] = api.get(f"/jobs/{job_id}").json()
    return view


def parked_total(api: httpx.Client) -> float:
    """``ptc_jobs_parked_total`` as the service's metrics give it."""
    [line] = [line for line in api.get("/metrics").text.splitlines() if line.startswith("ptc_jobs_parked_total ")]
    return float(line.split()[1])


def ended(api: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job's final view (``wait`` returns at once while the job waits for the harness, parked or not)."""
    views: list[dict[str, Any]] = []

    def at_end() -> bool:
        views.append(api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60}).json())
        return views[-1]["ended_at"] is not None

    wait_until(at_end, 60)
    return views[-1]


def test_a_job_waiting_for_a_client_call_is_parked_and_the_answer_resumes_it(
    parking: Service, engine: docker.DockerClient
) -> None:
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        view = parked_view(api, job_id)
        assert view["status"] == "waiting" and view["stdout"] == "asking\n", view
        [pending] = view["pending_calls"]
        assert pending["awaiting"] == "client" and pending["args"] == {"q": "deploy?"} and pending["expires_at"]
        assert [c["status"] for c in view["calls"]] == ["pending"]
        wait_until(lambda: not labelled_containers(engine, parking.instance_id), 30)  # its sandbox is gone
        # Its script slot is free: with one slot, another job runs to its end while it is parked.
        other = api.post("/execute", json={"script": "print('meanwhile')", "wait_s": 30}).json()
        assert other["status"] == "succeeded" and other["stdout"] == "meanwhile\n", other
        assert parked_total(api) >= 1
        answered = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "yes"})
        assert answered.status_code == 200, answered.text
        again = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "twice"})
        assert again.status_code == 409, again.text  # answered once only
        view = ended(api, job_id)
    assert view["status"] == "succeeded" and view["stdout"] == "asking\nanswer: yes\n", view
    assert [r["reason"] for r in view["resumes"]] == ["answered"] and view["parked_at"] is None
    [record] = view["calls"]
    assert record["call_id"] == pending["call_id"] and record["status"] == "ok" and record["result"] == "yes"


def test_a_javascript_job_is_parked_and_resumed_like_a_python_one(parking: Service) -> None:
    script = """console.log("asking");
const [a, b] = await Promise.all([tools.ask({ q: "a" }), tools.ask({ q: "b" })]);
try {
  await tools.ask({ q: "no" });
} catch (e) {
  console.log(e.type, e.message);
}
console.log("answers:", a, b);
"""
    with parking.client(timeout=90) as api:
        body = {"script": script, "tools": [ASK], "wait_s": 0, "language": "javascript"}
        job_id = api.post("/execute", json=body).json()["job_id"]
        view = parked_view(api, job_id)
        assert view["status"] == "waiting" and view["language"] == "javascript", view
        for pending in view["pending_calls"]:
            answered = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": pending["args"]["q"] * 2})
            assert answered.status_code == 200, answered.text
        wait_until(lambda: len(api.get(f"/jobs/{job_id}").json()["pending_calls"]) == 1, 60)
        [last] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
        refused = api.post(f"/jobs/{job_id}/calls/{last['call_id']}", json={"error": {"type": "nope", "message": "no"}})
        assert refused.status_code == 200, refused.text
        view = ended(api, job_id)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "asking\nnope no\nanswers: aa bb\n", view
    assert [(c["args"]["q"], c["status"]) for c in view["calls"]] == [("a", "ok"), ("b", "ok"), ("no", "error")]


def test_an_approval_given_while_parked_sends_the_call_to_its_endpoint_once(
    parking: Service, tool_server: ToolServer, engine: docker.DockerClient
) -> None:
    marker = secrets.token_hex(6)
    publish = {
        "name": "publish",
        "parameters": {"properties": {"text": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        "approval": "always",
        "approval_timeout_s": 7 * 86400,  # days: a parked job costs only its rows
    }
    script = f"import tools\nprint('published', tools.publish(text={marker!r})['args']['text'])\n"
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [publish], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        assert pending["awaiting"] == "approval"
        seen = [h for (p, a), h in zip(tool_server.requests, tool_server.headers, strict=True) if a == {"text": marker}]
        assert not seen
        wait_until(lambda: not labelled_containers(engine, parking.instance_id), 30)  # its sandbox is gone
        other = api.post("/execute", json={"script": "print('in its slot')", "wait_s": 30}).json()  # one slot
        assert other["status"] == "succeeded", other
        approved = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}/approve", json={"reason": "fine"})
        assert approved.status_code == 200, approved.text
        view = ended(api, job_id)
    assert view["status"] == "succeeded" and view["stdout"] == f"published {marker}\n", (view["error"], view["calls"])
    [record] = view["calls"]
    assert record["approval"]["decision"] == "approved" and record["approval"]["by"] == "pytest"
    assert record["approval"]["at"].endswith("Z"), record["approval"]  # as a live decision's (was "+00:00")
    seen = [h for (p, a), h in zip(tool_server.requests, tool_server.headers, strict=True) if a == {"text": marker}]
    assert len(seen) == 1  # once, under the call's id
    assert {k.lower(): v for k, v in seen[0].items()}["idempotency-key"] == pending["call_id"]


def test_a_denial_while_parked_reaches_the_script(parking: Service) -> None:
    tool = {"name": "drop", "parameters": {}, "endpoint": {"kind": "echo"}, "approval": "always"}
    script = "import tools\ntry:\n    tools.drop()\nexcept tools.ToolError as e:\n    print(e.type, '|', e.message)\n"
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [tool], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        denied = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}/deny", json={"reason": "no"})
        assert denied.status_code == 200, denied.text
        view = ended(api, job_id)
    assert view["status"] == "succeeded" and view["stdout"] == "denied | drop: denied: no\n", view


def test_a_parked_call_that_expires_resumes_its_job_with_the_timeout(parking: Service) -> None:
    ask = {**ASK, "timeout_s": 4}
    script = "import tools\ntry:\n    tools.ask(q='x')\nexcept tools.ToolError as e:\n    print('gave up:', e.type)\n"
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [ask], "wait_s": 0}).json()["job_id"]
        parked_view(api, job_id)
        view = ended(api, job_id)
    assert view["status"] == "succeeded" and view["stdout"] == "gave up: timeout\n", view
    assert [r["reason"] for r in view["resumes"]] == ["expired"]


def test_parked_time_does_not_count_against_the_jobs_timeout(parking: Service) -> None:
    with parking.client(timeout=90) as api:
        body = {"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0, "timeout_s": 6.0}
        job_id = api.post("/execute", json=body).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        time.sleep(7)  # past its timeout_s, parked
        assert api.get(f"/jobs/{job_id}").json()["status"] == "waiting"
        assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "late"}).status_code == 200
        view = ended(api, job_id)
    assert view["status"] == "succeeded" and view["stdout"] == "asking\nanswer: late\n", view
    assert view["active_ms"] < 6000, view


def test_calls_gathered_while_parked_are_answered_one_by_one(parking: Service) -> None:
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": GATHER, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        pending = {c["args"]["q"]: c["call_id"] for c in parked_view(api, job_id)["pending_calls"]}
        assert sorted(pending) == ["a", "b"]
        assert api.post(f"/jobs/{job_id}/calls/{pending['a']}", json={"result": "A"}).status_code == 200
        # Resumed (the other call kept for its replay), or parked again: either way answered under its id at once.
        assert api.post(f"/jobs/{job_id}/calls/{pending['b']}", json={"result": "B"}).status_code == 200
        view = ended(api, job_id)
    assert view["status"] == "succeeded" and view["stdout"] == "A B\n", view


def test_requests_that_come_while_an_answer_resumes_a_parked_job_find_it(parking: Service) -> None:
    """An answer to the other waiting call, or a stop, sent while an answer is resuming the job (before the fix: it
    had left the parked jobs and was not live yet, so the answer got a 409 and the stop did nothing)."""
    with parking.client(timeout=90) as api, concurrent.futures.ThreadPoolExecutor(2) as pool:
        for attempt in range(3):
            job_id = api.post("/execute", json={"script": GATHER, "tools": [ASK], "wait_s": 0}).json()["job_id"]
            pending = {c["args"]["q"]: c["call_id"] for c in parked_view(api, job_id)["pending_calls"]}
            first = pool.submit(api.post, f"/jobs/{job_id}/calls/{pending['a']}", json={"result": "A"})
            time.sleep(0.002 * attempt)
            second = pool.submit(api.post, f"/jobs/{job_id}/calls/{pending['b']}", json={"result": "B"})
            assert (first.result().status_code, second.result().status_code) == (200, 200), second.result().text
            assert ended(api, job_id)["stdout"] == "A B\n"
        for attempt in range(3):
            job_id = api.post("/execute", json={"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0}).json()["job_id"]
            [pending] = parked_view(api, job_id)["pending_calls"]
            answer = pool.submit(api.post, f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "yes"})
            time.sleep(0.002 * attempt)
            stop = pool.submit(api.post, f"/jobs/{job_id}/stop")
            assert stop.result().status_code == 200 and answer.result().status_code in (200, 409)
            view = ended(api, job_id)
            assert view["status"] == "stopped", (attempt, answer.result().status_code, view)


def test_another_key_cannot_see_or_answer_a_parked_job(engine: docker.DockerClient, scratch: Path) -> None:
    mine = secrets.token_urlsafe(32)
    keys = scratch / f"parking-{secrets.token_hex(3)}.keys"
    keys.write_text(f"mine:{hash_token(mine)}\nother:{hash_token(OTHER)}\n")
    svc = start_service(
        f"pytest-parking-keys-{secrets.token_hex(3)}", scratch / f"parking-keys-{secrets.token_hex(3)}",
        PTC_PARK_AFTER_S="1", PTC_WARM_POOL_SIZE="0", PTC_API_KEYS_FILE=str(keys), PTC_API_KEYS=None,
        PTC_METRICS_KEYS=None,
    )  # fmt: skip
    try:
        with (
            httpx.Client(base_url=svc.url, timeout=60, headers={"Authorization": f"Bearer {mine}"}) as me,
            httpx.Client(base_url=svc.url, timeout=60, headers={"Authorization": f"Bearer {OTHER}"}) as other,
        ):
            job_id = me.post("/execute", json={"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0}).json()["job_id"]
            [pending] = parked_view(me, job_id)["pending_calls"]
            assert other.get(f"/jobs/{job_id}").status_code == 404
            stolen = other.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "theirs"})
            assert stolen.status_code == 404, stolen.text
            assert me.post(f"/jobs/{job_id}/calls/call_0000000000000000", json={"result": 1}).status_code == 409
            assert me.post(f"/jobs/{job_id}/calls/{pending['call_id']}/approve").status_code == 409  # a client call
            assert me.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "mine"}).status_code == 200
            view = me.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60}).json()
        assert view["status"] == "succeeded" and view["stdout"] == "asking\nanswer: mine\n", view
    finally:
        svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


@pytest.mark.parametrize("awaiting", ["client", "approval"])
def test_a_parked_job_stays_parked_across_a_restart_and_is_answered_after_it(
    engine: docker.DockerClient, scratch: Path, awaiting: str
) -> None:
    instance, work_dir = f"pytest-parked-restart-{secrets.token_hex(3)}", scratch / f"parked-{secrets.token_hex(3)}"
    first = start_service(instance, work_dir, PTC_PARK_AFTER_S="1", PTC_WARM_POOL_SIZE="0")
    tool = ASK if awaiting == "client" else {**ASK, "endpoint": {"kind": "echo"}, "approval": "always"}
    script = (
        ASK_SCRIPT
        if awaiting == "client"
        else ASK_SCRIPT.replace("tools.ask(q='deploy?')", "tools.ask(q='deploy?')['args']['q']")
    )
    with first.client() as api:
        job_id = api.post("/execute", json={"script": script, "tools": [tool], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        assert pending["awaiting"] == awaiting
    first.stop()
    again = start_service(instance, work_dir, PTC_PARK_AFTER_S="1", PTC_WARM_POOL_SIZE="0")
    try:
        with again.client(timeout=90) as api:
            view = api.get(f"/jobs/{job_id}").json()
            assert view["status"] == "waiting" and view["parked_at"] and view["resumes"] == [], view
            assert not labelled_containers(engine, instance)  # not resumed at the start: it waits, parked
            if awaiting == "client":
                answer = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "after"})
            else:
                answer = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}/approve")
            assert answer.status_code == 200, answer.text
            view = ended(api, job_id)
        said = "after" if awaiting == "client" else "deploy?"
        assert view["status"] == "succeeded" and view["stdout"] == f"asking\nanswer: {said}\n", view
        assert [r["reason"] for r in view["resumes"]] == ["answered"]
    finally:
        again.stop()
    assert not labelled_containers(engine, instance, include_pool=True)


def test_a_stop_while_parked_ends_the_job_stopped_with_its_output(parking: Service) -> None:
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        stopped = api.post(f"/jobs/{job_id}/stop")
        assert stopped.status_code == 200, stopped.text
        view = ended(api, job_id)
        assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": 1}).status_code == 409
    assert view["status"] == "stopped" and view["error"]["message"] == "stopped while parked", view
    assert view["stdout"] == "asking\n" and view["resumes"] == [], view  # not run again
    [record] = view["calls"]  # the call it waited for, kept
    assert record["call_id"] == pending["call_id"] and record["error"]["type"] == "cancelled", record


def test_the_event_stream_follows_a_parked_job_to_its_end(parking: Service) -> None:
    events: list[tuple[str, str]] = []

    def follow(job_id: str) -> None:
        with (
            parking.client(timeout=90) as api,
            api.stream("GET", f"/jobs/{job_id}/events", timeout=90) as response,
        ):
            name = ""
            for line in response.iter_lines():
                if line.startswith("event:"):
                    name = line.partition(":")[2].strip()
                elif line.startswith("data:"):
                    events.append((name, line.partition(":")[2].strip()))
                    if name == "end":
                        return

    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        follower = threading.Thread(target=follow, args=(job_id,))
        follower.start()
        [pending] = parked_view(api, job_id)["pending_calls"]
        time.sleep(2.5)  # followed while parked: no end yet
        assert follower.is_alive() and not [e for e in events if e[0] == "end"], events
        assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "go"}).status_code == 200
        follower.join(60)
    assert not follower.is_alive()
    assert events[-1][0] == "end" and '"status":"succeeded"' in events[-1][1], events[-3:]
    [call] = [json.loads(data) for name, data in events if name == "call"]  # sent once, with its outcome
    assert call["status"] == "ok" and call["result"] == "go", call
    assert "".join(json.loads(data)["text"] for name, data in events if name == "stdout") == "asking\nanswer: go\n"


def test_the_event_stream_follows_a_resumed_job_whose_replay_has_not_made_its_calls_again(parking: Service) -> None:
    """The stream of a parked job, answered while its one script slot is taken: the resumed job is live with no call
    record yet (its replay makes them again). Before the fix the stream failed there (an index past its records)."""
    script = "import tools\nprint('first:', tools.ask(q='1'))\nprint('second:', tools.ask(q='2'))\n"
    events: list[str] = []

    def follow(job_id: str) -> None:
        with parking.client(timeout=90) as api, api.stream("GET", f"/jobs/{job_id}/events", timeout=90) as response:
            for line in response.iter_lines():
                if line.startswith("event:"):
                    events.append(line.partition(":")[2].strip())
                    if events[-1] == "end":
                        return

    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        [first] = parked_view(api, job_id)["pending_calls"]
        assert api.post(f"/jobs/{job_id}/calls/{first['call_id']}", json={"result": 1}).status_code == 200
        wait_until(lambda: [c["args"] for c in parked_view(api, job_id)["pending_calls"]] == [{"q": "2"}], 60)
        [second] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
        follower = threading.Thread(target=follow, args=(job_id,))
        follower.start()
        wait_until(lambda: "call" in events, 30)  # the first call's record, sent while parked
        blocker = api.post("/execute", json={"script": "import time\ntime.sleep(4)", "wait_s": 0, "durable": False})
        wait_until(lambda: api.get(f"/jobs/{blocker.json()['job_id']}").json()["status"] == "running", 30)
        assert api.post(f"/jobs/{job_id}/calls/{second['call_id']}", json={"result": 2}).status_code == 200
        assert api.get(f"/jobs/{job_id}").json()["status"] == "queued"  # live, no record made again yet
        follower.join(60)
    assert not follower.is_alive() and events[-1] == "end", events
    assert events.count("call") == 2, events  # each record once, the replayed one not again


def test_a_parked_jobs_pending_calls_show_in_every_selection_and_odd_answers_are_judged_as_live(
    parking: Service,
) -> None:
    script = (
        "import tools\n"
        "for q in ('nan', 'big'):\n"
        "    try:\n"
        "        print(q, repr(tools.ask(q=q)), flush=True)\n"
        "    except tools.ToolError as e:\n"
        "        print(q, e.type, flush=True)\n"
    )
    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        for query in ({"calls": "summary"}, {"calls": "none"}, {"fields": "status,pending_calls"}):
            listed = api.get(f"/jobs/{job_id}", params=query).json()["pending_calls"]
            assert [c["call_id"] for c in listed] == [pending["call_id"]], (query, listed)
        nan = b'{"result": NaN}'
        headers = {"content-type": "application/json"}
        answered = api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", content=nan, headers=headers)
        assert answered.status_code == 200, answered.text
        wait_until(
            lambda: (
                api.get(f"/jobs/{job_id}").json()["parked_at"] is not None
                and "nan" in api.get(f"/jobs/{job_id}").json()["stdout"]
            ),
            30,
        )
        [big] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
        huge = b'{"result": 123456789012345678901234567890}'
        answered = api.post(f"/jobs/{job_id}/calls/{big['call_id']}", content=huge, headers=headers)
        assert answered.status_code == 200, answered.text
        view = ended(api, job_id)
    assert view["stdout"] == "nan bad_response\nbig 123456789012345678901234567890\n", view


def test_a_keys_parked_places_hold_when_its_jobs_park_at_the_same_instant(
    engine: docker.DockerClient, scratch: Path
) -> None:
    svc = start_service(
        f"pytest-parking-budget-{secrets.token_hex(3)}", scratch / f"parking-budget-{secrets.token_hex(3)}",
        PTC_PARK_AFTER_S="1", PTC_WARM_POOL_SIZE="0", PTC_MAX_PARKED_JOBS="1", PTC_MAX_CONCURRENT_SANDBOXES="3",
    )  # fmt: skip
    try:
        with svc.client(timeout=90) as api:
            at = time.time() + 4
            script = f"import time, tools\ntime.sleep(max({at} - time.time(), 0))\nprint(tools.ask(q='x'))\n"
            ids = [
                api.post("/execute", json={"script": script, "tools": [ASK], "wait_s": 0}).json()["job_id"]
                for _ in range(3)
            ]
            wait_until(lambda: any(api.get(f"/jobs/{j}").json()["parked_at"] for j in ids), 30)
            time.sleep(2)  # the others had their chance to park too
            views = [api.get(f"/jobs/{j}").json() for j in ids]
            assert sum(bool(v["parked_at"]) for v in views) == 1, views  # one place: the others wait in sandboxes
            assert [v["status"] for v in views] == ["waiting"] * 3
            assert len(labelled_containers(engine, svc.instance_id)) == 2
            for job_id, view in zip(ids, views, strict=True):
                answer = api.post(f"/jobs/{job_id}/calls/{view['pending_calls'][0]['call_id']}", json={"result": 1})
                assert answer.status_code == 200, answer.text
            assert [ended(api, j)["stdout"] for j in ids] == ["1\n"] * 3
    finally:
        svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


def test_resumes_of_parked_jobs_are_admitted_within_the_keys_quota(engine: docker.DockerClient, scratch: Path) -> None:
    """One slot and a queue of one: answers to three parked jobs at once admit two (the third gets 429), and
    expiries wait for room instead of crowding the queue."""
    svc = start_service(
        f"pytest-parking-quota-{secrets.token_hex(3)}", scratch / f"parking-quota-{secrets.token_hex(3)}",
        PTC_PARK_AFTER_S="1", PTC_WARM_POOL_SIZE="0", PTC_MAX_CONCURRENT_SANDBOXES="1", PTC_MAX_QUEUE="1",
    )  # fmt: skip
    slow = "import time, tools\nprint(tools.ask(q='x'))\ntime.sleep(2)\n"
    try:
        with svc.client(timeout=90) as api:
            ids = []
            for _ in range(3):  # one at a time: each parks and gives its slot back before the next
                ids.append(api.post("/execute", json={"script": slow, "tools": [ASK], "wait_s": 0}).json()["job_id"])
                parked_view(api, ids[-1])
            calls = [api.get(f"/jobs/{j}").json()["pending_calls"][0]["call_id"] for j in ids]
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                codes = list(
                    pool.map(
                        lambda jc: api.post(f"/jobs/{jc[0]}/calls/{jc[1]}", json={"result": 1}).status_code,
                        zip(ids, calls, strict=True),
                    )
                )
            assert sorted(codes) == [200, 200, 429], codes
            refused = ids[codes.index(429)]
            wait_until(
                lambda: (
                    api.post(f"/jobs/{refused}/calls/{calls[codes.index(429)]}", json={"result": 1}).status_code == 200
                ),
                60,
            )
            assert [ended(api, j)["status"] for j in ids] == ["succeeded"] * 3
    finally:
        svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


def test_an_answer_kept_for_a_call_not_yet_made_again_survives_a_crash(
    engine: docker.DockerClient, scratch: Path
) -> None:
    instance, work_dir = f"pytest-parked-early-{secrets.token_hex(3)}", scratch / f"early-{secrets.token_hex(3)}"
    env = {"PTC_PARK_AFTER_S": "1", "PTC_WARM_POOL_SIZE": "0", "PTC_MAX_CONCURRENT_SANDBOXES": "1"}
    script = (
        "import asyncio, tools\n"
        "async def main():\n"
        "    print(*await asyncio.gather(tools.aio.ask(q='a'), tools.aio.ask(q='b')))\n"
        "asyncio.run(main())\n"
    )
    first = start_service(instance, work_dir, **env)
    with first.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        pending = {c["args"]["q"]: c["call_id"] for c in parked_view(api, job_id)["pending_calls"]}
        blocker = api.post("/execute", json={"script": "import time\ntime.sleep(60)", "wait_s": 0, "durable": False})
        wait_until(lambda: api.get(f"/jobs/{blocker.json()['job_id']}").json()["status"] == "running", 30)
        assert api.post(f"/jobs/{job_id}/calls/{pending['a']}", json={"result": "A"}).status_code == 200
        assert api.get(f"/jobs/{job_id}").json()["status"] == "queued"  # resumed, waiting for the one slot
        assert api.post(f"/jobs/{job_id}/calls/{pending['b']}", json={"result": "B"}).status_code == 200  # early
    first.kill()
    again = start_service(instance, work_dir, **env)
    try:
        with again.client(timeout=90) as api:
            view = ended(api, job_id)
        assert view["status"] == "succeeded" and view["stdout"] == "A B\n", view
    finally:
        again.stop()
    assert not labelled_containers(engine, instance, include_pool=True)


def test_a_replay_that_no_longer_makes_the_answered_call_ends_replay_diverged(parking: Service) -> None:
    with parking.client(timeout=90) as api:
        until = time.time() + 3
        script = f"import time, tools\nif time.time() < {until}:\n    print(tools.ask(q='now?'))\nprint('end')\n"
        job_id = api.post("/execute", json={"script": script, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
        time.sleep(max(until - time.time(), 0) + 0.5)  # its replay takes the other branch
        assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "yes"}).status_code == 200
        view = ended(api, job_id)
    assert view["status"] == "failed" and view["error"]["type"] == "replay_diverged", view
    assert "not made again" in view["error"]["message"]


def test_an_answer_stored_before_the_service_died_resumes_its_job_at_the_next_start(
    engine: docker.DockerClient, scratch: Path
) -> None:
    """The service stopped after storing an answer to a parked job and before its resume saved it (here: the answer is
    written to the stopped service's store): the next start resumes the job with it (before the fix it was held
    parked again, and its expiry replaced the answer with a timeout)."""
    instance, work_dir = f"pytest-parked-stored-{secrets.token_hex(3)}", scratch / f"stored-{secrets.token_hex(3)}"
    env = {"PTC_PARK_AFTER_S": "1", "PTC_WARM_POOL_SIZE": "0"}
    first = start_service(instance, work_dir, **env)
    with first.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": ASK_SCRIPT, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        [pending] = parked_view(api, job_id)["pending_calls"]
    first.stop()

    async def answer() -> bool:
        store = SQLiteJobStore(work_dir / "jobs.sqlite3")
        await store.open()
        try:
            return await store_answer(store, job_id, pending["call_id"], client_answer(True, "stored"))
        finally:
            await store.close()

    assert asyncio.run(answer())
    again = start_service(instance, work_dir, **env)
    try:
        with again.client(timeout=90) as api:
            view = ended(api, job_id)
        assert view["status"] == "succeeded" and view["stdout"] == "asking\nanswer: stored\n", view
        assert [r["reason"] for r in view["resumes"]] == ["answered"], view["resumes"]
    finally:
        again.stop()
    assert not labelled_containers(engine, instance, include_pool=True)


def test_resumes_give_back_what_the_runs_before_kept_of_the_owners_output_budget(
    engine: docker.DockerClient, scratch: Path
) -> None:
    """Each resume keeps the replayed call records again: what the parked run kept is given back (before the fix it
    stayed taken, and a key whose jobs parked a few times was refused for ``output_bytes`` until a restart)."""
    echo = {"name": "echo", "parameters": {"properties": {"blob": {"type": "string"}}}, "endpoint": {"kind": "echo"}}
    script = "import tools\ntools.echo(blob='x' * 300_000)\nfor i in range(3):\n    print(tools.ask(q=str(i)))\n"
    instance = f"pytest-parked-budget-{secrets.token_hex(3)}"
    svc = start_service(
        instance, scratch / instance, PTC_PARK_AFTER_S="1", PTC_WARM_POOL_SIZE="0", PTC_QUOTA_OUTPUT_BYTES="1500000"
    )
    try:
        with svc.client(timeout=90) as api:
            job_id = api.post("/execute", json={"script": script, "tools": [echo, ASK], "wait_s": 0}).json()["job_id"]
            for i in range(3):

                def parked_on(i: int = i) -> bool:  # the i-th call, once parked again
                    view = api.get(f"/jobs/{job_id}").json()
                    return bool(view["parked_at"]) and [c["args"] for c in view["pending_calls"]] == [{"q": str(i)}]

                wait_until(parked_on, 60)
                [pending] = api.get(f"/jobs/{job_id}").json()["pending_calls"]
                assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": i}).status_code == 200
            view = ended(api, job_id)
            assert view["status"] == "succeeded" and len(view["resumes"]) == 3, view
            after = api.post("/execute", json={"script": "print(1)", "wait_s": 30})
            assert after.status_code == 200, after.text  # 600 kB of records kept once, not four times
            # A job stopped while parked keeps its records in the store: they count once it has ended (before the
            # fix nothing counted them, and a key kept any amount of records by stopping its parked jobs).
            stopping = "import tools\ntools.echo(blob='x' * 300_000)\nprint(tools.ask(q='go?'))\n"
            kept = []
            for _ in range(2):
                body = {"script": stopping, "tools": [echo, ASK], "wait_s": 0}
                stopped_id = api.post("/execute", json=body).json()["job_id"]
                parked_view(api, stopped_id)
                assert api.post(f"/jobs/{stopped_id}/stop").json()["status"] == "stopped"
                kept.append(api.get(f"/jobs/{stopped_id}").json()["calls"][0]["args_dropped_bytes"] is None)
            assert kept == [True, False], kept  # 0.6 + 0.6 MB counted: past 1.5 MB the next job's records are dropped
    finally:
        svc.stop()
    assert not labelled_containers(engine, instance, include_pool=True)


def test_a_call_that_times_out_as_its_job_is_parked_is_answered_by_its_timeout(parking: Service) -> None:
    """A client call whose timeout_s falls just after PTC_PARK_AFTER_S times out while its job is being parked: the
    job is parked with that call, which expires at once, and it ends with the timeout (before the fix it was parked
    waiting for nothing: never resumed, not stoppable, outside every bound, until a restart)."""
    with parking.client(timeout=90) as api:
        for timeout_s in (1.001, 1.003, 1.005):
            tool = {**ASK, "timeout_s": timeout_s}
            script = "import tools\ntry:\n    tools.ask(q='x')\nexcept tools.ToolError as exc:\n    print(exc.type)\n"
            job_id = api.post("/execute", json={"script": script, "tools": [tool], "wait_s": 0}).json()["job_id"]
            view = ended(api, job_id)
            assert view["status"] == "succeeded" and view["stdout"] == "timeout\n", (timeout_s, view)


def test_the_event_stream_sends_each_record_once_when_a_replay_makes_calls_in_another_order(
    parking: Service,
) -> None:
    """The first run makes ask (pending) then echo (sent); the replay makes echo, then ask: each record is sent once
    (before the fix the stream went by place: echo twice, ask never)."""
    until = time.time() + 4
    script = (
        "import asyncio, time, tools\n"
        f"FIRST = time.time() < {until}\n"
        "async def ask():\n"
        "    if not FIRST: await asyncio.sleep(0.5)\n"
        "    return await tools.aio.ask(q='a')\n"
        "async def echo():\n"
        "    if FIRST: await asyncio.sleep(0.5)\n"
        "    return (await tools.aio.echo(blob='e'))['args']['blob']\n"
        "async def main():\n"
        "    print(*await asyncio.gather(ask(), echo()))\n"
        "asyncio.run(main())\n"
    )
    echo = {"name": "echo", "parameters": {"properties": {"blob": {"type": "string"}}}, "endpoint": {"kind": "echo"}}
    sent: list[str] = []

    def follow(job_id: str) -> None:
        with parking.client(timeout=90) as api, api.stream("GET", f"/jobs/{job_id}/events", timeout=90) as response:
            name = ""
            for line in response.iter_lines():
                if line.startswith("event:"):
                    name = line.partition(":")[2].strip()
                elif line.startswith("data:") and name == "call":
                    sent.append(json.loads(line.partition(":")[2])["tool"])
                elif name == "end":
                    return

    with parking.client(timeout=90) as api:
        job_id = api.post("/execute", json={"script": script, "tools": [ASK, echo], "wait_s": 0}).json()["job_id"]
        follower = threading.Thread(target=follow, args=(job_id,))
        follower.start()
        [pending] = parked_view(api, job_id)["pending_calls"]
        assert [c["tool"] for c in api.get(f"/jobs/{job_id}").json()["calls"]] == ["ask", "echo"]
        time.sleep(max(until - time.time(), 0) + 0.5)
        assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": "A"}).status_code == 200
        follower.join(60)
        final = ended(api, job_id)
    assert final["status"] == "succeeded" and final["stdout"] == "A e\n", final
    assert [c["tool"] for c in final["calls"]] == ["echo", "ask"]  # made again in the other order
    assert sorted(sent) == ["ask", "echo"], sent


def test_an_approved_call_whose_service_dies_during_its_request_is_not_asked_again(
    engine: docker.DockerClient, scratch: Path, tool_server: ToolServer
) -> None:
    """The approval stored for a parked job stays in its log until the call's outcome replaces it: the service dying
    while the approved call is at its endpoint does not make the next start ask for an approval again (before the
    fix the replay wrote the call's bare intent over the stored approval)."""
    marker = secrets.token_hex(6)
    port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    publish = {
        "name": "publish",
        "parameters": {"properties": {"text": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("hang")},
        "approval": "always",
        "timeout_s": 60,
    }
    script = f"import tools\nprint('published', tools.publish(text={marker!r}))\n"
    instance = f"pytest-parked-approved-{secrets.token_hex(3)}"
    env = {"PTC_PARK_AFTER_S": "1", "PTC_WARM_POOL_SIZE": "0", "PTC_EGRESS_ALLOW": f"http://127.0.0.1:{port}"}
    first = start_service(instance, scratch / instance, **env)
    try:
        with first.client(timeout=90) as api:
            job_id = api.post("/execute", json={"script": script, "tools": [publish], "wait_s": 0}).json()["job_id"]
            [pending] = parked_view(api, job_id)["pending_calls"]
            assert api.post(f"/jobs/{job_id}/calls/{pending['call_id']}/approve").status_code == 200
            wait_until(lambda: any(args == {"text": marker} for _, args in tool_server.requests), 60)
    finally:
        first.kill()
    again = start_service(instance, scratch / instance, **env)
    try:
        with again.client(timeout=90) as api:
            wait_until(lambda: [args for _, args in tool_server.requests].count({"text": marker}) == 2, 60)
            view = api.get(f"/jobs/{job_id}").json()
            assert view["pending_calls"] == [] and view["resumes"][-1]["reason"] == "service_restarted", view
            assert api.post(f"/jobs/{job_id}/stop").status_code == 200
    finally:
        again.stop()
    assert not labelled_containers(engine, instance, include_pool=True)
