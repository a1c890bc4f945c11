"""The resident-interpreter sandbox: one container whose interpreter runs scripts on the service's request.

Every run goes through this type, whatever its placement: a cold one-shot job (a sandbox started for it and removed
after), a pooled one (started ahead of time by ``service.sandbox.pool``, used once), and a session's turn (the
session's sandbox, kept for the next script; ``service.sessions.manager``). The sandbox runs the runtime with
``PTC_SESSION=1`` (``sandbox_image/ptc_runtime/session.py``): a resident interpreter, with the stub library
imported, that forks one process per script and speaks the control protocol of ``ptc_runtime.protocol`` over the
folder's ``control.sock``.

The sandbox's folder is mounted read-only at ``/run/ptc``; the service listens on its ``control.sock`` before the
sandbox starts, and writes each run's ``script.py`` and ``tools`` package there, with the run's broker on
``tools.sock``. A run's output arrives as ``out`` frames on the control connection and reaches the run's
``OutputSink`` on the event loop; its end is the ``exit`` frame, preceded by the files it left in ``outputs/``
(``file``/``data``/``skipped`` frames into the run's ``ports.OutputCollector``). Between runs, ``put_files``,
``get_file`` and ``list_files`` ask the sandbox for file I/O under its ``/tmp`` (docs/files.md). Nothing the
sandbox says is trusted: a frame outside the protocol marks the sandbox broken and ends it. When the control
connection ends (the interpreter died, the container was killed or lost), the running script ends ``lost`` with the
engine's view of the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from dataclasses import replace
from typing import Any

import orjson
from ptc_runtime import protocol

from service.errors import SandboxError
from service.sandbox.backend import (
    ExitStatus,
    OutputSink,
    SandboxBackend,
    SandboxHandle,
    SandboxSpec,
    Stream,
    write_run_files,
)
from service.sandbox.labels import LABEL_SANDBOX
from service.sandbox.ports import CallSocket, Held, OutputCollector, StopHook
from service.sandbox.resident_files import FileRequest, SandboxFiles
from service.unix_sockets import bind_unix

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0
HELLO_POLL_S = 0.5  # first look at the engine for a sandbox that has not said hello (then 1 s, 1 s, ...)
KILL_CONFIRM_S = 5.0
OOM_REPORT_WAIT_S = 5.0  # how long a lost sandbox that died by SIGKILL waits for the engine's OOM report (measured:
# up to 35 ms after its exit, issue 24); only a sandbox lost by SIGKILL without one waits it all
STRAY_LOG_LINES = 10  # log lines of a sandbox's output outside any script; the rest is counted, not logged
STRAY_KEPT_BYTES = 2048  # of that output, kept for the error of a sandbox that never connected
_STREAMS: dict[str, Stream] = {"stdout": "stdout", "stderr": "stderr"}
_FILE_FRAMES = frozenset((protocol.DATA, protocol.FILE, protocol.SKIPPED, protocol.ENTRY, protocol.DONE))
SIGNAL_NUMBERS = {protocol.SIGTERM: 15, protocol.SIGKILL: 9}  # the signals the service sends (Linux numbers)
INLINE_ENV_BYTES = 16 * 1024  # a run's env file up to this size is written on the event loop (a few small writes)
HASH_SEED_MAX = 2**32 - 1  # PYTHONHASHSEED: 0 (no randomization) to this; a sandbox draws from 1 up
INLINE_SCRIPT_CHARS = 4096  # a script this small, with no stubs to write, is written on the event loop


class ResidentRun:
    """One script running in a resident sandbox: wait for its exit, signal it, kill it.

    Args:
        sandbox: the sandbox it runs in.
        job_id: the run's id (the job's), as in the control protocol's frames.
        sink: receives the run's output, on the event loop.
    """

    def __init__(
        self, sandbox: ResidentSandbox, job_id: str, sink: OutputSink, outputs: OutputCollector | None = None
    ) -> None:
        self.job_id = job_id
        self.sink = sink
        self.outputs = outputs
        self.exit: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self.sent: set[int] = set()  # signal numbers asked for (for runtimes that do not report ``killed``)
        self._sandbox = sandbox

    async def wait(self) -> ExitStatus:
        """The script's exit, once its output has all reached the sink."""
        return await asyncio.shield(self.exit)

    async def signal(self, signal: str) -> None:
        """Send ``SIGTERM`` or ``SIGKILL`` to the script's process group (a sandbox already gone has ended the
        run: nothing to signal). Whether it ended the script is the runtime's to say (``ExitStatus.killed``)."""
        self.sent.add(SIGNAL_NUMBERS[signal])
        with contextlib.suppress(SandboxError):
            await self._sandbox.send({protocol.FIELD_OP: protocol.SIGNAL, "id": self.job_id, "signal": signal})

    async def kill(self) -> None:
        """SIGKILL the script and everything it started; if the sandbox does not confirm in time, kill it all."""
        await self.signal("SIGKILL")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.exit), KILL_CONFIRM_S)
            return
        await self._sandbox.destroy(f"the sandbox did not end a script within {KILL_CONFIRM_S:g} s of SIGKILL")


class ResidentSandbox(SandboxFiles):
    """The service's side of one resident sandbox: container, folder and control connection.

    Args:
        backend: the sandbox backend.
        spec: the sandbox; ``job_dir`` is its folder (created by ``start``, removed by ``destroy``), ``env`` is the
            environment of every run (not the container's: see ``run``), ``PTC_SESSION=1`` and a label unique to
            the sandbox are added.
        on_stop: told once the sandbox is removed (the ``sandbox_stop`` log event); None: nobody.

    Attributes:
        handle: the started container (None before ``start``).
        broken: why the sandbox can run nothing more (None while it can).
        job_id: the job it ran last, for logs.
        stop_reason: what the ``sandbox_stop`` log event says when it is removed (``session``, ``pool``, or the
            job's status).
        commitment: the host capacity it holds, given back once it is removed.
    """

    def __init__(self, backend: SandboxBackend, spec: SandboxSpec, on_stop: StopHook | None = None) -> None:
        self._backend = backend
        if spec.hash_seed is None:  # each sandbox its own (a script can infer its seed from hash values)
            spec = replace(spec, hash_seed=secrets.randbelow(HASH_SEED_MAX) + 1)
        self.spec = spec
        self.hash_seed: int | None = spec.hash_seed
        self.on_stop = on_stop
        self.folder = spec.job_dir
        self.handle: SandboxHandle | None = None
        self.broken: str | None = None
        self.job_id: str | None = None  # the job it ran last (one-shot sandboxes: its only one), for logs
        self.stop_reason = "session"  # what the sandbox_stop log event says when it is removed
        self.commitment: Held | None = None  # host capacity it holds; given back once it is removed
        self._server: asyncio.AbstractServer | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._hello: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._run: ResidentRun | None = None
        self._reader: asyncio.Task[None] | None = None
        self._destroyed = False
        self._stray_lines = 0
        self._stray = bytearray()
        self.features: frozenset[str] = frozenset()  # what the runtime said it serves (its hello)
        self.language = protocol.PYTHON  # the language of the script laid out last (the next run's)
        self._requests: dict[str, FileRequest] = {}
        self._request_ids = 0

    @property
    def started(self) -> bool:
        """Whether its container runs (a pooled or session sandbox; a cold one after ``start``)."""
        return self.handle is not None

    @property
    def sandbox_id(self) -> str | None:
        """The container's short id (12 hex digits), as views show it; None before ``start``."""
        return self.handle.id[:12] if self.handle is not None else None

    async def lay_out(self, script: str, stubs: str | None, language: str = protocol.PYTHON) -> None:
        """Write the next run's script in ``language`` and (unless ``stubs`` is None: unchanged) its stubs into the
        folder (``backend.write_run_files``); a small script alone is written on the loop. Raises OSError."""
        self.language = language
        if stubs is None and len(script) <= INLINE_SCRIPT_CHARS:  # a few small writes: less than a hand-off
            write_run_files(self.folder, script, stubs, language)
        else:
            await asyncio.to_thread(write_run_files, self.folder, script, stubs, language)

    async def connect(self, port: CallSocket) -> None:
        """Let the run's broker listen on the folder's ``tools.sock``, where the script's stubs connect."""
        await port.start(self.folder / protocol.TOOLS_SOCKET)

    def forget_env(self) -> None:
        """Drop the env its runs were given (a session's, once the session ended)."""
        self.spec = replace(self.spec, env={})
        if self.handle is not None:
            self.handle.spec = self.spec

    async def start(self) -> None:
        """Create the folder, listen on its control socket, start the sandbox and wait until its interpreter has
        connected (said ``hello``).

        Raises:
            SandboxError: the engine failed, or the server did not connect within ``HELLO_TIMEOUT_S``
                (nothing is left behind).
        """
        self.folder.mkdir(mode=0o755)
        os.chmod(self.folder, 0o755)
        path = self.folder / protocol.CONTROL_SOCKET
        try:
            # an address without the work dir's path: the sandbox's /proc/net/unix lists the accepted socket
            self._server = await asyncio.start_unix_server(self._accept, sock=bind_unix(path))
            os.chmod(path, 0o666)
            spec = replace(
                self.spec,
                env={protocol.SESSION_ENV: "1"},  # the spec's env goes with each run: see run()
                labels={**self.spec.labels, LABEL_SANDBOX: self.folder.name},  # this sandbox's alone (see start)
            )
            self.handle = await self._backend.start(spec, self._stray_output)
            await self._wait_for_hello(self.handle)
        except BaseException:
            await self.destroy("the session could not start")
            raise

    async def _wait_for_hello(self, handle: SandboxHandle) -> None:
        """Until the server says hello; raises SandboxError if the container exits first or after the time limit."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        look_after = HELLO_POLL_S
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._hello), look_after)
                return
            look_after = min(look_after * 2, 1.0)
            ended = await self._backend.exited(handle)
            if ended is not None:
                said = bytes(self._stray).decode("utf-8", "replace").strip()[-500:]
                raise SandboxError(
                    f"the sandbox exited (code {ended.exit_code}) before it was ready" + (f": {said}" if said else "")
                )
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"the sandbox did not connect within {HELLO_TIMEOUT_S:g} s (an image older than the service? "
                    "rebuild it with sandbox_image/build.sh)"
                )

    def _stray_output(self, stream: Stream, data: bytes) -> None:
        """Output of the sandbox outside any script (the server's own, e.g. why it could not start): never a
        job's; its first ``STRAY_LOG_LINES`` chunks are logged, and its first bytes kept for ``start``'s error."""
        if len(self._stray) < STRAY_KEPT_BYTES:
            self._stray += data[: STRAY_KEPT_BYTES - len(self._stray)]
        self._stray_lines += 1
        if self._stray_lines <= STRAY_LOG_LINES:
            log.warning("sandbox %s wrote outside any script to %s: %r", self.folder.name, stream, data[:500])
        elif self._stray_lines == STRAY_LOG_LINES + 1:
            log.warning("sandbox %s: more output outside any script; not logged", self.folder.name)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None or self._destroyed:  # only the server's first connection is the control one
            writer.close()
            return
        self._writer = writer
        self._reader = asyncio.current_task()
        try:
            await self._read(reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            log.debug("session %s: control connection ended: %r", self.folder.name, exc)
        except (ValueError, KeyError, TypeError) as exc:  # never trusted: a script may have taken the server over
            self.broken = self.broken or f"the sandbox broke the control protocol ({type(exc).__name__})"
            log.warning("sandbox %s: %s: %s", self.folder.name, self.broken, str(exc)[:200])
        finally:
            writer.close()
            await self._lost()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            line = await reader.readline()
            if not line:
                return
            message = orjson.loads(line)
            op = message[protocol.FIELD_OP]
            if op == protocol.HELLO:
                if not self._hello.done():
                    said = message.get("features")
                    if isinstance(said, list):
                        self.features = frozenset(str(name)[:40] for name in said[:20])
                    self._hello.set_result(None)
            elif op in _FILE_FRAMES:
                await self._file_frame(op, message, reader)
            elif op == protocol.OUT:
                size = message["n"]
                if (
                    type(size) is not int
                    or not 0 <= size <= protocol.MAX_FRAME_BYTES
                    or message["stream"] not in _STREAMS
                ):
                    raise ValueError(f"an output frame of {str(size)[:20]} bytes to {str(message['stream'])[:20]}")
                data = await reader.readexactly(size)
                run = self._run
                if run is not None and message["id"] == run.job_id:
                    run.sink(_STREAMS[message["stream"]], data)
            elif op == protocol.EXIT:
                code = message["exit_code"]
                if type(code) is not int or not 0 <= code <= 255:
                    raise ValueError(f"an exit code of {str(code)[:20]}")
                left = message.get("left", 0)
                if left != 0:  # something of the script survived kill(-1): the sandbox serves nothing more
                    self.broken = self.broken or (
                        f"{str(left)[:20]} process(es) of a script were still there after it ended and SIGKILL"
                    )
                    log.warning("sandbox %s: %s", self.folder.name, self.broken)
                run = self._run
                if run is not None and message["id"] == run.job_id and not run.exit.done():
                    self._run = None
                    self._drop_env()
                    if run.outputs is not None:
                        run.outputs.end()
                        omitted = message.get("files_omitted")
                        if type(omitted) is int and 0 <= omitted <= 2**31:  # counted past the skipped frames too
                            run.outputs.omitted = max(run.outputs.omitted, omitted)
                    oom = message["oom_killed"] is True
                    if "killed" in message:  # the runtime says whether the service's signal ended the script
                        killed = message["killed"] is True
                    else:  # an older runtime: a death by a signal the service sent
                        killed = code - 128 in run.sent and not oom
                    stamps = {"sandbox": message.get("stamps"), "exit_read": time.perf_counter_ns()}
                    run.exit.set_result(ExitStatus(exit_code=code, oom_killed=oom, killed=killed, stamps=stamps))
            elif op == protocol.ERROR:
                self._stray_output("stderr", str(message.get("message"))[:500].encode())

    async def _file_frame(self, op: str, message: dict[str, Any], reader: asyncio.StreamReader) -> None:
        """A frame of a file request or of a run's outputs; raises ValueError for one outside the protocol."""
        rid = message["id"]
        run = self._run
        if op == protocol.DATA:
            size = message["n"]
            if type(size) is not int or not 0 <= size <= protocol.MAX_FRAME_BYTES:
                raise ValueError(f"a data frame of {str(size)[:20]} bytes")
            data = await reader.readexactly(size)
            if self._request_data(rid, data):  # a file request's (``resident_files``)
                return
            if run is None or rid != run.job_id or run.outputs is None:
                raise ValueError("a data frame of no request")
            run.outputs.add(data)
        elif op in (protocol.FILE, protocol.SKIPPED):
            if run is None or rid != run.job_id or run.outputs is None:
                raise ValueError("an output file of no run")
            if op == protocol.FILE:
                run.outputs.begin(message["path"])
            else:
                run.outputs.skip(message["path"], message.get("reason"))
        else:
            self._request_frame(op, rid, message)

    async def _lost(self) -> None:
        """The control connection ended: the sandbox cannot go on. End the running script from the engine's view."""
        run, self._run = self._run, None
        self._drop_env()
        for request in self._requests.values():
            if not request.done.done():
                request.done.set_exception(SandboxError(self.broken or "the sandbox went away"))
        self._requests.clear()
        if run is not None and run.outputs is not None:
            run.outputs.discard()
        if self.broken is None:
            self.broken = "the session's sandbox stopped answering (its server exited or was killed)"
        status = ExitStatus(exit_code=137, oom_killed=False)
        if self.handle is not None:
            with contextlib.suppress(Exception):
                await self._backend.kill(self.handle)
                status = await asyncio.wait_for(self._backend.wait(self.handle), 10)
            # An end the service did not cause, by SIGKILL: was it the kernel's OOM killer (the whole sandbox is
            # gVisor's OOM kill)? The engine may report it after the exit, so its report is waited for a while.
            if status.exit_code == 137 and not status.oom_killed and not self._destroyed:
                with contextlib.suppress(Exception):
                    if await self._backend.oom_reported(self.handle, OOM_REPORT_WAIT_S):
                        status = replace(status, oom_killed=True)
        if status.oom_killed:
            self.broken = "the session's sandbox ran out of memory and its server was killed"
        if not self._hello.done():
            self._hello.set_exception(SandboxError(f"the session's sandbox ended before it connected: {self.broken}"))
        if run is not None and not run.exit.done():
            run.exit.set_result(ExitStatus(status.exit_code, status.oom_killed, lost=self.broken))

    async def send(self, message: dict[str, Any]) -> None:
        """Write one control message; raises SandboxError when the sandbox is gone."""
        writer = self._writer
        if writer is None or writer.is_closing() or self.broken is not None:
            raise SandboxError(self.broken or "the session's sandbox is not connected")
        writer.write(orjson.dumps(message) + b"\n")
        try:
            await writer.drain()
        except ConnectionError as exc:
            raise SandboxError(f"the session's sandbox went away: {exc}") from exc

    async def run(
        self, job_id: str, env: dict[str, str], sink: OutputSink, outputs: OutputCollector | None = None
    ) -> ResidentRun:
        """Start the script already written to the folder (``script.py``; one run at a time: a session's caller
        holds its turn). Returns the run; raises SandboxError when the sandbox is gone or broken.

        The script's environment is the sandbox's ``spec.env`` (a session's env) updated with ``env``; neither is
        in the container's own environment, so the interpreter's ``/proc/1/environ`` (readable from a script
        under gVisor) holds only the image's defaults and ``PTC_SESSION``. To a runtime that reads it from a file
        (``protocol.FEATURE_ENV_FILE``) it goes as the folder's ``protocol.ENV_FILE`` (mode 0644, removed when the
        run ends): the script's process reads it, the resident interpreter never holds it, so no later script of a
        session finds an earlier run's env in the memory it inherits from the interpreter. An empty env, which holds
        nothing to keep from later scripts, goes in the run frame itself (no file: a new file is far dearer to the
        file system than the frame, docs/performance.md).
        """
        if protocol.FEATURE_FILES not in self.features:
            outputs = None  # an older runtime: no outputs (the view lists none)
        language = self.language
        if language != protocol.PYTHON and protocol.FEATURE_LANGUAGES not in self.features:
            raise SandboxError(f"the sandbox's runtime is older than the service: it cannot run {language} scripts")
        every = {**self.spec.env, **env}
        message: dict[str, Any] = {protocol.FIELD_OP: protocol.RUN, "id": job_id, "env": every}
        if every and protocol.FEATURE_ENV_FILE in self.features:
            data = orjson.dumps(every)
            if len(data) <= INLINE_ENV_BYTES:  # a small write: less than a hand-off to a thread
                self._write_env(data)
            else:
                await asyncio.to_thread(self._write_env, data)
            message = {protocol.FIELD_OP: protocol.RUN, "id": job_id, "env_file": protocol.ENV_FILE}
        if language != protocol.PYTHON:
            message[protocol.LANGUAGE] = language
        run = ResidentRun(self, job_id, sink, outputs)
        self._run = run
        self.job_id = job_id
        if outputs is not None:
            message["outputs"] = outputs.caps()
        try:
            await self.send(message)
        except BaseException:
            self._run = None
            raise
        return run

    async def destroy(self, reason: str | None = None) -> None:
        """Remove the sandbox and its folder (idempotent); ``reason`` marks the sandbox broken."""
        if reason is not None and self.broken is None:
            self.broken = reason
        if self._destroyed:
            return
        self._destroyed = True
        if self._server is not None:
            self._server.close()
        if self._writer is not None:
            self._writer.close()
        if self.handle is not None:
            begin, why = time.monotonic(), "broken" if self.broken else self.stop_reason  # before an await can break it
            try:
                await self._backend.remove(self.handle)
            except SandboxError as exc:
                log.warning("session %s: could not remove its sandbox: %s", self.folder.name, exc)
            stop_s = time.monotonic() - begin
            if self.on_stop is not None:
                self.on_stop(self.job_id, self.handle.id, stop_s, self.folder.name, why)
        if self.commitment is not None:
            self.commitment.release()
        if self._reader is not None and self._reader is not asyncio.current_task():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._reader), 5)
        await asyncio.to_thread(shutil.rmtree, self.folder, True)
