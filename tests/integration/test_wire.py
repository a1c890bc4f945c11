"""What crosses the broker socket keeps its exact meaning, and every job view can be served (issue 12, items 5-6).

Item 6: integers of any size cross exactly, from the script to the record and the endpoint and back; nothing
is rounded. Item 5: whatever a script writes to the socket itself (not JSON, NaN, infinities, lone surrogates,
integers past 64 bits, deep nesting, wrong types, unknown fields and tools) is refused or recorded within
bounds, and the view stays servable and self-consistent. Property tests drive a real ``Broker`` over a real
unix socket in-process (many examples) and real sandboxes through the service (a few, one session reused).
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from service.schemas.job_models import JobList, JobView
from tests.conftest import execute, labelled_containers, start_service, wait_until
from tests.toolserver import BIG_RESULT, ToolServer
from tests.unit.test_wire import (  # noqa: F401
    ARGS,
    BIG,
    ECHO_ANY,
    IDS,
    LEAVES,
    LINES,
    REPORTS,
    REQUESTS,
    TOOL_NAMES,
    TYPED,
    VALUES,
    consistent,
    encoded,
    nest,
    same,
)


def test_big_integers_cross_exactly_to_the_record_and_back(api: httpx.Client) -> None:
    script = (
        "import tools\n"
        f"for x in {BIG!r}:\n"
        "    r = tools.echo_any(x=x)['args']['x']\n"
        "    print(type(r).__name__, r == x, r)\n"
        "try:\n    tools.echo_any(x=10**5000)\nexcept tools.ToolError as e:\n    print(e.type, 'digits' in e.message)\n"
    )
    view = execute(api, script, [ECHO_ANY], timeout_s=30)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "".join(f"int True {x}\n" for x in BIG) + "invalid_arguments True\n"
    assert len(view["calls"]) == len(BIG)  # past 4,300 digits the stub refuses before sending
    for record, x in zip(view["calls"], BIG, strict=True):
        assert same(record["args"], {"x": x}) and same(record["result"]["args"], {"x": x})
    stored = api.get(f"/jobs/{view['job_id']}")
    assert stored.status_code == 200
    assert same(stored.json()["calls"], view["calls"])  # stdlib json in httpx: exact
    assert JobView.model_validate_json(stored.content).calls_total == len(BIG)


def test_big_integers_reach_an_http_tool_exactly_and_come_back(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        {
            "name": "echo_http",
            "parameters": {"properties": {"x": {}}},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        },
        {"name": "big", "endpoint": {"kind": "http", "url": tool_server.url("big")}},
    ]
    script = (
        "import tools\n"
        f"xs = {BIG!r}\n"
        "back = tools.echo_http(x=xs)['args']['x']\n"
        "print(back == xs and all(type(v) is int for v in back))\n"
        "print(repr(tools.big()))\n"
    )
    before = len(tool_server.requests)
    view = execute(api, script, tools, timeout_s=30)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == f"True\n{BIG_RESULT!r}\n"
    received = [args for path, args in tool_server.requests[before:] if path == "/echo"]
    assert len(received) == 1 and same(received[0], {"x": BIG})  # the endpoint got the integers, not floats
    assert same(view["calls"][0]["result"], {"args": {"x": BIG}})
    assert same(view["calls"][1]["result"], BIG_RESULT)


def test_a_client_executed_call_carries_big_integers_both_ways(api: httpx.Client) -> None:
    tools = [{"name": "ask", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "client"}}]
    script = "import tools\nr = tools.ask(x=2**70)\nprint(type(r['n']).__name__, r['n'] == -(2**80) - 1)\n"
    response = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 20, "timeout_s": 30})
    view = response.json()
    assert view["status"] == "waiting", view
    (pending,) = view["pending_calls"]
    assert same(pending["args"], {"x": 2**70})
    answered = api.post(f"/jobs/{view['job_id']}/calls/{pending['call_id']}", json={"result": {"n": -(2**80) - 1}})
    assert answered.status_code == 200, answered.text
    final = api.post(f"/jobs/{view['job_id']}/wait", params={"timeout_s": 20}).json()
    assert (final["status"], final["stdout"]) == ("succeeded", "int True\n")
    assert same(final["calls"][0]["result"], {"n": -(2**80) - 1})


def test_a_client_answer_with_nan_is_refused_not_rounded(api: httpx.Client) -> None:
    tools = [{"name": "ask", "endpoint": {"kind": "client"}}]
    script = "import tools\ntry:\n    tools.ask()\nexcept tools.ToolError as e:\n    print(e.type)\n"
    view = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 20, "timeout_s": 30}).json()
    (pending,) = view["pending_calls"]
    content = b'{"result": {"x": NaN}}'  # the API's JSON reader lets NaN through
    answered = api.post(
        f"/jobs/{view['job_id']}/calls/{pending['call_id']}",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert answered.status_code in (200, 422), answered.text
    if answered.status_code == 200:
        final = api.post(f"/jobs/{view['job_id']}/wait", params={"timeout_s": 20}).json()
        assert (final["status"], final["stdout"]) == ("succeeded", "bad_response\n")
        assert final["calls"][0]["result"] is None
    assert api.get(f"/jobs/{view['job_id']}").status_code == 200


ISSUE_SCRIPT = (
    "from ptc_runtime.client import client\nd = {}\nfor _ in range(300):\n    d = {'a': d}\ntry:\n"
    "    client().request({'tool': 'no_such_tool', 'args': d}, timeout=10)\nexcept Exception as e:\n"
    "    print(type(e).__name__)\nprint('after')\n"
)


def check_served(api: httpx.Client, job_id: str) -> dict[str, Any]:
    """GET /jobs/{id} and GET /jobs answer 200 with bodies valid for the schema, and the view agrees with itself."""
    response = api.get(f"/jobs/{job_id}")
    assert response.status_code == 200, response.text
    model = JobView.model_validate_json(response.content)
    view: dict[str, Any] = response.json()
    consistent(view)
    assert model.calls_total == len(model.calls)
    listing = api.get("/jobs", params={"limit": 5})
    assert listing.status_code == 200, listing.text
    JobList.model_validate_json(listing.content)
    return view


def test_the_issue_input_a_deep_argument_to_an_unknown_tool(api: httpx.Client) -> None:
    view = execute(api, ISSUE_SCRIPT, timeout_s=30)
    assert view["status"] == "succeeded", view
    assert view["stdout"].endswith("after\n")
    (record,) = view["calls"]
    assert (record["status"], record["args"]) == ("rejected", None)
    assert record["error"]["type"] == "unknown_tool"
    assert check_served(api, view["job_id"]) == view


@pytest.fixture(scope="module")
def session_id(api: httpx.Client) -> Iterator[str]:
    tools = [ECHO_ANY, {**TYPED, "endpoint": {"kind": "echo"}}]
    response = api.post("/sessions", json={"tools": tools})
    assert response.status_code == 201, response.text
    sid: str = response.json()["session_id"]
    yield sid
    api.delete(f"/sessions/{sid}")


SANDBOX_SCRIPT = """\
import os, socket
lines = {lines!r}
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
s.connect(os.environ.get("PTC_TOOLS_SOCKET", "/run/ptc/tools.sock"))
s.sendall(b"".join(line + b"\\n" for line in lines))
replies = s.makefile("rb")
for _ in range({expected}):
    replies.readline()
print("after")
"""


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=LINES)
def test_whatever_a_sandboxed_script_sends_its_view_is_served(
    lines: list[bytes], api: httpx.Client, session_id: str
) -> None:
    script = SANDBOX_SCRIPT.format(lines=lines, expected=sum(1 for line in lines if line.strip()))
    view = execute(api, script, session_id=session_id, timeout_s=30)
    assert view["status"] == "succeeded", view
    assert view["stdout"].endswith("after\n")
    assert check_served(api, view["job_id"]) == view


def test_a_job_lost_to_a_restart_keeps_exact_values_and_consistent_totals(
    engine: docker.DockerClient, scratch: Path
) -> None:
    instance = f"pytest-wire-{secrets.token_hex(4)}"
    tools = [ECHO_ANY, {"name": "ask", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "client"}}]
    script = "import tools\ntools.echo_any(x=2**70)\ntools.ask(x=-(2**70))\n"
    first = start_service(instance, scratch / "wire-lost", PTC_WARM_POOL_SIZE="0")
    with first.client() as api:
        job = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 20, "durable": False}).json()
        assert job["status"] == "waiting", job
        time.sleep(0.5)  # let the save of the waiting view land in the store
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_service(instance, scratch / "wire-lost", PTC_WARM_POOL_SIZE="0")
    try:
        with second.client() as api:
            lost = check_served(api, job["job_id"])
            assert lost["status"] == "lost"
            assert [c["status"] for c in lost["calls"]] == ["ok", "error"]
            assert lost["calls_by_status"] == {"ok": 1, "error": 1}  # the pending call ended, and is counted so
            assert same(lost["calls"][0]["args"], {"x": 2**70}) and same(lost["calls"][1]["args"], {"x": -(2**70)})
        wait_until(lambda: labelled_containers(engine, instance) == [], 10)
    finally:
        second.stop()
