"""Sessions: one sandbox kept for a conversation, running its scripts one at a time.

A session's sandbox runs the runtime in session mode (``PTC_SESSION=1``, see
``sandbox_image/ptc_runtime/session.py`` for the control protocol): a
resident interpreter, with the stub library imported, that forks one process
per script. Files under the working directory (``/tmp``) persist from one
script to the next; processes do not. Each script is a job of its own (own
output, call records, time limit and view), run in the order it arrived.

The session's folder (``work_dir/run/sessions/<session_id>``) is mounted
read-only at ``/run/ptc``; the service listens on its ``control.sock``
before the sandbox starts, and writes each run's ``script.py`` and ``tools``
package there, with the run's broker on ``tools.sock`` (the one-shot layout).

A session ends when it is deleted, idle past ``idle_timeout_s``, older than
``max_lifetime_s`` (``expired``), or when its sandbox cannot go on
(``broken``, with the reason); its sandbox is then removed. Sessions live in
this process's memory: a restart of the service ends them (the start-up
sweep removes their sandboxes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from service import logs
from service.errors import SandboxError, SessionClosed, SessionNotFound, TooManySessions
from service.quotas import Commitment
from service.sandbox.base import ExitStatus, OutputSink, SandboxBackend, SandboxHandle, SandboxSpec, Stream

log = logging.getLogger(__name__)

CONTROL_SOCKET = "control.sock"
SANDBOX_LABEL = "io.ptc-sandbox.sandbox"  # unique per sandbox (its folder's name): a failed start removes only it
SESSION_FEATURE = "session"
HELLO_TIMEOUT_S = 30.0
HELLO_POLL_S = 0.5  # first look at the engine for a sandbox that has not said hello (then 1 s, 1 s, ...)
KILL_CONFIRM_S = 5.0
OOM_SETTLE_ROUNDS = 5  # x 0.2 s: how long a sandbox that died by SIGKILL is watched for the engine's OOM flag
MAX_FRAME_BYTES = 64 * 1024  # the runtime sends output in chunks of at most this (its READ_BYTES)
STRAY_LOG_LINES = 10  # log lines of a sandbox's output outside any script; the rest is counted, not logged
STRAY_KEPT_BYTES = 2048  # of that output, kept for the error of a sandbox that never connected
ENDED_KEPT = 1000
EXPIRY_TICK_S = 1.0
_STREAMS: dict[str, Stream] = {"stdout": "stdout", "stderr": "stderr"}
SIGNAL_NUMBERS = {"SIGTERM": 15, "SIGKILL": 9}  # the signals the service sends to a script (Linux numbers)


def _now() -> datetime:
    return datetime.now(UTC)


class SessionRun:
    """One script running in a session's sandbox: ``wait``/``signal``/``kill`` like a one-shot sandbox."""

    def __init__(self, sandbox: SessionSandbox, job_id: str, sink: OutputSink) -> None:
        self.job_id = job_id
        self.sink = sink
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
            await self._sandbox.send({"op": "signal", "id": self.job_id, "signal": signal})

    async def kill(self) -> None:
        """SIGKILL the script and everything it started; if the sandbox does not confirm in time, kill it all."""
        await self.signal("SIGKILL")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.exit), KILL_CONFIRM_S)
            return
        await self._sandbox.destroy(f"the sandbox did not end a script within {KILL_CONFIRM_S:g} s of SIGKILL")


class SessionSandbox:
    """The service's side of one session's sandbox: container, folder and control connection.

    Args:
        backend: the sandbox backend.
        spec: the sandbox (``job_dir`` is the session's folder; ``PTC_SESSION=1`` is added).
    """

    def __init__(self, backend: SandboxBackend, spec: SandboxSpec) -> None:
        self._backend = backend
        self.spec = spec
        self.folder = spec.job_dir
        self.handle: SandboxHandle | None = None
        self.broken: str | None = None
        self.job_id: str | None = None  # the job it ran last (one-shot sandboxes: its only one), for logs
        self.stop_reason = "session"  # what the sandbox_stop log event says when it is removed
        self.commitment: Commitment | None = None  # host capacity it holds; given back once it is removed
        self._server: asyncio.AbstractServer | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._hello: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._run: SessionRun | None = None
        self._reader: asyncio.Task[None] | None = None
        self._destroyed = False
        self._stray_lines = 0
        self._stray = bytearray()

    async def start(self) -> None:
        """Start the sandbox and wait until its server has connected.

        Raises:
            SandboxError: the engine failed, or the server did not connect within ``HELLO_TIMEOUT_S``
                (nothing is left behind).
        """
        self.folder.mkdir(mode=0o755)
        os.chmod(self.folder, 0o755)
        path = self.folder / CONTROL_SOCKET
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(path))
            os.chmod(path, 0o666)
            spec = replace(
                self.spec,
                env={"PTC_SESSION": "1"},  # the session's env goes with each run: see run()
                labels={**self.spec.labels, SANDBOX_LABEL: self.folder.name},  # this sandbox's alone (see start)
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
            op = message["op"]
            if op == "hello":
                if not self._hello.done():
                    self._hello.set_result(None)
            elif op == "out":
                size = message["n"]
                if type(size) is not int or not 0 <= size <= MAX_FRAME_BYTES or message["stream"] not in _STREAMS:
                    raise ValueError(f"an output frame of {str(size)[:20]} bytes to {str(message['stream'])[:20]}")
                data = await reader.readexactly(size)
                run = self._run
                if run is not None and message["id"] == run.job_id:
                    run.sink(_STREAMS[message["stream"]], data)
            elif op == "exit":
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
                    oom = message["oom_killed"] is True
                    if "killed" in message:  # the runtime says whether the service's signal ended the script
                        killed = message["killed"] is True
                    else:  # an older runtime: a death by a signal the service sent
                        killed = code - 128 in run.sent and not oom
                    run.exit.set_result(ExitStatus(exit_code=code, oom_killed=oom, killed=killed))
            elif op == "error":
                self._stray_output("stderr", str(message.get("message"))[:500].encode())

    async def _lost(self) -> None:
        """The control connection ended: the sandbox cannot go on. End the running script from the engine's view."""
        run, self._run = self._run, None
        if self.broken is None:
            self.broken = "the session's sandbox stopped answering (its server exited or was killed)"
        status = ExitStatus(exit_code=137, oom_killed=False)
        if self.handle is not None:
            with contextlib.suppress(Exception):
                await self._backend.kill(self.handle)
                status = await asyncio.wait_for(self._backend.wait(self.handle), 10)
                # The engine may record an OOM kill (of the whole sandbox: gVisor's case) after reporting the exit.
                for _ in range(OOM_SETTLE_ROUNDS if status.exit_code == 137 and not self._destroyed else 0):
                    if status.oom_killed:
                        break
                    await asyncio.sleep(0.2)
                    status = await self._backend.exited(self.handle) or status
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

    async def run(self, job_id: str, env: dict[str, str], sink: OutputSink) -> SessionRun:
        """Start the script already written to the folder; the caller holds the session's turn.

        The script's environment is the sandbox's ``spec.env`` (a session's env) updated with ``env``; neither is
        in the container's own environment, so the interpreter's ``/proc/1/environ`` (readable from a script
        under gVisor) holds only the image's defaults and ``PTC_SESSION``.
        """
        run = SessionRun(self, job_id, sink)
        self._run = run
        self.job_id = job_id
        try:
            await self.send({"op": "run", "id": job_id, "env": {**self.spec.env, **env}})
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
            logs.sandbox("sandbox_stop", self.job_id, self.handle.id, stop_s, folder=self.folder.name, reason=why)
        if self.commitment is not None:
            self.commitment.release()
        if self._reader is not None and self._reader is not asyncio.current_task():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._reader), 5)
        await asyncio.to_thread(shutil.rmtree, self.folder, True)


@dataclass
class Session:
    """One session: its settings, sandbox, turn lock and counters."""

    id: str
    sandbox: SessionSandbox
    limits: dict[str, Any]
    runtime: str | None
    env: dict[str, str]
    tools: list[dict[str, Any]]
    toolset: str | None
    idle_timeout_s: float
    max_lifetime_s: float
    metadata: dict[str, Any]
    owner: str  # the API key name that created it (auth.IMPLICIT_OWNER with authentication disabled)
    created_at: datetime = field(default_factory=_now)
    last_used_at: datetime = field(default_factory=_now)
    ended_at: datetime | None = None
    status: str = "ready"  # ready | busy | closed | expired | broken
    error: dict[str, Any] | None = None
    executions: int = 0
    queued: int = 0
    current_job_id: str | None = None
    stub_source: str | None = None  # the tools package now in the folder
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ended(self) -> bool:
        """Whether the session can run no more scripts."""
        return self.status in ("closed", "expired", "broken")

    def expires_at(self) -> datetime:
        """When the session ends if nothing else happens (idle deadline or end of life, whichever is first)."""
        end_of_life = self.created_at + timedelta(seconds=self.max_lifetime_s)
        idle = self.last_used_at + timedelta(seconds=self.idle_timeout_s)
        return end_of_life if self.busy() else min(end_of_life, idle)

    def busy(self) -> bool:
        """A script runs or waits for its turn."""
        return self.current_job_id is not None or self.queued > 0

    def view(self) -> dict[str, Any]:
        """The session view (see ``schemas.SessionView``)."""
        handle = self.sandbox.handle
        return {
            "session_id": self.id,
            "status": self.status if self.ended else ("busy" if self.busy() else "ready"),
            "error": self.error,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "ended_at": self.ended_at,
            "expires_at": None if self.ended else self.expires_at(),
            "idle_timeout_s": self.idle_timeout_s,
            "max_lifetime_s": self.max_lifetime_s,
            "limits": self.limits,
            "runtime": self.runtime,
            "executions": self.executions,
            "queued": self.queued,
            "current_job_id": self.current_job_id,
            "sandbox_id": handle.id[:12] if handle is not None else None,
            "metadata": self.metadata,
            "owner": self.owner,
        }


class SessionManager:
    """Creates, finds, expires and deletes sessions.

    Args:
        backend: the sandbox backend.
        folder: host folder for the sessions' folders (emptied at start).
        max_sessions: live sessions allowed at once.
        before_end: awaited when a session ends, after it is marked ended and before its sandbox is removed
            (the job manager stops its running script there).
        on_count: called with the number of live sessions whenever it changes (for the ``ptc_sessions`` gauge).
    """

    def __init__(
        self,
        backend: SandboxBackend,
        folder: Path,
        max_sessions: int,
        before_end: Callable[[Session], Awaitable[None]],
        on_count: Callable[[int], None] = lambda _n: None,
    ) -> None:
        self._backend = backend
        self._before_end = before_end
        self._folder = folder
        self._max = max_sessions
        self._on_count = on_count
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()
        self._starting = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Empty the sessions' folder (their sandboxes were swept with the instance's) and start expiring."""
        await asyncio.to_thread(shutil.rmtree, self._folder, True)
        self._folder.mkdir(parents=True, mode=0o700)
        self._task = asyncio.create_task(self._expire_loop(), name="session expiry")

    async def close(self) -> None:
        """End every session (its running script is stopped by its job's own shutdown) and stop expiring."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(self.end(s, "closed", None) for s in list(self._live.values())), return_exceptions=True)

    async def create(
        self,
        spec: SandboxSpec,
        *,
        limits: dict[str, Any],
        env: dict[str, str],
        tools: list[dict[str, Any]],
        toolset: str | None,
        idle_timeout_s: float,
        max_lifetime_s: float,
        metadata: dict[str, Any],
        owner: str,
    ) -> Session:
        """Start a session's sandbox (``spec.job_dir`` is replaced by the session's folder); ``owner`` owns it.

        Raises:
            TooManySessions: ``max_sessions`` are live (or starting) already.
            SandboxError: the sandbox could not start.
        """
        if len(self._live) + self._starting >= self._max:
            raise TooManySessions(self._max)
        self._starting += 1
        try:
            session_id = "ses_" + secrets.token_hex(12)
            sandbox = SessionSandbox(
                self._backend, SandboxSpec(**{**spec.__dict__, "job_dir": self._folder / session_id})
            )
            await sandbox.start()
        finally:
            self._starting -= 1
        session = Session(
            id=session_id,
            sandbox=sandbox,
            limits=limits,
            runtime=spec.runtime,
            env=env,
            tools=tools,
            toolset=toolset,
            idle_timeout_s=idle_timeout_s,
            max_lifetime_s=max_lifetime_s,
            metadata=metadata,
            owner=owner,
        )
        self._live[session_id] = session
        self._on_count(len(self._live))
        return session

    def get(self, session_id: str) -> Session:
        """A live or recently ended session; raises SessionNotFound."""
        session = self._live.get(session_id) or self._ended.get(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def usable(self, session_id: str) -> Session:
        """A live session that can take a script; raises SessionNotFound or SessionClosed."""
        session = self.get(session_id)
        if session.ended:
            raise SessionClosed(session_id, session.status, (session.error or {}).get("message", ""))
        return session

    async def end(self, session: Session, status: str, reason: str | None) -> None:
        """End ``session`` (``closed``, ``expired`` or ``broken``) and remove its sandbox; idempotent."""
        if session.ended:
            return
        session.status = status
        session.ended_at = _now()
        if reason is not None:
            session.error = {"type": f"session_{status}", "message": reason}
        self._live.pop(session.id, None)
        session.tools, session.env, session.stub_source = [], {}, None  # an ended session keeps only its view
        session.sandbox.spec = replace(session.sandbox.spec, env={})
        if session.sandbox.handle is not None:
            session.sandbox.handle.spec = session.sandbox.spec
        self._ended[session.id] = session
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        self._on_count(len(self._live))
        try:
            await self._before_end(session)
        finally:
            await session.sandbox.destroy()

    @property
    def count(self) -> int:
        """Live sessions."""
        return len(self._live)

    @property
    def queued(self) -> int:
        """Scripts waiting for their turn, in all sessions."""
        return sum(session.queued for session in self._live.values())

    def live_sessions(self) -> list[Session]:
        """Live sessions, oldest first."""
        return sorted(self._live.values(), key=lambda s: s.created_at)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            now = _now()
            for session in list(self._live.values()):
                try:
                    if session.sandbox.broken is not None and not session.busy():  # died while idle
                        await self.end(session, "broken", session.sandbox.broken)
                    elif now >= session.created_at + timedelta(seconds=session.max_lifetime_s):
                        await self.end(session, "expired", f"reached its max_lifetime_s of {session.max_lifetime_s:g}")
                    elif not session.busy() and now >= session.last_used_at + timedelta(seconds=session.idle_timeout_s):
                        await self.end(session, "expired", f"idle for its idle_timeout_s of {session.idle_timeout_s:g}")
                except Exception:
                    log.exception("session %s: could not expire it", session.id)
