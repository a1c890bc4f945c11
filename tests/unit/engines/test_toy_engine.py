"""The engine seam, proved by an engine no module of the service knows: a toy in-process interpreter registered here.

Its language has one command a line: ``print <text>``, ``warn <text>`` (stderr), ``call <tool> <JSON arguments>``
(through the broker's call port, in this process: the result printed as JSON, a failure to stderr and exit 1),
``read <path>`` (a file the request gave), ``sleep <seconds>``, ``exit <code>``, ``tools`` (the stubs it was given),
``raise <type> <message>`` (reported to the broker as the runtime's report, then exit 1).
It is one class (``ToyEngine``) and one row of the engines' table (``create_app(engines=...)``): the jobs it runs go
through the real admission, runner, broker, views and store, with nothing else changed for it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.composition.engine_table import ENGINES
from service.engines import CallPort, Engine, EngineRun, EngineSite, ExitStatus, OutputSink, Sandbox
from service.errors import NoSuchFile, SandboxError
from service.sandbox.fake import FakeBackend
from service.sandbox.ports import Held, OutputCollector
from service.sandbox.spec import SandboxLimits
from service.settings import Settings
from service.toolkit.cache import CompiledManifest

TOY = "toy"
TOOLS = [
    {"name": "echo", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}},
    {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}},
]
SIGNALS = {"SIGTERM": 15, "SIGKILL": 9}


class ToyRun:
    """One toy script running as a task of the event loop."""

    def __init__(self, lines: list[str], port: CallPort, files: Mapping[str, bytes], sink: OutputSink) -> None:
        self.exit: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self._signalled: int | None = None
        self._sink = sink
        self._task = asyncio.ensure_future(self._interpret(lines, port, files, sink))
        self._task.add_done_callback(self._ended)

    async def _interpret(self, lines: list[str], port: CallPort, files: Mapping[str, bytes], sink: OutputSink) -> int:
        for line in lines:
            command, _, rest = line.strip().partition(" ")
            if command == "print":
                sink("stdout", rest.encode() + b"\n")
            elif command == "warn":
                sink("stderr", rest.encode() + b"\n")
            elif command == "call":
                tool, _, args = rest.partition(" ")
                reply = await port.call(tool, json.loads(args or "{}"))
                if not reply["ok"]:
                    sink("stderr", f"error {reply['error']['type']}: {reply['error']['message']}\n".encode())
                    return 1
                sink("stdout", json.dumps(reply["result"], sort_keys=True).encode() + b"\n")
            elif command == "read":
                sink("stdout", files[rest] + b"\n")
            elif command == "sleep":
                await asyncio.sleep(float(rest))
            elif command == "exit":
                return int(rest)
            elif command == "raise":
                kind, _, message = rest.partition(" ")
                port.report({"type": kind, "message": message})
                return 1
            elif command == "tools":
                sink("stdout", files.get(".stubs", b""))
            elif command:
                sink("stderr", f"unknown command {command!r}\n".encode())
                return 2
        return 0

    def _ended(self, task: asyncio.Task[int]) -> None:
        if self.exit.done():
            return
        if task.cancelled():
            number = self._signalled or 9
            self.exit.set_result(ExitStatus(128 + number, oom_killed=False, killed=True))
        elif (error := task.exception()) is not None:  # the toy's own fault: reported as a crash would be
            self._sink("stderr", f"toy: {error!r}\n".encode())
            self.exit.set_result(ExitStatus(70, oom_killed=False))
        else:
            self.exit.set_result(ExitStatus(task.result(), oom_killed=False))

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self.exit)

    async def signal(self, signal: str) -> None:
        if not self._task.done():
            self._signalled = SIGNALS[signal]
            self._task.cancel()

    async def kill(self) -> None:
        await self.signal("SIGKILL")


class ToySandbox:
    """A toy sandbox: the script, stubs and files in memory, calls through the port it was connected to."""

    def __init__(self, name: str, env: Mapping[str, str]) -> None:
        self.started = True
        self.sandbox_id: str | None = name
        self.broken: str | None = None
        self.stop_reason = "session"
        self.hash_seed: int | None = None
        self.destroyed = False
        self.env = dict(env)
        self.files: dict[str, bytes] = {}
        self._lines: list[str] = []
        self._port: CallPort | None = None

    async def start(self) -> None:
        self.started = True

    async def lay_out(self, script: str, stubs: str | None, language: str = TOY) -> None:
        self._lines = script.splitlines()
        if stubs is not None:
            self.files[".stubs"] = stubs.encode()

    async def connect(self, port: CallPort) -> None:
        self._port = port

    async def put_files(self, files: list[tuple[str, bytes]]) -> None:
        self.files.update(files)

    async def run(
        self, job_id: str, env: dict[str, str], sink: OutputSink, outputs: OutputCollector | None = None
    ) -> EngineRun:
        assert self._port is not None, "connect comes before run"
        if outputs is not None:
            outputs.end()  # no files in outputs/
        return ToyRun(self._lines, self._port, self.files, sink)

    async def get_file_into(self, path: str, max_bytes: int, into: IO[bytes]) -> int:
        if path not in self.files:
            raise NoSuchFile(path)
        into.write(self.files[path])
        return len(self.files[path])

    async def list_files(self, max_entries: int) -> tuple[list[dict[str, Any]], bool]:
        names = sorted(name for name in self.files if not name.startswith("."))
        return [{"path": name, "bytes": len(self.files[name]), "skipped": None} for name in names], False

    def forget_env(self) -> None:
        self.env = {}

    async def destroy(self, reason: str | None = None) -> None:
        self.broken = self.broken or reason
        self.destroyed = True


class ToyEngine(Engine):
    """The toy engine: every job's sandbox made on the spot, nothing held on the host."""

    name = TOY
    languages = (TOY,)
    kill_confirm_s = 1.0

    def __init__(self) -> None:
        self.sandboxes: list[ToySandbox] = []

    def stubs(self, manifest: CompiledManifest, language: str) -> str:
        assert language == TOY
        return "".join(f"{name}\n" for name in sorted(manifest.tools))

    def take(self, job_id: str, owner: str, limits: SandboxLimits, image: str, hash_seed: int | None = None) -> Sandbox:
        sandbox = ToySandbox(f"toy-{job_id[4:16]}", {})
        self.sandboxes.append(sandbox)
        return sandbox

    async def open_session(
        self,
        session_id: str,
        limits: SandboxLimits,
        env: Mapping[str, str],
        image: str,
        runtime: str | None,
        held: Held | None,
    ) -> Sandbox:
        sandbox = ToySandbox(f"toy-{session_id[4:16]}", env)
        self.sandboxes.append(sandbox)
        return sandbox


Served = tuple[httpx.AsyncClient, ToyEngine]
Service = tuple[FastAPI, httpx.AsyncClient, ToyEngine]


@asynccontextmanager
async def _served(toy: ToyEngine | None = None) -> AsyncIterator[Served]:
    async with _service(toy) as (_, client, toy):
        yield client, toy


@asynccontextmanager
async def _service(toy: ToyEngine | None = None, **overrides: Any) -> AsyncIterator[Service]:
    """The whole service (its app, a client of it, its toy engine) with ``toy`` as its default engine;
    ``overrides``: settings of its own."""
    work_dir = Path(tempfile.mkdtemp(prefix="ptct", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir, auth="disabled", sandbox_folders_tmpfs_mb=0, warm_pool_size=0, stop_grace_s=0.5,
        instance_id="toy-" + work_dir.name, **overrides,
    )  # fmt: skip
    toy = toy or ToyEngine()

    def toy_engine(site: EngineSite) -> Engine:
        return toy

    app = create_app(settings, FakeBackend(), engines={**ENGINES, TOY: toy_engine}, default_engine=TOY)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://toy", timeout=60) as client:
                yield app, client, toy
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """The whole service with the toy engine as its default (the container engine beside it, on the fake backend)."""
    async with _served() as parts:
        yield parts


async def _execute(client: httpx.AsyncClient, script: str, **body: Any) -> dict[str, Any]:
    answer = await client.post("/execute", json={"script": script, "tools": TOOLS, **body})
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


async def test_a_toy_script_runs_end_to_end_with_its_calls_recorded_and_saved(served: Served) -> None:
    client, toy = served
    script = 'print hi\ncall echo {"x": 1}\nread data.txt\ntools\nwarn done\n'
    view = await _execute(client, script, files=[{"path": "data.txt", "content": "given"}])
    assert view["status"] == "succeeded", view["stderr"]
    assert view["exit_code"] == 0 and view["error"] is None
    assert view["stdout"] == 'hi\n{"args": {"x": 1}, "tool": "echo"}\ngiven\nask\necho\n'
    assert view["stderr"] == "done\n"
    assert [(call["tool"], call["status"], call["args"]) for call in view["calls"]] == [("echo", "ok", {"x": 1})]
    assert view["sandbox_id"] == toy.sandboxes[0].sandbox_id and view["sandbox_start"] == "warm"
    assert toy.sandboxes[0].destroyed and toy.sandboxes[0].stop_reason == "succeeded"  # a one-shot's: removed
    saved = (await client.get(f"/jobs/{view['job_id']}")).json()  # the saved final view serves the same
    keys = ("status", "exit_code", "stdout", "stderr", "calls", "sandbox_id")
    assert {key: saved[key] for key in keys} == {key: view[key] for key in keys}


async def test_a_failed_call_and_an_exit_code_end_the_job_by_the_same_rules(served: Served) -> None:
    client, _ = served
    refused = await _execute(client, 'call echo {"x": "not a number"}\nprint unreached\n')
    assert refused["status"] == "failed" and refused["exit_code"] == 1, refused
    assert refused["error"]["type"] == "nonzero_exit" and "error invalid_arguments" in refused["stderr"], refused
    assert [call["status"] for call in refused["calls"]] == ["rejected"]
    exited = await _execute(client, "print before\nexit 3\n")
    assert (exited["status"], exited["exit_code"], exited["stdout"]) == ("failed", 3, "before\n")
    raised = await _execute(client, "raise MemoryError claimed, not true\n")  # the report rides along, no more
    assert raised["status"] == "failed" and raised["error"]["type"] == "nonzero_exit", raised["error"]
    report = raised["error"]["script_report"]
    assert (report["type"], report["message"]) == ("MemoryError", "claimed, not true"), report


async def test_a_client_executed_call_pauses_the_toy_job_until_it_is_answered(served: Served) -> None:
    client, _ = served
    answer = await client.post(
        "/execute", json={"script": 'call ask {"q": "name?"}\nprint end\n', "tools": TOOLS, "wait_s": 0}
    )
    job_id = answer.json()["job_id"]
    for _ in range(200):
        view = (await client.get(f"/jobs/{job_id}")).json()
        if view["pending_calls"]:
            break
        await asyncio.sleep(0.02)
    assert view["status"] == "waiting" and view["pending_calls"][0]["args"] == {"q": "name?"}, view
    call_id = view["pending_calls"][0]["call_id"]
    assert (await client.post(f"/jobs/{job_id}/calls/{call_id}", json={"result": "toy"})).status_code == 200
    final = (await client.post(f"/jobs/{job_id}/wait", params={"timeout_s": 10})).json()
    assert final["status"] == "succeeded" and final["stdout"] == '"toy"\nend\n', final


async def test_stop_and_timeout_reach_the_toy_run(served: Served) -> None:
    client, _ = served
    answer = await client.post("/execute", json={"script": "print start\nsleep 30\n", "wait_s": 0})
    job_id = answer.json()["job_id"]
    for _ in range(200):
        if (await client.get(f"/jobs/{job_id}")).json()["stdout"]:
            break
        await asyncio.sleep(0.02)
    stopped = (await client.post(f"/jobs/{job_id}/stop")).json()
    assert stopped["status"] == "stopped" and stopped["exit_code"] == 128 + 15, stopped
    timed_out = await _execute(client, "sleep 30\n", timeout_s=0.3)
    assert timed_out["status"] == "timed_out", timed_out


async def test_a_toy_session_keeps_its_sandbox_and_files_between_scripts(served: Served) -> None:
    client, toy = served
    created = await client.post(
        "/sessions",
        json={"tools": TOOLS, "env": {"GREETING": "hello"}, "files": [{"path": "a.txt", "content": "kept"}]},
    )
    assert created.status_code == 201, created.text
    session_id = created.json()["session_id"]
    first = await _execute(client, "read a.txt\n", session_id=session_id)
    second = await _execute(client, 'call echo {"x": 2}\nread a.txt\n', session_id=session_id)
    assert first["status"] == second["status"] == "succeeded", (first, second)
    assert first["sandbox_start"] == second["sandbox_start"] == "session"
    assert second["stdout"] == '{"args": {"x": 2}, "tool": "echo"}\nkept\n'
    listed = (await client.get(f"/sessions/{session_id}/files")).json()
    assert listed["files"] == [{"path": "a.txt", "bytes": 4, "skipped": None}]
    session_sandbox = toy.sandboxes[-1]
    assert session_sandbox.env == {"GREETING": "hello"}
    deleted = await client.delete(f"/sessions/{session_id}")
    assert deleted.status_code == 200 and deleted.json()["status"] == "closed"
    assert session_sandbox.destroyed and session_sandbox.env == {}  # an ended session keeps only its view


class UnreadyToy(ToyEngine):
    """A toy engine that cannot run scripts yet (``Engine.ready``), or cannot run an image (``missing_images``)."""

    def __init__(self, why: str | None = None, missing: dict[str, str] | None = None) -> None:
        super().__init__()
        self.why = why
        self.missing = missing or {}

    async def ready(self) -> tuple[bool, str]:
        return (False, self.why) if self.why is not None else (True, "ok")

    async def missing_images(self) -> dict[str, str]:
        return self.missing


async def test_readyz_asks_every_engine_and_names_the_one_not_ready(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="service.api.app")
    async with _served(UnreadyToy(why="its interpreter is not installed")) as (client, _):
        answer = await client.get("/readyz")  # the container engine beside it, on the fake backend, is ready
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/problem+json"
        body = answer.json()
        assert (body["reason"], body["detail"]) == ("engine", "engine 'toy': its interpreter is not installed"), body
        assert "missing_images" not in body
    assert "not ready yet: engine 'toy': its interpreter is not installed" in caplog.text  # said at start-up too
    async with _served(UnreadyToy(missing={"default": "the toy has no 'default' image"})) as (client, _):
        body = (await client.get("/readyz")).json()
        assert (body["reason"], body["missing_images"]) == ("images", ["default"]), body
        assert body["detail"] == "engine 'toy': the toy has no 'default' image", body
    async with _served() as (client, _):  # a toy with the defaults: ready, every image runs
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["images"] == ["default"], ready.text


class FailingTake(ToyEngine):
    """A toy engine whose ``take`` raises ``failure`` once (the engine cannot make the job's sandbox)."""

    def __init__(self, failure: Exception) -> None:
        super().__init__()
        self.failure: Exception | None = failure

    def take(self, job_id: str, owner: str, limits: SandboxLimits, image: str, hash_seed: int | None = None) -> Sandbox:
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        return super().take(job_id, owner, limits, image)


@pytest.mark.parametrize(
    ("failure", "error_type", "shown"),
    [
        (SandboxError("the engine could not make a sandbox"), "sandbox_error", True),
        (RuntimeError("a fault of the engine"), "internal_error", False),  # an unexpected error's text stays inside
    ],
)
async def test_a_take_that_raises_ends_the_job_failed_and_gives_its_script_slot_back(
    failure: Exception, error_type: str, shown: bool
) -> None:
    """Issue 25 review: ``OneShot.enter`` took a script slot, then ``Engine.take`` raised, and the slot was never
    given back (``leave`` gave back only a slot kept after a ``take`` that answered): with one slot, every later
    job queued for ever."""
    async with _service(FailingTake(failure), max_concurrent_sandboxes=1) as (app, client, toy):
        admission = app.state.jobs._parts.sandboxes.admission

        def held(owner: str) -> dict[str, int]:  # what a job holds while it is admitted, queued or running
            return {
                "script slots": admission._slots.in_use,
                "admitted one-shot jobs": admission.admitted,
                "owner's jobs": admission.quotas.usage(owner).jobs,
            }

        first = await _execute(client, "print a\n", wait_s=5)
        assert first["status"] == "failed" and first["error"]["type"] == error_type, first
        assert (str(failure) in first["error"]["message"]) is shown, first["error"]
        assert first["exit_code"] is None and first["sandbox_id"] is None and not toy.sandboxes
        assert held(first["owner"]) == dict.fromkeys(held(first["owner"]), 0)
        second = await _execute(client, "print b\n", wait_s=5)  # with the slot leaked: still ``queued`` at wait_s
        assert second["status"] == "succeeded" and second["stdout"] == "b\n", second
        assert held(first["owner"]) == dict.fromkeys(held(first["owner"]), 0)
