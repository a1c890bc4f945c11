"""Hostile JavaScript scripts under runc and gVisor: each ends with a clear outcome, as its Python twin does.

Endless loops, memory bombs, processes and worker threads that try to outlive their run, the filesystem, the
network, a polluted language, the broker's socket spoken to directly, output floods and fork bombs. Where Python has
the same attack (``test_bad_input.py``, ``test_session_isolation.py``, ``test_broker_limits.py``), its script runs on
the same service beside the JavaScript one and both must end alike (status, error type, truncation fields). After
each test the service answers ``/healthz`` and runs a script, and none of its one-shot sandboxes is left; at the end
of the module ``stop_clean`` finds no container of the service at all.

The services here are ``tests/integration/test_javascript.py``'s ``js_service`` with one setting more: a job may make
``CALL_CAP`` tool calls (``PTC_MAX_TOOL_CALLS``; 10,000 by default), so that the cap is reached in a test's time.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import (
    RUNTIMES,
    Service,
    execute,
    labelled_containers,
    require_runtime,
    start_service,
    stop_clean,
    wait_until,
)
from tests.integration.test_javascript import ECHO, node_images, run_js
from tests.toolserver import ToolServer

CALL_CAP = 200
"""``PTC_MAX_TOOL_CALLS`` of the services here."""
HEALTHZ_BOUND_S = 2.0
"""The slowest ``/healthz`` answer allowed while a sandbox floods (as ``test_broker_limits.py``'s bound)."""


@pytest.fixture(scope="module", params=RUNTIMES)
def js_runtime(request: pytest.FixtureRequest, engine: docker.DockerClient) -> str:
    """runc, then gVisor (``runsc``): the OCI runtime of ``hostile_service``'s sandboxes."""
    runtime: str = request.param
    require_runtime(engine, runtime)
    return runtime


@pytest.fixture(scope="module")
def hostile_service(js_runtime: str, engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service offering the node image (and the default Python one), its sandboxes under ``js_runtime``."""
    runtime = js_runtime
    svc = start_service(
        f"pytest-jsh-{runtime}-{secrets.token_hex(3)}",
        scratch / f"svc-jsh-{runtime}",
        PTC_IMAGES=node_images(engine),
        PTC_RUNTIME=runtime,
        PTC_WARM_POOL_SIZE="1",
        PTC_MAX_TOOL_CALLS=str(CALL_CAP),
    )
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def js(hostile_service: Service) -> Iterator[httpx.Client]:
    """A client of ``hostile_service``, after a first JavaScript job (which makes the node image's warm pool)."""
    with hostile_service.client() as client:
        assert run_js(client, "")["status"] == "succeeded"
        yield client


@pytest.fixture(autouse=True)
def healthy_afterwards(hostile_service: Service, js: httpx.Client, engine: docker.DockerClient) -> Iterator[None]:
    """After each test: ``/healthz`` answers 200, a script still runs, and no one-shot sandbox is left."""
    yield
    assert js.get("/healthz").status_code == 200
    view = run_js(js, 'console.log("still here");')
    assert (view["status"], view["stdout"]) == ("succeeded", "still here\n"), view
    wait_until(lambda: labelled_containers(engine, hostile_service.instance_id) == [], 10)


@contextmanager
def js_session(api: httpx.Client, **body: Any) -> Iterator[str]:
    """A JavaScript session with the echo tool (deleted at the end); its id."""
    created = api.post("/sessions", json={"language": "javascript", "tools": [ECHO], "idle_timeout_s": 300, **body})
    assert created.status_code == 201, created.text
    session_id: str = created.json()["session_id"]
    try:
        yield session_id
    finally:
        api.delete(f"/sessions/{session_id}")


def node_pool_ready(api: httpx.Client) -> bool:
    """Whether the warm pool of the node image's default profile holds a sandbox now (``ptc_sandbox_pool_size``)."""
    text = api.get("/metrics").raise_for_status().text
    prefix = 'ptc_sandbox_pool_size{profile="node'
    return any(line.startswith(prefix) and float(line.rsplit(" ", 1)[1]) >= 1 for line in text.splitlines())


def timed(work: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """``work()``'s job view and the seconds it took."""
    started = time.monotonic()
    view: dict[str, Any] = work()
    return view, time.monotonic() - started


@contextmanager
def healthz_answers(service: Service) -> Iterator[list[tuple[int, float]]]:
    """``GET /healthz`` every 50 ms from a thread while the block runs: each answer's (status, seconds).

    A thread here rather than ``tests.probe``'s process: the views this module reads are small (capped output), so
    the thread times the service, not this process; and the probe process prints its ``latency`` and ``stall``
    lines from two threads, which may interleave (``ProbeFailed: 0.0039...`` seen once here)."""
    answers: list[tuple[int, float]] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=service.url, timeout=30) as client:
            while not done.is_set():
                began = time.perf_counter()
                try:
                    status = client.get("/healthz").status_code
                except httpx.HTTPError:
                    status = 0
                answers.append((status, time.perf_counter() - began))
                done.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield answers
    finally:
        done.set()
        thread.join(60)


def assert_responsive(answers: list[tuple[int, float]]) -> None:
    """Every ``/healthz`` answer was 200 within ``HEALTHZ_BOUND_S``, and there were a few."""
    slowest = sorted(seconds for _, seconds in answers)[-5:]
    assert len(answers) > 2 and all(status == 200 for status, _ in answers), answers[-5:]
    assert max(slowest) < HEALTHZ_BOUND_S, (len(answers), slowest)


def outcome(view: dict[str, Any]) -> tuple[Any, Any]:
    """A job's status and the type of its error (None without one): what a JavaScript job and its Python twin
    must share."""
    return view["status"], (view["error"] or {}).get("type")


# A later script of a session: every process but pid 1 and itself (with its command line), whether a leftover
# beats in /tmp/beat*, then one tool call. Nothing of an earlier script may be seen, write here, or call.
LOOK = """
import fs from "node:fs";
import tools from "tools";
const others = () =>
  fs.readdirSync("/proc")
    .filter((p) => /^\\d+$/.test(p) && +p !== 1 && +p !== process.pid)
    .map((p) => {
      try {
        return `${p}:${fs.readFileSync(`/proc/${p}/cmdline`, "latin1").split("\\0").join(" ").trim()}`;
      } catch (error) {
        return `${p}:${error.code}`;
      }
    });
const beats = () =>
  fs.readdirSync("/tmp")
    .filter((name) => name.startsWith("beat"))
    .map((name) => fs.readFileSync(`/tmp/${name}`, "utf8"));
const found = others();
const before = beats();
await new Promise((resolve) => setTimeout(resolve, 600));
const after = beats();
found.push(...others());
console.log(JSON.stringify({ others: [...new Set(found)], beating: JSON.stringify(before) !== JSON.stringify(after) }));
console.log(JSON.stringify((await tools.echo({ x: 1 })).args));
"""
LOOK_CLEAN = '{"others":[],"beating":false}\n{"x":1}\n'


def assert_nothing_left(api: httpx.Client, session_id: str) -> None:
    """The session's next script sees no process of the earlier ones, nothing beating, no forged output or call."""
    view = run_js(api, LOOK, session_id=session_id, timeout_s=20)
    assert (view["status"], view["stdout"]) == ("succeeded", LOOK_CLEAN), view
    assert [(call["tool"], call["args"]) for call in view["calls"]] == [("echo", {"x": 1})], view["calls"]
    assert api.get(f"/sessions/{session_id}").json()["status"] == "ready"


# -- endless loops ---------------------------------------------------------------------------------------------------

LOOPS = {
    "sync": "while (true) {}",
    "microtasks": "for (;;) await null;",
    "macrotasks": "for (;;) await new Promise((resolve) => setImmediate(resolve));",
    "timer_with_sigterm_ignored": 'process.on("SIGTERM", () => console.log("ignored"));\nsetInterval(() => {}, 1000);',
}


@pytest.fixture(scope="module")
def python_loop(js: httpx.Client) -> dict[str, Any]:
    """The view of Python's endless loop (``test_bad_input.py``'s) with ``timeout_s`` 3, on this module's service."""
    view = execute(js, "print('looping', flush=True)\nwhile True:\n    pass\n", timeout_s=3)
    assert outcome(view) == ("timed_out", "timeout") and view["stdout"] == "looping\n", view
    return view


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_endless_loops_time_out_like_python(js: httpx.Client, python_loop: dict[str, Any], loop: str) -> None:
    python = python_loop
    # From the warm pool: a cold sandbox's start counts against timeout_s (under gVisor on a loaded host it took
    # 1.99 s of a 2 s timeout, and node never printed), for Python as for JavaScript.
    wait_until(lambda: node_pool_ready(js), 60)
    view, elapsed = timed(lambda: run_js(js, 'console.log("looping");\n' + LOOPS[loop], timeout_s=3))
    assert (*outcome(view), view["exit_code"]) == (*outcome(python), python["exit_code"]), view
    assert view["stdout"] == "looping\n", view
    assert elapsed < 3 + 3, elapsed


# -- memory ----------------------------------------------------------------------------------------------------------

BOMBS = {
    "arrays": "const kept = [];\nfor (;;) kept.push(new Array(1 << 20).fill(Math.random()));",
    "strings": "const kept = [];\nfor (let i = 0; ; i++) kept.push('x'.repeat(1 << 20) + i);",
    "buffers": "const kept = [];\nfor (;;) kept.push(Buffer.alloc(1 << 24, 1));",
    "one_buffer": "const big = Buffer.alloc(300 * 1024 * 1024, 1);",
}


@pytest.fixture(scope="module")
def python_bomb(js: httpx.Client) -> dict[str, Any]:
    """The view of Python's memory bomb (``test_bad_input.py``'s) in 128 MiB, on this module's service."""
    script = "x = bytearray(b'1') * (300 * 1024 * 1024)\nprint('survived')"
    view = execute(js, script, limits={"memory_mb": 128}, timeout_s=30)
    assert outcome(view) == ("oom_killed", "oom") and "survived" not in view["stdout"], view
    return view


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_memory_bombs_end_as_pythons_does(js: httpx.Client, python_bomb: dict[str, Any], bomb: str) -> None:
    python = python_bomb
    view = run_js(js, BOMBS[bomb] + '\nconsole.log("survived");', limits={"memory_mb": 128}, timeout_s=30)
    # Status and error, not the exit code: once in ~30 runs under gVisor the strings bomb was oom_killed with
    # exit_code 2 (the script's process, not the container), where Python's and every other run's was 137.
    assert outcome(view) == outcome(python), view
    assert "survived" not in view["stdout"], view


# -- processes that try to outlive their run -------------------------------------------------------------------------

# A leftover node process that haunts the later scripts, as test_session_isolation.py's GHOST: beats in /tmp, writes
# into every other process's stdout, and sends a forged call to the broker, every 20 ms.
GHOST = r"""
const fs = require("fs"), net = require("net");
let beat = 0;
setInterval(() => {
  fs.writeFileSync("/tmp/beat-ghost", String(++beat));
  for (const p of fs.readdirSync("/proc")) {
    if (/^\d+$/.test(p) && +p !== 1 && +p !== process.pid) {
      try { fs.appendFileSync(`/proc/${p}/fd/1`, "FORGED\n"); } catch {}
    }
  }
  const s = net.createConnection("/run/ptc/tools.sock");
  s.on("error", () => {});
  s.on("connect", () => {
    s.write('{"id": 1, "tool": "echo", "args": {"x": 666}}\n');
    setTimeout(() => s.destroy(), 50);
  });
}, 20);
"""
ESCAPES = """
import { execSync, spawn } from "node:child_process";
const quiet = { stdio: "ignore", detached: true };
execSync("sh -c 'sleep 1000 >/dev/null 2>&1 &'");
execSync("sh -c '(sh -c \\"sleep 1001\\" &) ; true' >/dev/null 2>&1");
spawn("sleep", ["1002"], quiet).unref();
spawn("setsid", ["-f", "sh", "-c", "exec sleep 1003"], { stdio: "ignore" }).unref();
spawn("nohup", ["sleep", "1004"], quiet).unref();
spawn("sh", ["-c", "trap '' TERM HUP INT; while :; do date +%s%N > /tmp/beat-sh; sleep 0.02; done"], quiet).unref();
spawn("sh", ["-c", "while :; do echo LEAKED; sleep 0.02; done"], { stdio: "inherit", detached: true }).unref();
spawn(process.execPath, ["-e", GHOST], quiet).unref();
await new Promise((resolve) => setTimeout(resolve, 300));
console.log("spawned");
"""


def test_child_processes_do_not_outlive_their_script(js: httpx.Client) -> None:
    script = ESCAPES.replace("GHOST", json.dumps(GHOST))
    with js_session(js) as session_id:
        first, elapsed = timed(lambda: run_js(js, script, session_id=session_id, timeout_s=10))
        # The script ends when node does: what it left behind is killed, not waited for. (Its LEAKED lines while it
        # runs are its own output; none may reach a later job.)
        assert first["status"] == "succeeded" and "spawned\n" in first["stdout"], first
        assert elapsed < 8, (elapsed, first)
        assert_nothing_left(js, session_id)
        assert_nothing_left(js, session_id)


# -- worker threads and timers ---------------------------------------------------------------------------------------

WORKERS = {
    # A worker that keeps the process alive: the job lasts until its timeout, as a Python thread that never ends.
    "worker_forever": (
        'import { Worker } from "node:worker_threads";\n'
        "new Worker('setInterval(() => console.log(\"TICK\"), 5);', { eval: true });\n"
        'console.log("main done");\n',
        "timed_out",
    ),
    # An unref'd worker: the script ends with its main thread, the worker with it.
    "worker_unref": (
        'import { Worker } from "node:worker_threads";\n'
        "const w = new Worker('setInterval(() => console.log(\"TICK\"), 5);', { eval: true });\n"
        "w.unref();\n"
        'console.log("main done");\n',
        "succeeded",
    ),
    # process.exit with a worker running.
    "worker_then_exit": (
        'import { Worker } from "node:worker_threads";\n'
        "new Worker('setInterval(() => console.log(\"TICK\"), 5);', { eval: true });\n"
        'console.log("main done");\n'
        "setTimeout(() => process.exit(0), 300);\n",
        "succeeded",
    ),
    # A timer that prints after the script's last line.
    "interval_forever": ('setInterval(() => console.log("TICK"), 5);\nconsole.log("main done");\n', "timed_out"),
}


@pytest.mark.parametrize("kind", sorted(WORKERS))
def test_workers_and_timers_do_not_outlive_their_run(js: httpx.Client, kind: str) -> None:
    script, status = WORKERS[kind]
    with js_session(js) as session_id:
        first, elapsed = timed(lambda: run_js(js, script, session_id=session_id, timeout_s=3))
        assert first["status"] == status, first
        assert first["stdout"].startswith("main done\n"), first
        assert elapsed < 3 + 3, (elapsed, first)
        assert_nothing_left(js, session_id)  # its stdout holds no TICK


# -- the filesystem --------------------------------------------------------------------------------------------------

FS = """
import fs from "node:fs";
const out = {};
const attempt = (name, fn) => {
  try {
    const got = fn();
    out[name] = got === undefined ? "allowed" : got;
  } catch (error) {
    out[name] = error.code;
  }
};
attempt("read /etc/shadow", () => fs.readFileSync("/etc/shadow").length && "read");
for (const path of ["/run/ptc/x", "/run/ptc/tools.mjs", "/run/ptc/script.mjs", "/opt/ptc/x",
                    "/opt/ptc/ptc_runtime/js/client.mjs", "/etc/x", "/usr/lib/x", "/x"]) {
  attempt("write " + path, () => fs.writeFileSync(path, "export default 666;\\n"));
}
attempt("unlink /run/ptc/tools.sock", () => fs.unlinkSync("/run/ptc/tools.sock"));
attempt("mkdir /run/ptc/d", () => fs.mkdirSync("/run/ptc/d"));
for (const name of ["environ", "mem", "maps", "auxv"]) {
  attempt("/proc/1/" + name, () => fs.readFileSync("/proc/1/" + name).includes(process.env.MARK) ? "leaked" : "read");
}
attempt("/proc/1/fd", () => fs.readdirSync("/proc/1/fd").length && "listed");
attempt("/proc/1/root", () => fs.readdirSync("/proc/1/root").length && "listed");
attempt("/proc/1/cwd", () => fs.readdirSync("/proc/1/cwd").length && "listed");
attempt("write /proc/1/fd/1", () => fs.appendFileSync("/proc/1/fd/1", "FORGED through the interpreter\\n"));
attempt("service paths in mountinfo", () => fs.readFileSync("/proc/self/mountinfo", "utf8").includes(process.env.WORK));
attempt("write /tmp/ok", () => fs.writeFileSync("/tmp/ok", "x"));
console.log(JSON.stringify(out));
"""
REFUSED = {"EACCES", "EPERM", "EROFS"}


def test_the_filesystem_outside_tmp_is_closed(js: httpx.Client, hostile_service: Service, js_runtime: str) -> None:
    mark = "ptc-mark-" + secrets.token_hex(8)
    work = str(hostile_service.work_dir.parent)
    with js_session(js, env={"MARK": mark}) as session_id:
        view = run_js(js, FS, session_id=session_id, env={"WORK": work})
        assert view["status"] == "succeeded", view
        out = json.loads(view["stdout"])
        assert out.pop("write /tmp/ok") == "allowed", out
        assert out.pop("service paths in mountinfo") is False, out
        if js_runtime == "runsc":  # as test_session_isolation.py finds: gVisor lets any user read these of pid 1,
            # which hold nothing of a run or a session (its env holds no MARK: "read", not "leaked")
            readable = {"/proc/1/environ": "read", "/proc/1/maps": "read", "/proc/1/auxv": "read"}
            expected = {**readable, "/proc/1/fd": "listed"}
            assert {name: out.pop(name) for name in expected} == expected, out
        refused = {name: code for name, code in out.items() if code not in REFUSED}
        assert refused == {}, out
        assert "FORGED" not in hostile_service.log()
        assert_nothing_left(js, session_id)  # and tools.mjs is still the tools module


# -- the network -----------------------------------------------------------------------------------------------------

NET = """
import net from "node:net";
import dgram from "node:dgram";
import dns from "node:dns";
import fs from "node:fs";
const out = {};
const connect = (options) =>
  new Promise((resolve) => {
    const socket = net.createConnection(options);
    socket.setTimeout(3000);
    socket.on("connect", () => { socket.destroy(); resolve("connected"); });
    socket.on("error", (error) => resolve(error.code));
    socket.on("timeout", () => { socket.destroy(); resolve("timeout"); });
  });
out.tool_server = await connect({ host: "127.0.0.1", port: TOOL_PORT });
out.service = await connect({ host: "127.0.0.1", port: SERVICE_PORT });
out.gateway = await connect({ host: "172.17.0.1", port: TOOL_PORT });
out.public = await connect({ host: "1.1.1.1", port: 443 });
out.ipv6 = await connect({ host: "::1", port: TOOL_PORT });
try {
  await dns.promises.lookup("example.com");
  out.lookup = "resolved";
} catch (error) {
  out.lookup = error.code;
}
try {
  await dns.promises.resolve4("example.com");
  out.resolve = "resolved";
} catch (error) {
  out.resolve = error.code;
}
try {
  await fetch("http://example.com", { signal: AbortSignal.timeout(5000) });
  out.fetch = "fetched";
} catch (error) {
  out.fetch = `${error.name}`;
}
out.udp = await new Promise((resolve) => {
  const socket = dgram.createSocket("udp4");
  socket.send(Buffer.from("x"), 53, "8.8.8.8", (error) => { socket.close(); resolve(error ? error.code : "sent"); });
});
const abstract = fs.readFileSync("/proc/net/unix", "utf8").split("\\n").slice(1)
  .map((line) => line.trim().split(/\\s+/)[7]).filter((path) => path && path.startsWith("@"));
out.abstract = [];
for (const path of abstract) {
  if ((await connect({ path: "\\0" + path.slice(1) })) === "connected") out.abstract.push(path);
}
out.broker = await connect({ path: "/run/ptc/tools.sock" });
out.control = await new Promise((resolve) => {
  const socket = net.createConnection("/run/ptc/control.sock");
  let said = "";
  socket.setEncoding("utf8");
  socket.on("connect", () => socket.write('{"op": "hello", "pid": 1, "features": []}\\n'));
  socket.on("data", (chunk) => { said += chunk; });
  socket.on("error", (error) => resolve(["EPIPE", "ECONNRESET"].includes(error.code) ? "closed" : error.code));
  socket.on("close", () => resolve(said ? `answered ${said.slice(0, 100)}` : "closed"));
  setTimeout(() => { socket.destroy(); resolve(said ? `answered ${said.slice(0, 100)}` : "open"); }, 3000);
});
console.log(JSON.stringify(out));
"""


def test_no_network_but_the_brokers_socket(js: httpx.Client, hostile_service: Service, tool_server: ToolServer) -> None:
    tool_port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    service_port = hostile_service.url.rsplit(":", 1)[1]
    script = NET.replace("TOOL_PORT", tool_port).replace("SERVICE_PORT", service_port)
    view = run_js(js, script, timeout_s=30)
    assert view["status"] == "succeeded", view
    out = json.loads(view["stdout"])
    assert out.pop("broker") == "connected", out
    assert out.pop("abstract") == [], out
    assert out.pop("fetch") == "TypeError", out  # undici's "fetch failed"
    assert out.pop("lookup") in ("ENOTFOUND", "EAI_AGAIN"), out
    assert out.pop("resolve") in ("ECONNREFUSED", "ETIMEOUT", "ENOTFOUND", "ESERVFAIL", "EREFUSED"), out
    assert out.pop("control") == "closed", out  # the sandbox's interpreter holds the one control connection
    unreachable = ("ECONNREFUSED", "ENETUNREACH", "EHOSTUNREACH")  # nothing listens on its own loopback; no route out
    reached = {name: code for name, code in out.items() if code not in unreachable}
    assert reached == {}, out


# -- a polluted language ---------------------------------------------------------------------------------------------

POLLUTIONS = {
    "object_prototype": """
for (const name of ["id", "ok", "tool", "args", "result", "error", "op", "type", "message"]) {
  Object.defineProperty(Object.prototype, name, { get() { return 666; }, set() {}, configurable: true });
}
""",
    "array_prototype": """
Array.prototype.pop = function () { return ""; };
Array.prototype.push = function () { return 0; };
Array.prototype[Symbol.iterator] = function* () {};
""",
    "json": """
JSON.stringify = () => '{"tool": "echo", "args": {"x": 666}}';
JSON.parse = () => ({ id: 1, ok: true, result: "FORGED" });
""",
    "promise": """
globalThis.Promise = class extends Promise {
  constructor(run) { super((resolve, reject) => run(() => resolve({ ok: true, result: "FORGED" }), reject)); }
};
""",
    "map": """
Map.prototype.get = function () { return undefined; };
Map.prototype.set = function () { return this; };
Map.prototype.delete = function () { return true; };
""",
    "string_prototype": """
String.prototype.slice = function () { return '"tool": "echo", "args": {"x": 666}}'; };
String.prototype.split = function () { return ['{"id": 1, "ok": true, "result": "FORGED"}', ""]; };
String.prototype.replace = function () { return '{"tool": "echo", "args": {"x": 666}}'; };
""",
    "tools_object": """
const attempts = [
  () => { tools.echo = async () => ({ args: { x: 666 } }); },
  () => Object.defineProperty(tools, "echo", { value: async () => ({ args: { x: 666 } }) }),
  () => { delete tools.echo; },
  () => Object.setPrototypeOf(tools, { echo: async () => ({ args: { x: 666 } }) }),
  () => { tools.echo.call = () => 666; },
];
for (const attempt of attempts) {
  try { attempt(); } catch (error) { if (!(error instanceof TypeError)) throw error; }
}
""",
}
# The calls a polluted script still makes: two awaited one after the other, two in flight at once. What the script
# itself uses is taken before it pollutes (and no array is iterated, pushed or popped), so that only the runtime's
# client meets the pollution.
CALLS = """
import tools from "tools";
const show = JSON.stringify;
const write = process.stdout.write.bind(process.stdout);
const seen = [];
const note = (value) => { seen[seen.length] = value; };
const settle = async (promise) => {
  try {
    const result = await promise;
    note(result !== null && typeof result === "object" && "args" in result ? result.args.x : show(result));
  } catch (error) {
    note(`${error.type}: ${error.message}`);
  }
};
POLLUTE
await settle(tools.echo({ x: 1 }));
await settle(tools.echo({ x: 2 }));
const three = tools.echo({ x: 3 });
const four = tools.echo({ x: 4 });
await settle(three);
await settle(four);
write(show(seen) + "\\n");
"""
CLEAN_LANGUAGE = """
import tools from "tools";
const probe = {};
console.log(JSON.stringify({
  polluted: ["id", "ok", "tool", "args", "result", "error"].filter((name) => name in probe),
  array: [3, 1, 2].sort().pop(),
  json: JSON.parse(JSON.stringify({ a: [1] })),
  map: new Map([[1, 2]]).get(1),
  split: "a,b".split(","),
  promise: (async () => {})() instanceof Promise,
  echo: (await tools.echo({ x: 5 })).args,
}));
"""


@pytest.mark.parametrize("pollution", sorted(POLLUTIONS))
def test_a_polluted_language_cannot_forge_calls_or_reach_the_next_script(js: httpx.Client, pollution: str) -> None:
    script = CALLS.replace("POLLUTE", POLLUTIONS[pollution])
    with js_session(js) as session_id:
        view, elapsed = timed(lambda: run_js(js, script, session_id=session_id, timeout_s=5))
        later = run_js(js, CLEAN_LANGUAGE, session_id=session_id)
    # The session's next script starts from a clean language: the pollution ended with its process.
    assert later["status"] == "succeeded", later
    assert json.loads(later["stdout"]) == {
        "polluted": [],
        "array": 3,
        "json": {"a": [1]},
        "map": 2,
        "split": ["a", "b"],
        "promise": True,
        "echo": {"x": 5},
    }, later
    assert [(call["tool"], call["args"]) for call in later["calls"]] == [("echo", {"x": 5})], later
    # The broker's records are the truth, and they are the calls the script made: the arguments it gave, in order.
    records = [(call["tool"], call["args"], call["status"]) for call in view["calls"]]
    made = [("echo", {"x": x}, "ok") for x in (1, 2, 3, 4)]
    assert records and records == made[: len(records)], (records, view)
    # The runtime's client took what it uses of the language before the script ran ("a script that replaces
    # JSON.stringify, Promise or Map later cannot change how its calls are sent or matched", js/client.mjs): every
    # call is sent, answered and matched as without the pollution, and the script ends as it would.
    assert (view["status"], view["stdout"], len(records)) == ("succeeded", "[1,2,3,4]\n", 4), view
    assert elapsed < 4, (elapsed, view)


# -- the broker's socket, spoken to directly -------------------------------------------------------------------------

RAW = """
import net from "node:net";
import { once } from "node:events";
import tools from "tools";
const open = async () => {
  const socket = net.createConnection("/run/ptc/tools.sock");
  socket.setEncoding("utf8");
  socket.on("error", () => {});
  await once(socket, "connect");
  return socket;
};
const lines = (socket, count) =>
  new Promise((resolve) => {
    let text = "";
    const done = () => resolve(text.split("\\n").filter(Boolean));
    socket.on("data", (chunk) => { text += chunk; if (text.split("\\n").length > count) done(); });
    socket.on("close", done);
    setTimeout(done, 5000);
  });
// Malformed lines: each answered with a structured error (bad_request), none taken as a call.
const malformed = await open();
const answers = lines(malformed, 6);
malformed.write('not json\\n[1]\\n{"id": [1], "tool": 5}\\n{"id": 7, "tool": "echo", "args": {"x": NaN}}\\n');
malformed.write('{"id": 8, "op": "report", "error": {"type": "timeout", "message": "forged"}}\\n');
malformed.write('{"id": 9, "tool": "echo", "args": {"x": 9}}\\n');
for (const line of await answers) {
  const reply = JSON.parse(line);
  console.log(reply.id ?? null, reply.ok, reply.ok ? JSON.stringify(reply.result) : reply.error.type);
}
malformed.destroy();
// A line longer than the broker takes (1 MiB): the connection is closed.
const huge = await open();
const closed = new Promise((resolve) => {
  huge.on("close", () => resolve("closed"));
  setTimeout(() => resolve("open"), 10000);
});
huge.write("x".repeat(2 * 1024 * 1024));
console.log(await closed);
// The runtime's own client still works.
console.log(JSON.stringify((await tools.echo({ x: 10 })).args));
// A flood of calls whose replies are never read: the broker stops reading, the writes stop draining.
const flood = await open();
flood.pause();
const batch = '{"id": 2, "tool": "echo", "args": {}}\\n'.repeat(1000);
let blocked = false;
for (let i = 0; i < 10000 && !blocked; i++) {
  if (!flood.write(batch)) {
    const stuck = new Promise((resolve) => setTimeout(resolve, 3000, true));
    blocked = await Promise.race([once(flood, "drain").then(() => false), stuck]);
  }
}
console.log(blocked ? "blocked" : "never blocked");
flood.destroy();
"""


def test_the_brokers_socket_spoken_to_directly(js: httpx.Client) -> None:
    view, elapsed = timed(lambda: run_js(js, RAW, [ECHO], timeout_s=30))
    assert elapsed < 20, (elapsed, view)
    assert view["status"] == "succeeded", view
    lines = view["stdout"].splitlines()
    assert lines[:6] == [
        "null false bad_request",
        "null false bad_request",
        "null false bad_request",
        "null false bad_request",
        "8 true null",
        '9 true {"tool":"echo","args":{"x":9}}',
    ], view
    assert lines[6:] == ["closed", '{"x":10}', "blocked"], view
    assert view["error"] is None, view  # the forged report of a script that succeeded changes nothing
    calls = view["calls"]
    assert [(c["tool"], c["args"]) for c in calls[:2]] == [("echo", {"x": 9}), ("echo", {"x": 10})], calls[:3]
    assert len(calls) == CALL_CAP and all(c["tool"] == "echo" for c in calls), len(calls)
    assert view["calls_over_limit"] > 0, view


CAPPED_JS = """
import tools from "tools";
const refused = [];
for (let x = 0; x < CAP + 3; x++) {
  try {
    await tools.echo({ x });
  } catch (error) {
    refused.push(`${error.type} | ${error.message}`);
  }
}
console.log(refused.join("\\n"));
"""
CAPPED_PY = """
import tools
refused = []
for x in range(CAP + 3):
    try:
        tools.echo(x=x)
    except tools.ToolError as e:
        refused.append(f"{e.type} | {e.message}")
print("\\n".join(refused))
"""


def test_calls_past_the_cap_are_refused_as_pythons_are(js: httpx.Client) -> None:
    python = execute(js, CAPPED_PY.replace("CAP", str(CALL_CAP)), [ECHO], timeout_s=60)
    view = run_js(js, CAPPED_JS.replace("CAP", str(CALL_CAP)), [ECHO], timeout_s=60)
    refusal = f"limit_exceeded | this job may make at most {CALL_CAP} tool calls\n"
    assert (python["status"], python["stdout"]) == ("succeeded", refusal * 3), python
    assert (view["status"], view["stdout"]) == ("succeeded", refusal * 3), view
    assert [c["args"]["x"] for c in view["calls"]] == list(range(CALL_CAP)), len(view["calls"])
    assert view["calls_over_limit"] == python["calls_over_limit"] == 3, view


# -- output floods ---------------------------------------------------------------------------------------------------

FLOODS = {
    # (JavaScript, Python writing the same bytes)
    "console_log": (
        'for (let i = 0; i < 100000; i++) console.log(String(i).padStart(99, "0"));\n'
        'process.stderr.write("e".repeat(1000));\n',
        "import sys\nfor i in range(100_000):\n    sys.stdout.write('%099d\\n' % i)\nsys.stderr.write('e' * 1000)\n",
    ),
    "one_write": (
        'process.stdout.write("a".repeat(5_000_000) + "b".repeat(5_000_000));\n'
        'process.stderr.write("e".repeat(1000));\n',
        "import sys\nsys.stdout.write('a' * 5_000_000 + 'b' * 5_000_000)\nsys.stderr.write('e' * 1000)\n",
    ),
    "stderr": (
        'for (let i = 0; i < 100000; i++) console.error(String(i).padStart(99, "0"));\nconsole.log("out");\n',
        "import sys\nfor i in range(100_000):\n    sys.stderr.write('%099d\\n' % i)\nprint('out')\n",
    ),
}
SHOWN = (
    *("status", "exit_code", "stdout", "stdout_bytes", "stdout_truncated", "stdout_invalid_utf8"),
    *("stderr", "stderr_bytes", "stderr_truncated", "stderr_invalid_utf8"),
)
"""The fields of a view that a flood and its Python twin (the same bytes) must share."""


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_output_floods_are_capped_as_pythons_are(js: httpx.Client, hostile_service: Service, flood: str) -> None:
    script, twin = FLOODS[flood]
    python = execute(js, twin, timeout_s=60)
    with healthz_answers(hostile_service) as answers:
        view = run_js(js, script, timeout_s=60)
    assert python["status"] == "succeeded" and (python["stdout_truncated"] or python["stderr_truncated"]), python
    assert {k: view[k] for k in SHOWN} == {k: python[k] for k in SHOWN}, view
    assert len(view["stdout"].encode()) < 64 * 1024 + 100 and len(view["stderr"].encode()) < 64 * 1024 + 100
    assert_responsive(answers)


FLOOD_TIMEOUT_S = 8  # a cold gVisor sandbox's node start on a loaded 2-CPU host took 2 s of a 3 s timeout (CI)


def test_an_endless_flood_ends_at_its_timeout(js: httpx.Client, hostile_service: Service) -> None:
    script = 'const line = "y".repeat(1000);\nfor (;;) console.log(line);\n'
    with healthz_answers(hostile_service) as answers:
        view, elapsed = timed(lambda: run_js(js, script, timeout_s=FLOOD_TIMEOUT_S))
    assert outcome(view) == ("timed_out", "timeout"), view
    assert view["stdout_truncated"] is True and view["stdout_bytes"] > 1_000_000, view
    assert view["stdout"].startswith("y" * 1000 + "\n") and "bytes elided" in view["stdout"], view["stdout"][:100]
    assert elapsed < FLOOD_TIMEOUT_S + 5, elapsed
    assert_responsive(answers)


# -- fork bombs ------------------------------------------------------------------------------------------------------

FORK_BOMBS = {
    "spawn_loop": (
        'import { spawn } from "node:child_process";\n'
        "for (;;) {\n"
        '  try { spawn("sleep", ["1000"], { stdio: "ignore" }).on("error", () => {}); } catch {}\n'
        "  await new Promise((resolve) => setImmediate(resolve));\n"
        "}\n"
    ),
    "shell": (
        'import { spawn } from "node:child_process";\n'
        'spawn("sh", ["-c", "b() { b | b & }; b"], { stdio: "ignore" }).on("error", () => {});\n'
        "setInterval(() => {}, 1000);\n"
    ),
    "node_children": (
        'import { spawn } from "node:child_process";\n'
        "const bomb = \"const { spawn } = require('child_process'); setInterval(() => { try { spawn(process.execPath, "
        "['-e', process.argv[1], process.argv[1]], { stdio: 'ignore' }).on('error', () => {}); } catch {} }, 10);\";\n"
        'spawn(process.execPath, ["-e", bomb, bomb], { stdio: "ignore" }).on("error", () => {});\n'
        "setInterval(() => {}, 1000);\n"
    ),
}


@pytest.mark.parametrize("bomb", sorted(FORK_BOMBS))
def test_fork_bombs_are_contained(js: httpx.Client, bomb: str) -> None:
    with js_session(js) as session_id:
        script = 'console.log("bombing");\n' + FORK_BOMBS[bomb]
        view, elapsed = timed(lambda: run_js(js, script, session_id=session_id, timeout_s=3))
        # How far a bomb gets before the pids limit (or, under gVisor, the memory limit) differs; it ends as the job's.
        assert view["status"] in ("timed_out", "failed", "oom_killed"), view
        assert view["error"] is None or view["error"]["type"] != "sandbox_error", view
        assert view["stdout"].startswith("bombing\n"), view
        assert elapsed < 3 + 5, (elapsed, view)
        assert_nothing_left(js, session_id)


SPAWN_UNTIL_REFUSED = """
import { spawn } from "node:child_process";
let spawned = 0;
let refused = null;
while (refused === null && spawned < 1000) {
  const child = spawn("sleep", ["1000"], { stdio: "ignore" });
  refused = await new Promise((resolve) => {
    child.on("spawn", () => resolve(null));
    child.on("error", (error) => resolve(error.code));
  });
  if (refused === null) {
    spawned++;
    child.unref();
  }
}
console.log(spawned, refused);
"""
SPAWN_UNTIL_REFUSED_PY = """
import subprocess
spawned = 0
try:
    while spawned < 1000:
        subprocess.Popen(['sleep', '1000'])
        spawned += 1
except OSError as e:
    print(spawned, e.errno == 11 and 'EAGAIN')
"""


def test_processes_are_bounded_by_the_pids_limit(js: httpx.Client) -> None:
    """A script that starts processes until refused: refused with EAGAIN below the sandbox's pids limit (128 by
    default; under gVisor a quarter of it, counted in gVisor's kernel with each process's threads), as Python's is;
    the job then ends as the script does, its processes killed."""
    python = execute(js, SPAWN_UNTIL_REFUSED_PY, timeout_s=30)
    view, elapsed = timed(lambda: run_js(js, SPAWN_UNTIL_REFUSED, timeout_s=30))
    assert python["status"] == "succeeded" and python["stdout"].endswith(" EAGAIN\n"), python
    assert view["status"] == "succeeded" and view["stdout"].endswith(" EAGAIN\n"), view
    spawned = int(view["stdout"].split()[0])
    assert 0 < spawned < 128, view
    assert elapsed < 20, elapsed
