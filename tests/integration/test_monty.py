"""The Monty engine through the real service (``engine: "monty"`` on ``/execute``): its confined workers, the
``tools`` module and globals, sync and ``asyncio.gather`` calls, the broker's records (the same as the container
engine's for the same script), errors and reports, limits, ``auto``, and what it refuses.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, execute, start_service, stop_clean

ECHO = {"name": "echo", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
    "endpoint": {"kind": "echo"},
}
DOTTED = {
    "name": "hotels.search",
    "parameters": {"properties": {"q": {"type": "string"}}},
    "endpoint": {"kind": "echo"},
}
RENAMED = {"name": "send", "parameters": {"properties": {"from": {"type": "string"}}}, "endpoint": {"kind": "echo"}}
TOOLS = [ECHO, WEATHER, DOTTED, RENAMED]


@pytest.fixture(scope="module")
def monty_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    svc = start_service(f"pytest-monty-{secrets.token_hex(3)}", scratch / "svc-monty", PTC_WARM_POOL_SIZE="0")
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def api(monty_service: Service) -> Iterator[httpx.Client]:
    with monty_service.client() as client:
        yield client


def monty(api: httpx.Client, script: str, tools: list[dict[str, Any]] | None = None, **body: Any) -> dict[str, Any]:
    return execute(api, script, TOOLS if tools is None else tools, **{"engine": "monty", **body})


def calls(view: dict[str, Any]) -> list[tuple[str, Any, str]]:
    return [(c["tool"], c["args"], c["status"]) for c in view["calls"]]


def test_print_and_one_tool_call(api: httpx.Client) -> None:
    view = monty(api, "import tools\nprint(tools.echo(x=41))")
    assert view["status"] == "succeeded", view
    assert view["engine"] == "monty" and view["language"] == "python"
    assert view["stdout"] == "{'tool': 'echo', 'args': {'x': 41}}\n"
    assert calls(view) == [("echo", {"x": 41}, "ok")]


def test_the_container_engine_is_the_default_and_says_so(api: httpx.Client) -> None:
    view = execute(api, "print(1)")
    assert view["engine"] == "container" and view["stdout"] == "1\n"


SYNC_FORMS = """
import asyncio
import tools
from tools import get_weather
print(tools.get_weather("Oslo"))
print(get_weather(city="Rome", unit="c"))
print(tools.get_weather({"city": "Paris"}))
print(tools.hotels.search(q="spa"))
print(tools.send(from_="me"))
print(tools.send(**{"from": "you"}))
print(echo(x=1))
async def main():
    first = await echo(x=2)
    rest = await asyncio.gather(*[tools.aio.echo(x=i) for i in range(3, 6)])
    inner = echo(x=6)
    return [first, *rest, await inner]
print(len(asyncio.run(main())))
"""
TOP_LEVEL_AWAIT = """
import asyncio
import tools
print(await echo(x=1))
pending = echo(x=2)
print(len(await asyncio.gather(pending, tools.aio.hotels.search(q="pool"), tools.aio.echo(x=3))))
print(tools.echo(x=4))
"""


@pytest.mark.parametrize("script", [SYNC_FORMS, TOP_LEVEL_AWAIT], ids=["sync", "top-level-await"])
def test_the_forms_of_a_call_give_the_container_engines_records(api: httpx.Client, script: str) -> None:
    monty_view = monty(api, script)
    container_view = execute(api, script, TOOLS)
    assert monty_view["status"] == container_view["status"] == "succeeded", (monty_view, container_view)
    assert calls(monty_view) == calls(container_view)
    assert [c.get("repair") for c in monty_view["calls"]] == [c.get("repair") for c in container_view["calls"]]
    assert monty_view["stdout"] == container_view["stdout"]


def test_a_failed_call_raises_runtime_error_with_the_tool_errors_text(api: httpx.Client) -> None:
    script = """
import tools
try:
    tools.get_weather(town="Oslo")
except RuntimeError as e:
    print("caught:", e)
tools.nope()
"""
    view = monty(api, script)
    assert view["status"] == "failed", view
    assert view["stdout"].startswith("caught: invalid_arguments: "), view["stdout"]
    assert [c["status"] for c in view["calls"]] == ["rejected"]
    report = view["error"]["script_report"]
    assert report["type"] == "AttributeError" and report["line"] == 7


def test_an_uncaught_exception_fails_the_job_with_its_report(api: httpx.Client) -> None:
    view = monty(api, "x = 1\nraise ValueError('bad thing')\n")
    assert view["status"] == "failed", view
    report = view["error"]["script_report"]
    assert report["type"] == "ValueError" and report["message"] == "bad thing" and report["line"] == 2
    assert "ValueError: bad thing" in view["stderr"]


def test_a_syntax_error_is_reported_with_its_line(api: httpx.Client) -> None:
    view = monty(api, "x = 1\ndef f(:\n    pass\n")
    assert view["status"] == "failed", view
    report = view["error"]["script_report"]
    assert report["type"] == "SyntaxError" and report["line"] == 2


def test_memory_past_the_limit_ends_oom_killed(api: httpx.Client) -> None:
    view = monty(api, "x = []\nwhile True:\n    x.append('a' * 100000)\n", limits={"memory_mb": 64})
    assert view["status"] == "oom_killed", view


def test_an_endless_loop_ends_timed_out(api: httpx.Client) -> None:
    view = monty(api, "while True:\n    pass\n", timeout_s=1)
    assert view["status"] == "timed_out", view
    after = monty(api, "print('next')")  # the key's worker serves the next script
    assert after["status"] == "succeeded" and after["stdout"] == "next\n"


def test_auto_picks_monty_only_for_what_monty_runs(api: httpx.Client) -> None:
    assert execute(api, "import json\nprint(json.dumps([1]))", [], engine="auto")["engine"] == "monty"
    assert execute(api, "import subprocess\nprint(1)", [], engine="auto")["engine"] == "container"
    assert execute(api, "class E(Exception):\n    pass\nprint(1)", [], engine="auto")["engine"] == "container"
    view = execute(
        api, "import tools\ntry:\n    tools.echo()\nexcept tools.ToolError:\n    pass", [ECHO], engine="auto"
    )
    assert view["engine"] == "container"
    files = [{"path": "a.txt", "content": "hi"}]
    assert execute(api, "print(open('a.txt').read())", [], engine="auto", files=files)["engine"] == "container"


def test_what_monty_cannot_take_is_a_422(api: httpx.Client) -> None:
    for extra, field in (
        ({"files": [{"path": "a.txt", "content": "hi"}]}, "files"),
        ({"env": {"A": "1"}}, "env"),
        ({"image": "default", "language": "javascript"}, "engine"),
        ({"engine": "nope"}, "engine"),
    ):
        answer = api.post("/execute", json={"script": "print(1)", "engine": "monty", **extra})
        assert answer.status_code == 422, (extra, answer.text)
        assert field in str(answer.json()), answer.text


CHECKED = """
import tools
x = tools.get_weather(3)
tools.get_weather(city="Oslo", unit="k")
print(tools.nope(1))
"""


@pytest.mark.parametrize("target", ["container", "monty"])
def test_check_answers_the_type_errors_and_runs_nothing(api: httpx.Client, target: str) -> None:
    answer = api.post("/check", json={"script": CHECKED, "tools": TOOLS, "engine": target})
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert found["ok"] is False and found["engine"] == target
    by_line = {(d["line"], d["code"]) for d in found["diagnostics"]}
    assert (3, "invalid-argument-type") in by_line and (4, "invalid-argument-type") in by_line, found
    assert (5, "unresolved-attribute") in by_line, found
    ok = api.post("/check", json={"script": "import tools\nprint(tools.get_weather('Oslo'))", "tools": TOOLS})
    assert ok.json() == {"ok": True, "diagnostics": [], "engine": "container"}, ok.text


def test_check_knows_tool_error_is_the_container_engines(api: httpx.Client) -> None:
    script = "import tools\ntry:\n    tools.echo(x=1)\nexcept tools.ToolError as e:\n    print(e.type)\n"
    container = api.post("/check", json={"script": script, "tools": TOOLS}).json()
    monty_check = api.post("/check", json={"script": script, "tools": TOOLS, "engine": "monty"}).json()
    assert container["ok"] is True, container
    assert monty_check["ok"] is False and monty_check["diagnostics"][0]["line"] == 4, monty_check


def test_execute_with_check_refuses_a_script_with_type_errors_before_it_runs(api: httpx.Client) -> None:
    for engine in ("container", "monty"):
        body = {"script": "print('ran')\n" + CHECKED, "tools": TOOLS, "check": True, "engine": engine}
        answer = api.post("/execute", json=body)
        assert answer.status_code == 422, answer.text
        problem = answer.json()
        assert problem["type"].endswith("/script-check-failed"), problem
        assert {d["line"] for d in problem["diagnostics"]} >= {4, 5, 6}, problem
        assert "job_id" not in problem
    view = execute(api, "import tools\nprint(tools.echo(x=1)['args'])", TOOLS, check=True, engine="monty")
    assert view["status"] == "succeeded" and view["stdout"] == "{'x': 1}\n", view


def test_tools_monty_cannot_offer_are_refused_and_auto_sends_them_to_a_container(api: httpx.Client) -> None:
    factorial = {"name": "math.factorial", "parameters": {"properties": {"n": {}}}, "endpoint": {"kind": "echo"}}
    auth = [
        {"name": "auth", "parameters": {"properties": {}}, "endpoint": {"kind": "echo"}},
        {"name": "auth.login", "parameters": {"properties": {}}, "endpoint": {"kind": "echo"}},
    ]
    for tools, named, script in (([factorial], "math", "print(1)"), (auth, "auth", "import tools\ntools.auth()")):
        answer = api.post("/execute", json={"script": script, "tools": tools, "engine": "monty"})
        assert answer.status_code == 422 and named in answer.json()["detail"], answer.text
        assert execute(api, script, tools, engine="auto")["engine"] == "container"
    login = execute(api, "import tools\nprint(tools.auth.login()['tool'])", auth, engine="monty")
    assert (login["status"], login["stdout"]) == ("succeeded", "auth.login\n"), login  # its other tools work


def test_a_monty_session_keeps_its_interpreter_state_between_scripts(api: httpx.Client) -> None:
    created = api.post("/sessions", json={"engine": "monty", "tools": TOOLS})
    assert created.status_code == 201, created.text
    session = created.json()
    sid = session["session_id"]
    try:
        assert session["engine"] == "monty"
        first = execute(api, "import json\nimport tools\ncount = 1\ndef twice(x):\n    return 2 * x\n", session_id=sid)
        assert (first["status"], first["engine"], first["sandbox_start"]) == ("succeeded", "monty", "session"), first
        second = execute(
            api, "count += 1\nprint(count, twice(21), json.dumps(tools.echo(x=count)['args']))", session_id=sid
        )
        assert second["status"] == "succeeded" and second["stdout"] == '2 42 {"x": 2}\n', second
        assert [c["args"] for c in second["calls"]] == [{"x": 2}]
        wrong = api.post("/execute", json={"script": "1", "session_id": sid, "engine": "container"})
        assert wrong.status_code == 422 and wrong.json()["errors"][0]["loc"] == ["body", "engine"], wrong.text
        killed = execute(api, "while True:\n    pass", session_id=sid, timeout_s=1)
        assert killed["status"] == "timed_out", killed
        after = api.post("/execute", json={"script": "print(count)", "session_id": sid})
        assert after.status_code == 409, after.text  # its interpreter's state was lost with the kill: it ended
        assert api.get(f"/sessions/{sid}").json()["status"] == "broken"
    finally:
        api.delete(f"/sessions/{sid}")


def test_sessions_of_two_keys_and_of_one_key_are_apart(api: httpx.Client) -> None:
    sessions = [api.post("/sessions", json={"engine": "monty"}).json()["session_id"] for _ in range(2)]
    try:
        execute(api, "secret = 'first'", session_id=sessions[0])
        other = execute(api, "print(secret)", session_id=sessions[1])
        assert other["status"] == "failed" and other["error"]["script_report"]["type"] == "NameError", other
        assert api.post("/sessions", json={"engine": "monty", "env": {"A": "1"}}).status_code == 422
    finally:
        for sid in sessions:
            api.delete(f"/sessions/{sid}")
