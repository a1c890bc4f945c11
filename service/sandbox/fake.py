"""An in-memory sandbox backend with a fake resident interpreter: the runner and the pool, tested without an engine.

``FakeBackend`` keeps its sandboxes in a dict. Starting one in resident mode (``PTC_SESSION=1`` in its env, what
``ResidentSandbox`` asks for) starts a ``FakeInterpreter``: a task on the event loop that connects to the folder's
``control.sock`` and speaks the control protocol of ``ptc_runtime.protocol`` as the real resident interpreter does
(``hello``; ``run`` -> ``out`` frames of at most ``MAX_FRAME_BYTES`` -> ``exit`` with ``exit_code``, ``signal``,
``killed``, ``oom_killed`` and ``left``; ``signal``; ``ping``; ``error`` for a second ``run``; the file requests
``put``/``get``/``list`` and a run's outputs, through the real runtime's ``ptc_runtime.files`` on its working
directory, when its image's label lists ``files``, as the default one does). Each script runs
in a subprocess of this host's Python through the real runtime's one-shot path (``ptc_runtime.__main__.main``:
the script as ``__main__``, ``import tools`` from the folder, tool calls over the folder's ``tools.sock``), in its
own process group, which the end of a run SIGKILLs as the real interpreter's ``kill(-1)`` does. Its working
directory is a folder of the sandbox's own that lasts as long as the sandbox (the real sandbox's ``/tmp``).

What it is not: a sandbox. Scripts run on the host as the service's user, with no limit applied (``memory_mb``,
``cpus``, ``pids`` are recorded, not enforced) and the host's network. Use it for the service's own code paths
with trusted test scripts only; isolation is tested against the real engine (``tests/integration``).

Hooks a test drives: ``engine_down`` (every call raises ``EngineUnavailable``), ``refuse_start`` (the next start
raises ``SandboxError``), ``crash`` (the sandbox dies from outside: the engine's kill, a lost container), ``oom``
(the kernel's OOM killer ends the running script).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ptc_runtime
from ptc_runtime import files, protocol

from service.errors import EngineUnavailable, SandboxError
from service.sandbox.backend import ExitStatus, OutputSink, SandboxBackend, SandboxHandle, SandboxSpec, Stream
from service.sandbox.labels import FEATURE_FILES, FEATURE_PRIVSEP, FEATURE_SESSION, LABEL_RUNTIME
from service.sandbox.labels import features as labels_features

RUNTIME_LABELS = {LABEL_RUNTIME: f"{FEATURE_SESSION},{FEATURE_PRIVSEP},{FEATURE_FILES}"}
"""The labels of every image of a ``FakeBackend`` made without ``images``: today's runtime's."""
CONNECT_S = 10.0  # how long the fake interpreter tries to reach the control socket (the real one: 10 s)
DRAIN_S = 2.0  # after the script's group is killed, how long its pipes are read to their end
KILLED = 128 + signal.SIGKILL
_BOOTSTRAP = (
    "import sys\n"
    "from ptc_runtime.__main__ import exit_fast, main\n"
    "from ptc_runtime.stdio import live\n"
    "live()\n"
    "try:\n"
    "    exit_fast(main(sys.argv))\n"
    "except SystemExit as exc:\n"
    "    exit_fast(exc.code)\n"
)
"""What the script's process runs (``python -c`` with the script's path as ``argv[1]``): the runtime's one-shot
path without its privilege drop (the host's user stays)."""


def _runtime_path() -> str:
    """The folder that holds the ``ptc_runtime`` package this process imports (for the script's ``PYTHONPATH``)."""
    return str(Path(ptc_runtime.__file__).resolve().parent.parent)


@dataclass
class FakeSandbox:
    """One sandbox of a ``FakeBackend``: its spec, output sink, state and interpreter."""

    id: str
    spec: SandboxSpec
    sink: OutputSink
    work_dir: Path
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    exit: ExitStatus | None = None
    interpreter: FakeInterpreter | None = None
    task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Whether its main process (the interpreter, or the one-shot script) still runs."""
        return self.exit is None

    def end(self, exit_code: int, oom_killed: bool = False) -> None:
        """Record the sandbox's end (once; later calls change nothing)."""
        if self.exit is None:
            self.exit = ExitStatus(exit_code=exit_code, oom_killed=oom_killed)
            self.ended.set()


class FakeInterpreter:
    """The fake resident interpreter of one ``FakeSandbox`` (see the module docstring)."""

    def __init__(self, sandbox: FakeSandbox, files: bool = True) -> None:
        self.sandbox = sandbox
        self.files = files  # whether it serves file requests and outputs (an image labelled ``files``)
        self._outputs: dict[str, Any] | None = None
        self.folder = sandbox.spec.job_dir
        self._writer: asyncio.StreamWriter | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._job_id: str | None = None
        self._sent: list[int] = []  # signals sent at the service's request while the script ran
        self._oom = False
        self._ending: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        """Connect, say hello and follow the service until it hangs up; the sandbox then ends with 0."""
        reader, self._writer = await self._connect()
        hello: dict[str, Any] = {protocol.FIELD_OP: protocol.HELLO, "pid": os.getpid()}
        if self.files:
            hello["features"] = [protocol.FEATURE_FILES]
        self._send(hello)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    request = json.loads(line)
                    op = request[protocol.FIELD_OP]
                except (ValueError, KeyError, TypeError):
                    self._send({protocol.FIELD_OP: protocol.ERROR, "message": "unreadable request"})
                    continue
                if op == protocol.RUN:
                    outputs = request.get("outputs")
                    self._outputs = outputs if self.files and isinstance(outputs, dict) else None
                    await self._start(str(request["id"]), dict(request.get("env") or {}))
                elif op in (protocol.PUT, protocol.GET, protocol.LIST) and self.files:
                    if self._process is not None:
                        message = {"error": files.FAILED, "message": "a script is running"}
                        self._send({protocol.FIELD_OP: protocol.DONE, "id": str(request.get("id")), **message})
                    else:
                        work_dir, run_dir = str(self.sandbox.work_dir), str(self.folder)
                        files.serve_request(request, self._send, work_dir, run_dir, switch_user=False)
                elif op == protocol.SIGNAL and request.get("id") == self._job_id:
                    self._signal(str(request.get("signal")))
                elif op == protocol.PING:
                    self._send({protocol.FIELD_OP: protocol.PONG})
        finally:
            await self.close()
            self.sandbox.end(0)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        path = str(self.folder / protocol.CONTROL_SOCKET)
        deadline = asyncio.get_running_loop().time() + CONNECT_S
        while True:
            try:
                return await asyncio.open_unix_connection(path)
            except OSError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.01)

    def _send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(message).encode() + b"\n" + payload)

    async def _start(self, job_id: str, env: dict[str, str]) -> None:
        if self._process is not None:
            self._send({protocol.FIELD_OP: protocol.ERROR, "message": "a script is running already"})
            return
        if self._outputs is not None:
            files.prepare_outputs(str(self.sandbox.work_dir), switch_user=False)
        environ = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.sandbox.work_dir),
            "TMPDIR": str(self.sandbox.work_dir),
            "PYTHONPATH": _runtime_path(),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PTC_TOOLS_SOCKET": str(self.folder / protocol.TOOLS_SOCKET),
            **env,
        }
        self._job_id, self._sent, self._oom = job_id, [], False
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _BOOTSTRAP,
            str(self.folder / protocol.SCRIPT),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.sandbox.work_dir,
            env=environ,
            start_new_session=True,
        )
        self._ending = asyncio.create_task(self._follow(job_id, self._process), name=f"fake run {job_id}")

    async def _follow(self, job_id: str, process: asyncio.subprocess.Process) -> None:
        """Forward the script's output, then (its process ended) kill its group, drain, and send ``exit``."""
        assert process.stdout is not None and process.stderr is not None
        pumps = [
            asyncio.create_task(self._pump(job_id, "stdout", process.stdout)),
            asyncio.create_task(self._pump(job_id, "stderr", process.stderr)),
        ]
        returncode = await process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the rest of the script, as the real kill(-1)
        _, late = await asyncio.wait(pumps, timeout=DRAIN_S)
        for pump in late:
            pump.cancel()
        number = -returncode if returncode < 0 else None
        oom = self._oom and number == signal.SIGKILL
        killed = number is not None and number in self._sent and not oom
        self._process, self._job_id = None, None
        omitted = 0
        if self._outputs is not None:
            omitted = files.send_outputs(job_id, self._outputs, self._send, str(self.sandbox.work_dir), False)
        self._send(
            {
                protocol.FIELD_OP: protocol.EXIT,
                "id": job_id,
                "exit_code": 128 + number if number is not None else returncode,
                "signal": number,
                "killed": killed,
                "oom_killed": oom,
                "left": 0,
                "files_omitted": omitted,
            }
        )

    async def _pump(self, job_id: str, stream: Stream, pipe: asyncio.StreamReader) -> None:
        while True:
            data = await pipe.read(protocol.MAX_FRAME_BYTES)
            if not data:
                return
            frame = {protocol.FIELD_OP: protocol.OUT, "id": job_id, "stream": stream, "n": len(data)}
            self._send(frame, data)

    def _signal(self, name: str) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return  # a script that has ended already: its end is its own
        number = signal.SIGTERM if name == protocol.SIGTERM else signal.SIGKILL
        self._sent.append(number)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, number)

    def oom(self) -> bool:
        """End the running script as the kernel's OOM killer would (SIGKILL, reported ``oom_killed``); returns
        whether a script was running."""
        process = self._process
        if process is None or process.returncode is not None:
            return False
        self._oom = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        return True

    def kill_script(self) -> None:
        """SIGKILL the running script's process group, if any (its ``exit`` may not be sent any more)."""
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    async def close(self) -> None:
        """End the script and the control connection (the container is gone)."""
        self.kill_script()
        if self._writer is not None:
            self._writer.close()
        if self._ending is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._ending), DRAIN_S + 1)


class FakeBackend(SandboxBackend):
    """An in-memory ``SandboxBackend`` (see the module docstring).

    Args:
        images: image name -> its labels; None: every image exists, with ``RUNTIME_LABELS``.

    Attributes:
        sandboxes: sandbox id -> ``FakeSandbox``, until it is removed.
        engine_down: while True, every method raises ``EngineUnavailable`` (``ready`` answers why instead).
        refuse_start: when set, the next ``start`` raises ``SandboxError`` with this message (then it is cleared).
        starts: how many sandboxes were started.
    """

    def __init__(self, images: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.images = None if images is None else {name: dict(labels) for name, labels in images.items()}
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.engine_down = False
        self.refuse_start: str | None = None
        self.starts = 0

    def _engine(self) -> None:
        if self.engine_down:
            raise EngineUnavailable("the Docker engine is not reachable: ConnectionError (fake)")

    def _image(self, image: str) -> dict[str, str] | None:
        if self.images is None:
            return dict(RUNTIME_LABELS)
        return self.images.get(image)

    def _get(self, handle: SandboxHandle) -> FakeSandbox:
        sandbox = self.sandboxes.get(handle.id)
        if sandbox is None:
            raise SandboxError(f"the Docker engine refused: No such container: {handle.id[:12]} (fake)")
        return sandbox

    async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
        self._engine()
        if self.refuse_start is not None:
            message, self.refuse_start = self.refuse_start, None
            raise SandboxError(message)
        if self._image(spec.image) is None:
            raise SandboxError(f"the Docker engine refused: No such image: {spec.image} (fake)")
        sandbox_id = secrets.token_hex(32)
        work_dir = Path(tempfile.mkdtemp(prefix="ptc-fake-"))
        sandbox = FakeSandbox(sandbox_id, spec, sink, work_dir)
        self.sandboxes[sandbox_id] = sandbox
        self.starts += 1
        if spec.env.get(protocol.SESSION_ENV) == "1":
            features = labels_features(self._image(spec.image) or {})
            sandbox.interpreter = FakeInterpreter(sandbox, files=FEATURE_FILES in features)
            sandbox.task = asyncio.create_task(
                self._serve(sandbox, sandbox.interpreter), name=f"fake {sandbox_id[:12]}"
            )
        else:  # one-shot: no interpreter to serve; what the image's entrypoint says without PTC_SESSION
            sink("stderr", b"ptc fake backend: only the resident interpreter (PTC_SESSION=1) is served\n")
            sandbox.end(2)
        return SandboxHandle(id=sandbox_id, spec=spec)

    @staticmethod
    async def _serve(sandbox: FakeSandbox, interpreter: FakeInterpreter) -> None:
        try:
            await interpreter.serve()
        except Exception as exc:  # could not connect, or the connection broke: the container's process exits 1
            sandbox.sink("stderr", f"ptc fake interpreter: {type(exc).__name__}: {exc}\n".encode())
            sandbox.end(1)

    async def wait(self, handle: SandboxHandle) -> ExitStatus:
        self._engine()
        sandbox = self._get(handle)
        await sandbox.ended.wait()
        assert sandbox.exit is not None
        return sandbox.exit

    async def exited(self, handle: SandboxHandle) -> ExitStatus | None:
        self._engine()
        return self._get(handle).exit

    async def kill(self, handle: SandboxHandle) -> None:
        self._engine()
        sandbox = self.sandboxes.get(handle.id)
        if sandbox is not None and sandbox.running:
            await self._end(sandbox, KILLED)

    async def _end(self, sandbox: FakeSandbox, exit_code: int, oom_killed: bool = False) -> None:
        sandbox.end(exit_code, oom_killed)
        if sandbox.interpreter is not None:
            await sandbox.interpreter.close()
        if sandbox.task is not None and sandbox.task is not asyncio.current_task():
            sandbox.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sandbox.task

    async def remove(self, handle: SandboxHandle) -> None:
        self._engine()
        sandbox = self.sandboxes.pop(handle.id, None)
        if sandbox is not None:
            await self._end(sandbox, KILLED)
            await asyncio.to_thread(shutil.rmtree, sandbox.work_dir, True)

    async def labelled(self, labels: Mapping[str, str]) -> list[str]:
        self._engine()
        return [
            sandbox.id
            for sandbox in self.sandboxes.values()
            if all(sandbox.spec.labels.get(key) == value for key, value in labels.items())
        ]

    async def remove_labelled(self, labels: Mapping[str, str]) -> int:
        found = await self.labelled(labels)
        for sandbox_id in found:
            await self.remove(SandboxHandle(id=sandbox_id, spec=self.sandboxes[sandbox_id].spec))
        return len(found)

    async def image_labels(self, image: str) -> dict[str, str]:
        self._engine()
        return self._image(image) or {}

    async def ready(self, image: str) -> tuple[bool, str]:
        try:
            self._engine()
        except EngineUnavailable as exc:
            return False, str(exc)
        if self._image(image) is None:
            return False, f"sandbox image {image!r} is not present (build it with sandbox_image/build.sh)"
        return True, "ok"

    async def close(self) -> None:
        """End every sandbox's interpreter and script (they are this process's); the records stay."""
        for sandbox in list(self.sandboxes.values()):
            if sandbox.running:
                await self._end(sandbox, KILLED)

    # -- hooks for tests ---------------------------------------------------------------------------------------

    async def crash(self, handle: SandboxHandle, exit_code: int = KILLED, oom_killed: bool = False) -> None:
        """The sandbox dies from outside (the engine killed it, or the whole container ran out of memory): its
        script and interpreter end, its control connection closes, and the engine reports ``exit_code``."""
        await self._end(self._get(handle), exit_code, oom_killed)

    def oom(self, handle: SandboxHandle) -> bool:
        """The kernel's OOM killer ends the sandbox's running script (the sandbox lives on); returns whether one
        was running."""
        interpreter = self._get(handle).interpreter
        return interpreter is not None and interpreter.oom()
