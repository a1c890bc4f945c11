"""MCP endpoints, and BFCL's multi-turn tools as real endpoints.

A BFCL multi-turn entry's ground-truth call sequence, run as a script through
``POST /execute`` against BFCL's own tool classes served over plain HTTP and
over MCP (``tests.bfcl_servers``), must end in the state that the same calls
made in Python on a fresh instance end in, and give the same results.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.bfcl_data import bfcl_data_dir, call_source
from tests.bfcl_servers import (
    BfclMcpServer,
    function_docs,
    list_tools,
    new_instance,
    parse_call,
    public_methods,
    servable_classes,
    serve,
    state,
    to_json,
)
from tests.conftest import execute, free_port, missing

CLASSES = ("GorillaFileSystem", "TradingBot")


SAMPLE_PER_CLASS = 3  # the first entries of BFCL_v4_multi_turn_base that use the class: 6 entries, 12 scripts


@dataclass(frozen=True)
class Replay:
    """A BFCL entry's ground truth, every turn's calls in order, with keyword arguments."""

    id: str
    classes: list[str]
    initial_config: dict[str, Any]
    calls: list[tuple[str, dict[str, Any]]]


def _read_jsonl(name: str) -> list[dict[str, Any]]:
    text = (bfcl_data_dir() / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_replays() -> list[Replay]:
    """The sampled entries whose classes can all be served here (see ``servable_classes``)."""
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl("possible_answer/BFCL_v4_multi_turn_base.json")}
    picked: list[Replay] = []
    for wanted in CLASSES:
        entries = [
            e
            for e in _read_jsonl("BFCL_v4_multi_turn_base.json")
            if wanted in e["involved_classes"] and set(e["involved_classes"]) <= set(servable_classes())
        ]
        for entry in entries[:SAMPLE_PER_CLASS]:
            methods = _methods(entry["involved_classes"], entry["initial_config"])
            calls = [parse_call(call, methods) for turn in answers[entry["id"]] for call in turn]
            picked.append(Replay(entry["id"], entry["involved_classes"], entry["initial_config"], calls))
    return picked


def _methods(classes: list[str], initial_config: dict[str, Any]) -> dict[str, Any]:
    return {name: m for c in classes for name, m in public_methods(new_instance(c, initial_config)).items()}


def replay_params() -> list[Any]:
    try:
        replays = load_replays()
    except RuntimeError as exc:  # bfcl-eval missing: one case says how to install it (xfails; fails under CI)
        return [pytest.param("", str(exc), id="bfcl-eval-missing")]
    return [pytest.param(kind, r, id=f"{kind}-{r.id}") for r in replays for kind in ("http", "mcp")]


def run_in_python(replay: Replay) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The same calls made directly on fresh instances: (instances by class, [(status, JSON result)])."""
    instances = {c: new_instance(c, replay.initial_config) for c in replay.classes}
    methods = {name: m for i in instances.values() for name, m in public_methods(i).items()}
    outcomes: list[tuple[str, Any]] = []
    for name, kwargs in replay.calls:
        try:
            outcomes.append(("ok", to_json(methods[name](**kwargs))))
        except Exception:
            outcomes.append(("error", None))
    return instances, outcomes


def script_for(calls: list[tuple[str, dict[str, Any]]]) -> str:
    lines = ["import tools"]
    for name, args in calls:
        lines += ["try:", f"    {call_source(name, args)}", "except tools.ToolError as e:", "    print(e)"]
    return "\n".join(lines) + "\n"


def manifest_for(kind: str, servers: dict[str, Any]) -> list[dict[str, Any]]:
    """http: BFCL's own docs, one endpoint per method; mcp: the server's ``tools/list`` entries as they are."""
    tools: list[dict[str, Any]] = []
    for class_name, server in servers.items():
        if kind == "http":
            tools += [
                {**doc, "endpoint": {"kind": "http", "url": server.url(doc["name"])}}
                for doc in function_docs(class_name)
                if doc["name"] in server.methods
            ]
        else:
            tools += [{**entry, "endpoint": {"kind": "mcp", "url": server.url}} for entry in list_tools(server.url)]
    return tools


@pytest.mark.parametrize(("kind", "replay"), replay_params())
def test_ground_truth_replay_ends_in_the_same_state(api: httpx.Client, kind: str, replay: Replay | str) -> None:
    if isinstance(replay, str):
        missing(replay, xfail=True)
    expected_instances, expected = run_in_python(replay)
    with serve(kind, replay.classes, replay.initial_config) as servers:
        view = execute(api, script_for(replay.calls), manifest_for(kind, servers))
        assert view["status"] == "succeeded", view
        assert [(c["tool"], c["args"]) for c in view["calls"]] == [(name, to_json(args)) for name, args in replay.calls]
        got = [("ok" if c["status"] == "ok" else "error", c["result"]) for c in view["calls"]]
        assert got == expected, view["stdout"]
        for class_name, server in servers.items():
            assert state(server.instance) == state(expected_instances[class_name]), class_name
        assert sum(len(s.calls) for s in servers.values()) == len(replay.calls)


def _gorilla_tools(server: BfclMcpServer, **endpoint: Any) -> list[dict[str, Any]]:
    return [
        {**tool.model_dump(mode="json", by_alias=True, exclude_none=True), "endpoint": {"kind": "mcp", **endpoint}}
        for tool in server.tools
    ]


@pytest.fixture
def file_system() -> Iterator[BfclMcpServer]:
    if "GorillaFileSystem" not in servable_classes():
        missing("bfcl_eval's GorillaFileSystem does not import here")
    config = {"GorillaFileSystem": {"root": {"w": {"type": "directory", "contents": {}}}}}
    with BfclMcpServer("GorillaFileSystem", config) as server:
        yield server


def test_one_mcp_session_serves_many_jobs_with_the_endpoint_headers(
    api: httpx.Client, file_system: BfclMcpServer
) -> None:
    tools = _gorilla_tools(file_system, url=file_system.url, headers={"x-api-key": "k-123"})
    for name in ("a", "b"):
        view = execute(api, f"import tools\ntools.mkdir(dir_name={name!r})\nprint(tools.ls())\n", tools)
        assert view["status"] == "succeeded", view
    assert view["stdout"] == "{'current_directory_content': ['a', 'b']}\n"
    assert [c["result"] for c in view["calls"]] == [None, {"current_directory_content": ["a", "b"]}]
    assert len(file_system.session_ids) == 1, "the broker opened more than one MCP session"
    assert all(headers.get("x-api-key") == "k-123" for _, headers in file_system.requests)


def test_mcp_tool_error_is_a_tool_error_in_the_script(api: httpx.Client, file_system: BfclMcpServer) -> None:
    tools = [{"name": "remote_missing", "endpoint": {"kind": "mcp", "url": file_system.url, "tool": "no_such_tool"}}]
    script = "import tools\ntry:\n    tools.remote_missing()\nexcept tools.ToolError as e:\n"
    script += "    print(e.type, '|', e.message)\n"
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "tool_error | unknown tool 'no_such_tool'\n"
    (call,) = view["calls"]
    assert call["status"] == "error"
    assert call["error"] == {"type": "tool_error", "message": "unknown tool 'no_such_tool'"}


def test_unreachable_mcp_url_is_endpoint_unreachable(api: httpx.Client) -> None:
    tools = [{"name": "nowhere", "endpoint": {"kind": "mcp", "url": f"http://127.0.0.1:{free_port()}/mcp"}}]
    script = "import tools\ntry:\n    tools.nowhere()\nexcept tools.ToolError as e:\n    print(e.type)\n"
    view = execute(api, script, tools)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "endpoint_unreachable\n"
    assert view["calls"][0]["error"]["type"] == "endpoint_unreachable"


def test_a_toolset_naming_an_mcp_server_discovers_its_tools(api: httpx.Client, file_system: BfclMcpServer) -> None:
    registered = api.post("/toolsets", json={"mcp_servers": [{"url": file_system.url, "headers": {"x-k": "v"}}]})
    assert registered.status_code == 200, registered.text
    toolset = registered.json()
    assert {"ls", "mkdir", "cd", "cat"} <= set(toolset["tools"])
    view = execute(
        api, "import tools\ntools.mkdir(dir_name='found')\nprint(tools.ls())\n", toolset=toolset["toolset_id"]
    )
    assert view["stdout"] == "{'current_directory_content': ['found']}\n"
    assert view["calls_total"] == 2 and view["calls_by_status"] == {"ok": 2}
    assert all(c["caller"] == "code" for c in view["calls"])
    dead = api.post("/toolsets", json={"mcp_servers": [{"url": f"http://127.0.0.1:{free_port()}/mcp"}]})
    assert dead.status_code == 422 and dead.json()["detail"].startswith("mcp_servers.0: endpoint_unreachable")
