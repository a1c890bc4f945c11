"""Attacks on JavaScript and TypeScript scripts that succeed today (a security review's findings), runc and gVisor.

Each test asserts the behaviour the documents promise (docs/javascript.md, docs/sessions.md, docs/threat-model.md):

- a session's earlier script must not turn files it leaves in ``/tmp`` into code a later script runs when it asks for
  a package of the image (``HOME=/tmp``: Node's CommonJS loader looks in ``$HOME/.node_modules`` first, the twin of
  Python's user site, which ``PYTHONNOUSERSITE=1`` closes);
- a manifest's tool names cannot break the generated ``tools`` module (a tool named ``makeTools``);
- a tool named ``then`` does not make the tools object a thenable that hangs and crashes the script that awaits it;
- ``POST /stubs`` answers declarations whose size is bounded by the manifest's, not tens of times it (a ``$ref`` to a
  long literal union is written in full at every property that names it: 0.5 MB of manifest gave 21 MB, 4 MB gave
  170 MB, kept in memory with the compiled manifest and encoded on the event loop);
- a TypeScript transpiler that was killed (out of memory, no thread to start) is not reported as the script's
  syntax error.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import execute
from tests.integration.test_javascript import ECHO, js, js_service, run_js  # noqa: F401

PLANT = r"""
import fs from "node:fs";
for (const home of ["/tmp/.node_modules", "/tmp/.node_libraries"]) {
  const dir = home + "/acorn";
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(dir + "/package.json", JSON.stringify({ name: "acorn", main: "index.js" }));
  fs.writeFileSync(dir + "/index.js", 'console.log("PLANTED"); module.exports = { parse: () => "planted" };');
}
"""

REQUIRE_ACORN = r"""
import { createRequire } from "node:module";
const require = createRequire(import.meta.url);
const acorn = require("acorn");
console.log(require.resolve("acorn"), typeof acorn.parse, acorn.parse("1").type);
"""


def test_an_earlier_script_cannot_plant_a_package_for_a_later_scripts_require(js: httpx.Client) -> None:
    """The earlier script writes ``/tmp/.node_modules/acorn``; a later script's ``require("acorn")`` must get the
    image's acorn (``/usr/share/nodejs``), as a one-shot job's does, and never run the planted code."""
    alone = run_js(js, REQUIRE_ACORN)
    assert alone["status"] == "succeeded", alone
    assert alone["stdout"].startswith("/usr/share/nodejs/acorn/"), alone["stdout"]
    created = js.post("/sessions", json={"language": "javascript"})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    try:
        assert execute(js, PLANT, session_id=sid)["status"] == "succeeded"
        later = execute(js, REQUIRE_ACORN, session_id=sid)
        assert "PLANTED" not in later["stdout"], later["stdout"]
        assert later["status"] == "succeeded" and later["stdout"] == alone["stdout"], later
    finally:
        js.delete(f"/sessions/{sid}")


def test_a_tool_named_like_the_modules_own_binding_does_not_break_it(js: httpx.Client) -> None:
    """``makeTools`` is an identifier and not ``RESERVED``, so the generated module exports it, beside its own
    ``import { makeTools }``: a SyntaxError that fails every script of the manifest (POST /stubs declares it)."""
    tools = [ECHO, {**ECHO, "name": "makeTools"}]
    script = 'import tools, { makeTools } from "tools";\nconsole.log(typeof tools.makeTools, typeof makeTools);\n'
    view = run_js(js, script, tools)
    assert view["status"] == "succeeded", (view["stderr"], view["error"])
    assert view["stdout"] == "function function\n"


def test_awaiting_the_tools_object_with_a_tool_named_then(js: httpx.Client) -> None:
    """``tools.then`` makes the tools object a thenable: an async helper that returns it (``return tools``) calls the
    tool ``then`` with the promise's resolve function, which is refused (a ToolError, unhandled: the script crashes)
    and the await never settles. The object should come back as it is (or the manifest be refused for JavaScript)."""
    tools = [ECHO, {**ECHO, "name": "then"}]
    script = """import tools from "tools";
async function theTools() {
  return tools;
}
const timeout = new Promise((resolve) => setTimeout(() => resolve("hung"), 2000));
const got = await Promise.race([theTools(), timeout]);
console.log(got === tools ? "the tools" : String(got));
"""
    body: dict[str, Any] = {"script": script, "tools": tools, "language": "javascript"}
    answer = js.post("/execute", json=body)
    if answer.status_code == 422:  # refused up front, naming the tool: acceptable
        assert "then" in answer.text
        return
    view = answer.json()
    if view["status"] in ("queued", "running"):
        view = js.post(f"/jobs/{view['job_id']}/wait", params={"timeout_s": 60}).json()
    assert view["status"] == "succeeded", (view["stderr"], view["error"])
    assert view["stdout"] == "the tools\n" and view["calls"] == []


def ref_heavy_manifest(properties: int) -> list[dict[str, Any]]:
    """One tool whose ``properties`` parameters each ``$ref`` one enum of 64 strings (a literal union of ~1,990
    characters: just under the declarations' ``MAX_TYPE_CHARS``, so it is written out at each of them)."""
    values = [f"value-{i:02d}-" + "x" * 17 for i in range(64)]
    props = {f"p{i}": {"$ref": "#/$defs/e"} for i in range(properties)}
    parameters = {"type": "object", "properties": props, "$defs": {"e": {"enum": values}}}
    return [{"name": "t", "parameters": parameters, "endpoint": {"kind": "echo"}}]


def test_typescript_declarations_are_bounded_by_the_manifest(js: httpx.Client) -> None:
    """A 0.3 MB manifest must not become tens of MB of declarations (21 MB today; a 4 MB one gives 170 MB, holds
    the event loop 1.7 s while it is encoded and stays in memory with the compiled manifest)."""
    tools = ref_heavy_manifest(10_000)
    manifest_bytes = len(json.dumps(tools))
    answer = js.post("/stubs", json={"tools": tools, "language": "typescript"}, timeout=120)
    assert answer.status_code in (200, 413, 422), answer.text[:500]
    if answer.status_code == 200:
        module = answer.json()["module"]
        assert len(module) <= 4 * manifest_bytes, (manifest_bytes, len(module))


def test_a_killed_typescript_transpiler_is_not_a_syntax_error(js: httpx.Client) -> None:
    """esbuild on deeply nested brackets runs out of the sandbox's memory and is killed; today the job says
    ``SyntaxError: the TypeScript transpiler refused the script`` with an empty report on stderr. It should say the
    transpiler was killed (or the job be ``oom_killed``), not blame the script's syntax."""
    depth = 400_000
    script = "const a = " + "[" * depth + "]" * depth + ";\nconsole.log('ok');\n"
    view = execute(js, script, language="typescript", timeout_s=30)
    assert view["status"] != "succeeded", view["stdout"]
    if view["status"] in ("oom_killed",) or view["error"]["type"] in ("oom", "sandbox_error"):
        return  # gVisor: its OOM kill ends the whole sandbox, which the engine reports
    report = view["error"].get("script_report") or {}
    assert report.get("type") != "SyntaxError", (report, view["stderr"])
    assert any(word in view["stderr"].lower() for word in ("killed", "memory", "signal")), view["stderr"]
