"""The tool layer end to end: /stubs and /toolsets, manifest shapes, repair, policies, secrets."""

from __future__ import annotations

import ast
import json
import time
from typing import Any

import httpx
import pytest

from tests.conftest import execute, wait_until
from tests.toolserver import ToolServer

ECHO = {"kind": "echo"}
PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "Where."},
        "filters": {"type": "object", "properties": {"stars": {"type": "integer"}}, "required": ["stars"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city"],
}


def test_stubs_are_exactly_what_the_sandbox_imports(api: httpx.Client) -> None:
    tools = [{"name": "hotels.search", "description": "Find hotels.", "parameters": PARAMS, "endpoint": ECHO}]
    stubs = api.post("/stubs", json={"tools": tools})
    assert stubs.status_code == 200
    body = stubs.json()
    assert (
        "def search(city: str, filters: SearchFilters | None = None, tags: list[str] | None = None)" in body["module"]
    )
    assert "SearchFilters = TypedDict('SearchFilters', {'stars': 'int'})" in body["module"]
    assert "tools.aio" in body["usage"] and "ToolError" in body["usage"]
    view = execute(api, "print(open('/run/ptc/tools/__init__.py').read(), end='')", tools)
    assert view["stdout"] == body["module"]


def test_toolsets_register_once_and_run_by_id(api: httpx.Client) -> None:
    tools = [{"name": "ping", "parameters": {"properties": {"i": {"type": "integer"}}}, "endpoint": ECHO}]
    first = api.post("/toolsets", json={"tools": tools}).json()
    again = api.post("/toolsets", json={"tools": tools}).json()
    assert first == again and first["toolset_id"].startswith("ts_") and first["tools"] == ["ping"]
    view = execute(api, "import tools\nprint(tools.ping(i=3)['args'])", toolset=first["toolset_id"])
    assert view["stdout"] == "{'i': 3}\n"
    stubs = api.post("/stubs", json={"toolset": first["toolset_id"]}).json()
    assert stubs["toolset_id"] == first["toolset_id"]
    unknown = api.post("/execute", json={"script": "1", "toolset": "ts_nope"})
    assert unknown.status_code == 422 and unknown.json()["detail"].startswith("toolset")
    both = api.post("/execute", json={"script": "1", "toolset": first["toolset_id"], "tools": tools})
    assert both.status_code == 422


THREE = [
    (
        "get_weather",
        "Weather in a city.",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    ),
    (
        "add",
        "Add two numbers.",
        {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]},
    ),
    (
        "mail.send",
        "Send mail.",
        {
            "type": "object",
            "properties": {"from": {"type": "string"}, "to": {"type": "array", "items": {"type": "string"}}},
            "required": ["from", "to"],
        },
    ),
]


def manifest_in(form: str) -> list[dict[str, Any]]:
    if form == "ours":
        return [{"name": n, "description": d, "parameters": p, "endpoint": ECHO} for n, d, p in THREE]
    if form == "openai":
        return [
            {"type": "function", "function": {"name": n, "description": d, "parameters": p}, "endpoint": ECHO}
            for n, d, p in THREE
        ]
    if form == "anthropic":
        return [{"name": n, "description": d, "input_schema": p, "endpoint": ECHO} for n, d, p in THREE]
    return [{"name": n, "description": d, "inputSchema": p, "endpoint": ECHO} for n, d, p in THREE]


def test_four_manifest_forms_give_the_same_stubs_and_records(api: httpx.Client) -> None:
    script = (
        "import tools\ntools.get_weather(city='Oslo')\ntools.add(1, b=2.5)\ntools.mail.send(from_='a@x', to=['b@x'])\n"
    )
    modules, records = set(), []
    for form in ("ours", "openai", "anthropic", "mcp"):
        modules.add(api.post("/stubs", json={"tools": manifest_in(form)}).json()["module"])
        view = execute(api, script, manifest_in(form))
        records.append([(c["tool"], c["args"], c["status"]) for c in view["calls"]])
    assert len(modules) == 1
    assert all(r == records[0] for r in records)
    assert records[0] == [
        ("get_weather", {"city": "Oslo"}, "ok"),
        ("add", {"a": 1, "b": 2.5}, "ok"),
        ("mail.send", {"from": "a@x", "to": ["b@x"]}, "ok"),
    ]


def test_stringified_objects_are_repaired_and_invalid_ones_rejected_with_their_path(api: httpx.Client) -> None:
    tools = [{"name": "search", "parameters": PARAMS, "endpoint": ECHO}]
    script = (
        "import tools\n"
        "print(tools.search(city='Oslo', filters='{\"stars\": 4}', tags='[\"spa\"]')['args'])\n"
        "try:\n    tools.search(city='Oslo', filters={'stars': 'four'})\n"
        "except tools.ToolError as e:\n    print(e.message)\n"
    )
    view = execute(api, script, tools)
    ok, bad = view["calls"]
    assert ok["repaired"] is True and ok["args"] == {"city": "Oslo", "filters": {"stars": 4}, "tags": ["spa"]}
    assert view["stdout"].splitlines()[0] == "{'city': 'Oslo', 'filters': {'stars': 4}, 'tags': ['spa']}"
    assert bad["status"] == "rejected" and bad["repaired"] is False
    assert "argument 'filters.stars': 'four' is not of type 'integer'" in view["stdout"]


def test_only_idempotent_tools_are_retried(api: httpx.Client, tool_server: ToolServer) -> None:
    url = tool_server.url("flaky")
    tools = [
        {
            "name": "once",
            "parameters": {"properties": {"key": {}}},
            "retries": 3,
            "endpoint": {"kind": "http", "url": url},
        },
        {
            "name": "again",
            "parameters": {"properties": {"key": {}}},
            "idempotent": True,
            "retries": 3,
            "endpoint": {"kind": "http", "url": url},
        },
    ]
    script = (
        "import tools\ntry:\n    tools.once(key='k1')\nexcept tools.ToolError as e:\n    print(e.type)\n"
        "print(tools.again(key='k2'))\n"
    )
    view = execute(api, script, tools)
    assert view["stdout"] == "http_error\n{'key': 'k2', 'calls': 3}\n"
    assert (tool_server.flaky_calls["k1"], tool_server.flaky_calls["k2"]) == (1, 3)
    once, again = view["calls"]
    assert once["status"] == "error" and once["attempts"] is None
    assert again["status"] == "ok" and again["attempts"] == 3


def test_max_concurrency_holds_under_a_wide_gather(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [{"name": "slow", "max_concurrency": 2, "endpoint": {"kind": "http", "url": tool_server.url("slow")}}]
    tool_server.max_in_flight = 0
    script = (
        "import asyncio, tools\n"
        "async def main():\n    return await asyncio.gather(*(tools.aio.slow() for _ in range(50)))\n"
        "print(len(asyncio.run(main())))\n"
    )
    view = execute(api, script, tools, timeout_s=60)
    assert view["stdout"] == "50\n"
    assert tool_server.max_in_flight == 2


def test_tools_not_callable_from_code_are_hidden_and_refused(api: httpx.Client) -> None:
    tools = [
        {"name": "visible", "allowed_callers": ["code_execution_20250825"], "endpoint": ECHO},
        {"name": "direct_only", "allowed_callers": ["direct"], "endpoint": ECHO},
    ]
    assert "direct_only" not in api.post("/stubs", json={"tools": tools}).json()["module"]
    script = (
        "import tools\nprint(hasattr(tools, 'direct_only'))\ntools.visible()\n"
        "from ptc_runtime.client import client\n"
        "try:\n    client().request({'tool': 'direct_only', 'args': {}})\n"
        "except tools.ToolError as e:\n    print(e.type)\n"
    )
    view = execute(api, script, tools)
    assert view["stdout"] == "False\nnot_allowed\n"
    assert [(c["tool"], c["status"]) for c in view["calls"]] == [("visible", "ok"), ("direct_only", "rejected")]


def test_results_are_checked_against_the_output_schema(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        {
            "name": "shape",
            "outputSchema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
            "endpoint": {"kind": "http", "url": tool_server.url("wrong_shape")},
        }
    ]
    script = "import tools\ntry:\n    tools.shape()\nexcept tools.ToolError as e:\n    print(e.type, e.message)\n"
    view = execute(api, script, tools)
    assert view["stdout"].startswith("invalid_result shape: result.ok: 'yes' is not of type 'boolean'")
    assert "-> ShapeResult:" in api.post("/stubs", json={"tools": tools}).json()["module"]


SECRET = "s3cr3t-token-7f1c2a"


def test_endpoint_secrets_never_reach_the_sandbox_stubs_or_view(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        {
            "name": "area",
            "parameters": {"properties": {"base": {}, "height": {}}},
            "endpoint": {
                "kind": "http",
                "url": tool_server.url("triangle_area"),
                "headers": {"Authorization": f"Bearer {SECRET}"},
            },
        }
    ]
    head, tail = SECRET[:6], SECRET[6:]  # the script itself must not contain the secret
    script = f"""
import os, tools
SECRET = {head!r} + {tail!r}
print(tools.area(base=2, height=3))
found = [k for k, v in os.environ.items() if SECRET in v]
for root in ('/run/ptc', '/tmp', '/opt/ptc'):
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                if SECRET.encode() in open(os.path.join(folder, name), 'rb').read():
                    found.append(os.path.join(folder, name))
            except OSError:
                pass
print(found)
"""
    view = execute(api, script, tools)
    assert view["stdout"] == "3.0\n[]\n"
    assert SECRET not in json.dumps(view)
    assert SECRET not in api.get(f"/jobs/{view['job_id']}").text
    assert SECRET not in api.post("/stubs", json={"tools": tools}).text
    assert tool_server.headers[-1]["Authorization"] == f"Bearer {SECRET}"


@pytest.mark.parametrize(
    ("field", "value"),
    [("retries", 11), ("max_concurrency", 0), ("idempotent", "yes"), ("allowed_callers", "code"), ("timeout_s", -1)],
)
def test_bad_policies_are_refused(api: httpx.Client, field: str, value: Any) -> None:
    response = api.post("/execute", json={"script": "1", "tools": [{"name": "t", field: value, "endpoint": ECHO}]})
    assert response.status_code == 422
    assert response.json()["detail"].startswith(f"tools.0.{field}")


def test_client_executed_tools_pause_the_script_until_answered(api: httpx.Client) -> None:
    tools = [
        {
            "name": "ask_user",
            "parameters": {"properties": {"q": {"type": "string"}}, "required": ["q"]},
            "endpoint": {"kind": "client"},
        },
        {"name": "slow_user", "timeout_s": 2, "endpoint": {"kind": "client"}},
    ]
    script = (
        "import asyncio, tools\n"
        "async def main():\n"
        "    return await asyncio.gather(*(tools.aio.ask_user(q=f'q{i}') for i in range(5)))\n"
        "print(asyncio.run(main()))\n"
        "try:\n    tools.slow_user()\nexcept tools.ToolError as e:\n    print(e.type)\n"
    )
    started = time.monotonic()
    response = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 30})
    assert response.status_code == 202 and time.monotonic() - started < 10
    view = response.json()
    wait_until(lambda: len(api.get(f"/jobs/{view['job_id']}").json()["pending_calls"]) == 5, 10)
    view = api.get(f"/jobs/{view['job_id']}").json()
    assert view["status"] == "waiting"
    pending = {c["args"]["q"]: c["call_id"] for c in view["pending_calls"]}
    assert sorted(pending) == [f"q{i}" for i in range(5)]
    for q in ("q3", "q0", "q4", "q1"):
        answered = api.post(f"/jobs/{view['job_id']}/calls/{pending[q]}", json={"result": q.upper()})
        assert answered.status_code == 200
    assert api.post(f"/jobs/{view['job_id']}/calls/{pending['q3']}", json={"result": "again"}).status_code == 409
    assert api.post(f"/jobs/{view['job_id']}/calls/{pending['q2']}", json={}).status_code == 422
    api.post(f"/jobs/{view['job_id']}/calls/{pending['q2']}", json={"result": {"nested": [2]}})
    # /wait returns as soon as the job waits for the client again (slow_user), so poll for the end
    wait_until(lambda: api.get(f"/jobs/{view['job_id']}").json()["status"] == "succeeded", 20)
    final = api.get(f"/jobs/{view['job_id']}").json()
    assert final["status"] == "succeeded", final
    assert final["stdout"] == "['Q0', 'Q1', {'nested': [2]}, 'Q3', 'Q4']\ntimeout\n"
    assert final["pending_calls"] == []
    assert [c["status"] for c in final["calls"]] == ["ok"] * 5 + ["timeout"]
    assert api.post(f"/jobs/{final['job_id']}/calls/nope", json={"result": 1}).status_code == 409
    assert api.post("/jobs/job_nope/calls/nope", json={"result": 1}).status_code == 404


def test_client_tool_errors_reach_the_script(api: httpx.Client) -> None:
    tools = [{"name": "confirm", "endpoint": {"kind": "client"}}]
    script = "import tools\ntry:\n    tools.confirm()\nexcept tools.ToolError as e:\n    print(e.type, e.message)\n"
    view = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 30}).json()
    wait_until(lambda: api.get(f"/jobs/{view['job_id']}").json()["pending_calls"], 10)
    [call] = api.get(f"/jobs/{view['job_id']}").json()["pending_calls"]
    api.post(
        f"/jobs/{view['job_id']}/calls/{call['call_id']}",
        json={"error": {"type": "denied", "message": "the user said no"}},
    )
    final = api.post(f"/jobs/{view['job_id']}/wait", params={"timeout_s": 20}).json()
    assert final["stdout"] == "denied the user said no\n"
    assert final["calls"][0]["status"] == "error"


def test_endpoint_error_pages_cannot_leak_credentials(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        {
            "name": "guarded",
            "endpoint": {
                "kind": "http",
                "url": tool_server.url("auth_echo"),
                "headers": {"Authorization": f"Bearer {SECRET}"},
            },
        }
    ]
    script = "import tools\ntry:\n    tools.guarded()\nexcept tools.ToolError as e:\n    print(e.message)\n"
    view = execute(api, script, tools)
    assert view["stdout"] == "HTTP 401: denied for [redacted]\n"
    bad = [{"name": "t", "endpoint": {"kind": "http", "url": tool_server.url("x"), "headers": {"X": "a\r\nB: c"}}}]
    assert api.post("/execute", json={"script": "1", "tools": bad}).status_code == 422


def test_deep_repaired_arguments_and_client_results_are_refused(api: httpx.Client) -> None:
    deep = "[" * 200 + "]" * 200
    tools = [
        {"name": "t", "parameters": {"properties": {"x": {"type": "array"}}}, "endpoint": ECHO},
        {"name": "ask", "endpoint": {"kind": "client"}},
    ]
    script = (
        f"import tools\nprint('before', flush=True)\ntry:\n    tools.t(x={deep!r})\n"
        "except tools.ToolError as e:\n    print(e.type)\ntry:\n    tools.ask()\n"
        "except tools.ToolError as e:\n    print(e.type)\n"
    )
    job = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 30}).json()
    [call] = job["pending_calls"]
    nested: list[Any] = []
    for _ in range(300):
        nested = [nested]
    answer = api.post(
        f"/jobs/{job['job_id']}/calls/{call['call_id']}",
        content=json.dumps({"result": nested}),
        headers={"content-type": "application/json"},
    )
    # Deeper than a body may be (254 levels: what the service can write back): refused at the door, the call
    # still waits for an answer.
    assert answer.status_code == 422 and "nested deeper than 254 levels" in answer.json()["detail"], answer.text
    answer = api.post(
        f"/jobs/{job['job_id']}/calls/{call['call_id']}",
        json={"error": {"type": "bad_response", "message": "the result was nested too deep"}},
    )
    assert answer.status_code == 200
    final = api.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 20}).json()
    assert final["stdout"] == "before\ninvalid_arguments\nbad_response\n"
    assert [c["status"] for c in final["calls"]] == ["rejected", "error"]


def test_a_parameter_may_be_named_self_and_wait_returns_for_the_client(api: httpx.Client) -> None:
    tools = [
        {"name": "f", "parameters": {"properties": {"self": {"type": "string"}}}, "endpoint": ECHO},
        {"name": "ask", "endpoint": {"kind": "client"}},
    ]
    script = "import tools\nprint(tools.f(self='a')['args'])\ntools.ask()\ntools.ask()\n"
    job = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 30}).json()
    for _ in range(2):
        [call] = job["pending_calls"]
        api.post(f"/jobs/{job['job_id']}/calls/{call['call_id']}", json={"result": 1})
        started = time.monotonic()
        job = api.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 20}).json()
        assert time.monotonic() - started < 5
    assert job["status"] == "succeeded" and job["stdout"] == "{'self': 'a'}\n"


def test_a_retried_call_that_fails_counts_its_attempts(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [
        {"name": "down", "idempotent": True, "retries": 2, "endpoint": {"kind": "http", "url": tool_server.url("fail")}}
    ]
    view = execute(
        api, "import tools\ntry:\n    tools.down()\nexcept tools.ToolError as e:\n    print(e.type)\n", tools
    )
    assert view["stdout"] == "http_error\n"
    assert view["calls"][0]["attempts"] == 3


@pytest.mark.parametrize("body", [{"timeout_s": True}, {"wait_s": "5"}, {"limits": {"memory_mb": 256.0}}])
def test_numbers_must_be_numbers(api: httpx.Client, body: dict[str, Any]) -> None:
    assert api.post("/execute", json={"script": "1", **body}).status_code == 422


def test_a_lone_positional_dict_is_the_tools_arguments(runtime_api: httpx.Client, tool_server: ToolServer) -> None:
    """``get_expenses({"employee_id": 1, "quarter": "Q3"})``, as Claude's code-execution runtime and real scripts
    write it: blocking, awaited, as a global and gathered; recorded as a repair. A tool whose first parameter can
    take an object keeps the ordinary meaning."""
    echo = {"kind": "http", "url": tool_server.url("echo")}
    expenses = {
        "type": "object",
        "properties": {"employee_id": {"type": "integer"}, "quarter": {"type": "string", "enum": ["Q3", "Q4"]}},
        "required": ["employee_id", "quarter"],
    }
    tools = [
        {"name": "get_expenses", "parameters": expenses, "endpoint": echo},
        {"name": "configure", "parameters": {"properties": {"settings": {"type": "object"}}}, "endpoint": echo},
    ]
    blocking = (
        "import asyncio, tools\n"
        "print(tools.get_expenses({'employee_id': 1, 'quarter': 'Q3'})['args'])\n"
        "print(get_expenses({'employee_id': 2, 'quarter': 'Q3'})['args'])\n"
        "print(asyncio.run(tools.aio.get_expenses({'employee_id': 3, 'quarter': 'Q4'}))['args'])\n"
        "print(tools.configure({'verbose': True})['args'])\n"
    )
    view = execute(runtime_api, blocking, tools)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == (
        "{'employee_id': 1, 'quarter': 'Q3'}\n{'employee_id': 2, 'quarter': 'Q3'}\n"
        "{'employee_id': 3, 'quarter': 'Q4'}\n{'settings': {'verbose': True}}\n"
    )
    assert [(c["args"], c["status"], c["repairs"]) for c in view["calls"]] == [
        ({"employee_id": 1, "quarter": "Q3"}, "ok", ["positional_dict"]),
        ({"employee_id": 2, "quarter": "Q3"}, "ok", ["positional_dict"]),
        ({"employee_id": 3, "quarter": "Q4"}, "ok", ["positional_dict"]),
        ({"settings": {"verbose": True}}, "ok", []),
    ]
    awaited = (
        "import asyncio\n"
        "team = [{'id': 7}, {'id': 8}]\n"
        "print(await get_expenses({'employee_id': 6, 'quarter': 'Q3'}))\n"
        "found = await asyncio.gather(*(get_expenses({'employee_id': m['id'], 'quarter': 'Q3'}) for m in team))\n"
        "print(sorted(f['args']['employee_id'] for f in found))\n"
    )
    view = execute(runtime_api, awaited, tools)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "{'args': {'employee_id': 6, 'quarter': 'Q3'}}\n[7, 8]\n"
    assert sorted(c["args"]["employee_id"] for c in view["calls"]) == [6, 7, 8]
    assert all(c["status"] == "ok" and c["repairs"] == ["positional_dict"] for c in view["calls"])


def test_a_stubs_parameter_names_mean_its_own_parameters(runtime_api: httpx.Client, tool_server: ToolServer) -> None:
    """Parameters whose names collide once made identifiers (``content-type``/``content_type``, ``from``/``from_``):
    a name of the stub's signature is always that parameter; the renamed one has a spelling of its own."""
    props = {"content-type": {"type": "string"}, "content_type": {"type": "string"}, "from": {}, "from_": {}}
    tools = [
        {
            "name": "req",
            "parameters": {"properties": props},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        }
    ]
    module = runtime_api.post("/stubs", json={"tools": tools}).json()["module"]
    assert "def req(content_type_: str | None = None, content_type: str | None = None, from__: Any = None" in module
    assert "content_type_ ('content-type'):" in module and "from__ ('from'):" in module
    script = (
        "import tools\n"
        "print(tools.req(content_type='A')['args'])\n"
        "print(tools.req(content_type_='B')['args'])\n"
        "print(tools.req(content_type='A', content_type_='B')['args'])\n"
        "print(tools.req(**{'content-type': 'C', 'content_type': 'A'})['args'])\n"
        "print(tools.req(from_=1, from__=2)['args'])\n"
        "print(tools.req(**{'from': 2})['args'])\n"
    )
    view = execute(runtime_api, script, tools)
    assert view["status"] == "succeeded", view
    sent: list[dict[str, Any]] = [
        {"content_type": "A"},
        {"content-type": "B"},
        {"content_type": "A", "content-type": "B"},
    ]
    sent += [{"content_type": "A", "content-type": "C"}, {"from_": 1, "from": 2}, {"from": 2}]
    assert [c["args"] for c in view["calls"]] == sent  # as recorded, and as the tool received them:
    assert [ast.literal_eval(line) for line in view["stdout"].splitlines()] == sent
