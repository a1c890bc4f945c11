"""JavaScript and TypeScript scripts on the real engine (``language`` on ``/execute`` and ``POST /sessions``): the node
image (``sandbox_image/build.sh --node``, offered as ``node``), the ``tools`` module and globals, the broker's records,
errors and reports, exit codes, sessions, files, and hostile scripts, under runc and gVisor.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import IMAGE, Service, execute, require_runtime, start_service, stop_clean, wait_until

NODE_IMAGE = os.environ.get("PTC_NODE_IMAGE", "ptc-sandbox-node:latest")
ECHO = {"name": "echo", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}


def node_images(engine: docker.DockerClient) -> str:
    engine.images.get(NODE_IMAGE)  # present, or the test fails here naming it (deploy/local.sh setup builds it)
    return f"default={IMAGE},node={NODE_IMAGE}"


@pytest.fixture(scope="module", params=("runc", "runsc"))
def js_service(request: pytest.FixtureRequest, engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service offering the node image, its sandboxes under runc, then gVisor (each test runs under both)."""
    runtime: str = request.param
    require_runtime(engine, runtime)
    svc = start_service(
        f"pytest-js-{runtime}-{secrets.token_hex(3)}",
        scratch / f"svc-js-{runtime}",
        PTC_IMAGES=node_images(engine),
        PTC_RUNTIME=runtime,
        PTC_WARM_POOL_SIZE="1",
    )
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def js(js_service: Service) -> Iterator[httpx.Client]:
    with js_service.client() as client:
        yield client


def run_js(api: httpx.Client, script: str, tools: list[dict[str, Any]] | None = None, **body: Any) -> dict[str, Any]:
    return execute(api, script, tools, **{"language": "javascript", **body})


def test_console_log_and_one_tool_call(js: httpx.Client) -> None:
    script = 'import tools from "tools";\nconst r = await tools.echo({ x: 41 });\nconsole.log(JSON.stringify(r));\n'
    view = run_js(js, script, [ECHO])
    assert view["status"] == "succeeded", view
    assert view["language"] == "javascript" and view["image"] == "node"
    assert view["stdout"] == '{"tool":"echo","args":{"x":41}}\n'
    assert [(c["tool"], c["args"], c["status"]) for c in view["calls"]] == [("echo", {"x": 41}, "ok")]


TOOLS = [
    ECHO,
    {"name": "get-user", "parameters": {"properties": {"id": {"type": "integer"}}}, "endpoint": {"kind": "echo"}},
    {"name": "math.factorial", "parameters": {"properties": {"n": {"type": "integer"}}}, "endpoint": {"kind": "echo"}},
    {
        "name": "strict",
        "parameters": {"properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False},
        "endpoint": {"kind": "echo"},
    },
]


def test_tools_as_default_import_named_imports_globals_and_by_original_name(js: httpx.Client) -> None:
    script = """
import tools, { echo, math, ToolError } from "tools";
const a = await echo({ x: 1 });
const b = await tools["get-user"]({ id: 7 });
const c = await tools.math.factorial({ n: 5 });
const d = await math.factorial({ n: 6 });
const e = await tools["math.factorial"]({ n: 7 });
const f = await globalThis.echo({ x: "global" });
console.log(typeof ToolError, ToolError === globalThis.ToolError, tools === globalThis.tools);
"""
    view = run_js(js, script, TOOLS)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "function true true\n"
    calls = [(c["tool"], c["args"]) for c in view["calls"]]
    assert calls == [
        ("echo", {"x": 1}),
        ("get-user", {"id": 7}),
        ("math.factorial", {"n": 5}),
        ("math.factorial", {"n": 6}),
        ("math.factorial", {"n": 7}),
        ("echo", {"x": "global"}),
    ]


def test_a_refused_call_rejects_with_a_tool_error(js: httpx.Client) -> None:
    script = """
try {
  await tools.strict({ n: "five" });
} catch (e) {
  console.log(e instanceof ToolError, e.name, e.type, e.tool, e.message.includes("n"));
}
try {
  await tools.strict("not an object");
} catch (e) {
  console.log(e.type);
}
"""
    view = run_js(js, script, TOOLS)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "true ToolError invalid_arguments strict true\ninvalid_arguments\n"
    assert [c["status"] for c in view["calls"]] == ["rejected"]


def test_promise_all_over_hundreds_of_calls(js: httpx.Client) -> None:
    script = """
const results = await Promise.all(Array.from({ length: 300 }, (_, i) => tools.echo({ x: i })));
console.log(results.length, results.every((r, i) => r.args.x === i));
"""
    view = run_js(js, script, TOOLS)
    assert view["status"] == "succeeded", view
    assert view["stdout"] == "300 true\n"
    assert sorted(c["args"]["x"] for c in view["calls"]) == list(range(300))


def test_large_integers_are_exact_both_ways(js: httpx.Client) -> None:
    script = """
const r = (await tools.echo({ x: { a: 12345678901234567890n, b: 9007199254740993n, c: 1.5 } })).args.x;
console.log(typeof r.a, r.a.toString(), r.b === 9007199254740993n, r.c);
try { await tools.echo({ x: NaN }); } catch (e) { console.log(e.type); }
"""
    view = run_js(js, script, TOOLS)
    assert view["status"] == "succeeded", (view["stderr"], view["calls"])
    assert view["stdout"] == "bigint 12345678901234567890 true 1.5\ninvalid_arguments\n"
    assert view["calls"][0]["args"] == {"x": {"a": 12345678901234567890, "b": 9007199254740993, "c": 1.5}}


def test_uncaught_exception_fails_the_job_with_the_scripts_report(js: httpx.Client) -> None:
    view = run_js(js, 'console.log("before");\n\nthrow new TypeError("boom");\n')
    assert view["status"] == "failed", view
    assert view["exit_code"] == 1
    assert view["stdout"] == "before\n"
    assert "TypeError: boom" in view["stderr"]
    assert view["error"]["script_report"] | {"column": None} == {
        "type": "TypeError",
        "message": "boom",
        "line": 3,
        "column": None,
        "text": None,
    }
    assert "main.mjs" not in view["stderr"] and "script.mjs:3" in view["stderr"]


def test_unhandled_rejection_fails_the_job(js: httpx.Client) -> None:
    view = run_js(js, 'Promise.reject(new RangeError("late"));\nawait new Promise((r) => setTimeout(r, 50));\n')
    assert view["status"] == "failed", view
    assert view["error"]["script_report"]["type"] == "RangeError" and view["error"]["script_report"]["line"] == 1


def test_process_exit_is_the_exit_code(js: httpx.Client) -> None:
    view = run_js(js, 'console.log("bye");\nprocess.exit(3);\nconsole.log("never");\n')
    assert view["status"] == "failed" and view["exit_code"] == 3, view
    assert view["stdout"] == "bye\n"
    view = run_js(js, "process.exit(0);\n")
    assert view["status"] == "succeeded" and view["exit_code"] == 0, view


def test_a_syntax_error_is_reported_with_its_line(js: httpx.Client) -> None:
    view = run_js(js, "const a = 1;\nconst b = ;\n")
    assert view["status"] == "failed", view
    assert view["error"]["script_report"]["type"] == "SyntaxError" and view["error"]["script_report"]["line"] == 2, view
    view = execute(js, "const a: number = 1;\n\nlet b: = 2;\n", language="typescript")
    assert view["status"] == "failed", view
    assert view["error"]["script_report"]["type"] == "SyntaxError" and view["error"]["script_report"]["line"] == 3, view
    assert "script.ts:3" in view["stderr"]


def test_typescript_is_type_stripped_and_keeps_its_lines(js: httpx.Client) -> None:
    script = """interface Point { x: number; y: number }
type Named<T> = T & { name: string };
function norm(p: Point): number {
  return Math.hypot(p.x, p.y);
}
const p: Named<Point> = { x: 3, y: 4, name: "p" };
const echoed = (await tools.echo({ x: norm(p) })) as { args: { x: number } };
console.log(echoed.args.x);
enum Color { Red = "red" }
console.log(Color.Red satisfies string);
throw new Error("at line 11");
"""
    view = execute(js, script, TOOLS, language="typescript")
    assert view["language"] == "typescript"
    assert view["stdout"] == "5\nred\n", view
    assert view["status"] == "failed"
    report = view["error"]["script_report"]
    assert (report["type"], report["message"], report["line"]) == ("Error", "at line 11", 11)
    assert "script.ts:11" in view["stderr"]


def test_console_error_goes_to_stderr(js: httpx.Client) -> None:
    view = run_js(js, 'console.log("out");\nconsole.error("err");\nprocess.stdout.write("raw");\n')
    assert view["status"] == "succeeded", view
    assert (view["stdout"], view["stderr"]) == ("out\nraw", "err\n")


def test_a_python_image_refuses_javascript_and_a_session_keeps_its_language(js: httpx.Client) -> None:
    refused = js.post("/execute", json={"script": "1", "language": "javascript", "image": "default"})
    assert refused.status_code == 422, refused.text
    assert "cannot run javascript" in refused.text
    session = js.post("/sessions", json={"language": "javascript"}).json()
    try:
        assert session["language"] == "javascript" and session["image"] == "node", session
        other = js.post(
            "/execute", json={"script": "print(1)", "session_id": session["session_id"], "language": "python"}
        )
        assert other.status_code == 422 and "its language" in other.text
        view = execute(js, "console.log(1)", session_id=session["session_id"])
        assert view["status"] == "succeeded" and view["language"] == "javascript" and view["stdout"] == "1\n"
    finally:
        js.delete(f"/sessions/{session['session_id']}")


def test_a_javascript_session_keeps_files_and_env_between_scripts(js: httpx.Client) -> None:
    session = js.post("/sessions", json={"language": "javascript", "env": {"GREETING": "hej"}}).json()
    sid = session["session_id"]
    try:
        first = 'import fs from "node:fs";\nfs.writeFileSync("note.txt", process.env.GREETING + " from the first");\n'
        assert execute(js, first, session_id=sid)["status"] == "succeeded"
        second = 'import fs from "node:fs";\nconsole.log(fs.readFileSync("note.txt", "utf8"), process.cwd());\n'
        view = execute(js, second, session_id=sid)
        assert view["stdout"] == "hej from the first /tmp\n", view
    finally:
        js.delete(f"/sessions/{sid}")


def test_files_in_and_outputs_out(js: httpx.Client) -> None:
    script = """import fs from "node:fs";
const rows = fs.readFileSync("data.csv", "utf8").trim().split("\\n");
fs.mkdirSync("outputs", { recursive: true });
fs.writeFileSync("outputs/count.json", JSON.stringify({ rows: rows.length }));
"""
    files = [{"path": "data.csv", "content": "a\nb\nc\n"}]
    view = run_js(js, script, files=files)
    assert view["status"] == "succeeded", view
    assert [f["path"] for f in view["files"]] == ["outputs/count.json"], view["files"]


def test_the_node_image_runs_python_too_whichever_language_its_spare_process_was(js: httpx.Client) -> None:
    runs = [
        ("python", "print(2)", "2\n"),
        ("javascript", "console.log(3)", "3\n"),
        ("typescript", "console.log(4 as number)", "4\n"),
    ]
    for language, script, out in runs + runs[::-1]:
        view = execute(js, script, image="node", language=language)
        assert (view["status"], view["stdout"], view["language"]) == ("succeeded", out, language), view
    session = js.post("/sessions", json={"image": "node"}).json()  # Python: its sandbox's first spare was node
    try:
        assert session["language"] == "python"
        for _ in range(2):
            view = execute(js, "print(5)", session_id=session["session_id"])
            assert (view["status"], view["stdout"]) == ("succeeded", "5\n"), view
    finally:
        js.delete(f"/sessions/{session['session_id']}")


def test_output_is_live_while_the_script_runs(js: httpx.Client) -> None:
    script = 'console.log("first");\nawait new Promise((r) => setTimeout(r, 3000));\nconsole.log("second");\n'
    job_id = js.post("/execute", json={"script": script, "language": "javascript", "wait_s": 0}).json()["job_id"]
    wait_until(lambda: js.get(f"/jobs/{job_id}").json()["stdout"] == "first\n", 2.5)
    assert js.get(f"/jobs/{job_id}").json()["ended_at"] is None
    view = js.post(f"/jobs/{job_id}/wait", params={"timeout_s": 30}).json()
    assert (view["status"], view["stdout"], view["stdout_next_offset"]) == ("succeeded", "first\nsecond\n", 13)


def test_a_call_awaiting_approval_rejects_with_denied_when_denied(js: httpx.Client) -> None:
    guarded = {**ECHO, "name": "publish", "approval": "always", "approval_timeout_s": 60}
    script = """try {
  await tools.publish({ x: "draft" });
} catch (e) {
  console.log(e.type, e.message);
}
"""
    job_id = js.post("/execute", json={"script": script, "tools": [guarded], "language": "javascript", "wait_s": 0})
    job_id = job_id.json()["job_id"]
    wait_until(lambda: js.get(f"/jobs/{job_id}").json()["pending_calls"], 30)
    [pending] = js.get(f"/jobs/{job_id}").json()["pending_calls"]
    assert pending["awaiting"] == "approval"
    denied = js.post(f"/jobs/{job_id}/calls/{pending['call_id']}/deny", json={"reason": "not today"})
    assert denied.status_code == 200, denied.text
    view = js.post(f"/jobs/{job_id}/wait", params={"timeout_s": 30}).json()
    assert view["status"] == "succeeded" and view["stdout"].startswith("denied "), view
    assert "not today" in view["stdout"]
    assert [(c["status"], c["error"]["type"]) for c in view["calls"]] == [("error", "denied")]


def test_a_tool_named_then_is_no_thenable_export(js: httpx.Client) -> None:
    script = """const m = await import("tools");
console.log(typeof m.then, typeof tools.then, typeof tools.x.then, (await tools["x.then"]({ x: 1 })).tool);
"""
    view = run_js(js, script, [{**ECHO, "name": "then"}, {**ECHO, "name": "x.then"}, {**ECHO, "name": "x.y"}])
    assert (view["status"], view["stdout"]) == ("succeeded", "undefined undefined undefined x.then\n"), view


def test_what_node_prints_of_link_errors_unsettled_awaits_and_thrown_values(js: httpx.Client) -> None:
    view = run_js(js, 'import { nope } from "tools";\n')
    assert view["stderr"].startswith("file:///run/ptc/script.mjs:1\n") and "[" not in view["stderr"], view["stderr"]
    assert view["error"]["script_report"]["type"] == "SyntaxError"
    view = run_js(js, "await new Promise(() => {});\n")
    assert view["exit_code"] == 13 and "top-level await never settled" in view["stderr"], view
    view = run_js(js, 'throw "no";\n')
    assert view["exit_code"] == 1 and view["error"]["script_report"]["type"] == "string", view
