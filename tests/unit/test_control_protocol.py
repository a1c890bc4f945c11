"""The service never trusts what a sandbox says on its control socket (a script may have taken its server over).

Unit tests: the sandbox side is played by a coroutine speaking the protocol over the real unix socket of a
``ResidentSandbox``; the engine is a stand-in that starts nothing (the integration tests use the real one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import orjson
import pytest
from ptc_runtime.protocol import CONTROL_SOCKET, MAX_FRAME_BYTES

from service.sandbox.backend import ExitStatus, OutputSink, SandboxBackend, SandboxHandle, SandboxSpec
from service.sandbox.resident import ResidentSandbox

Server = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class StandIn(SandboxBackend):
    """Starts ``server`` (the sandbox's side) against the control socket instead of a container."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
        async def connect() -> None:
            reader, writer = await asyncio.open_unix_connection(str(spec.job_dir / CONTROL_SOCKET))
            writer.write(b'{"op": "hello", "pid": 7}\n')
            await self.server(reader, writer)
            writer.close()

        self.tasks.append(asyncio.create_task(connect()))
        return SandboxHandle(id="0" * 64, spec=spec)

    async def wait(self, handle: SandboxHandle) -> ExitStatus:
        return ExitStatus(exit_code=137, oom_killed=False)

    async def exited(self, handle: SandboxHandle) -> ExitStatus | None:
        return None

    async def kill(self, handle: SandboxHandle) -> None:
        pass

    async def remove(self, handle: SandboxHandle) -> None:
        pass

    async def labelled(self, labels: Mapping[str, str]) -> list[str]:
        return []

    async def remove_labelled(self, labels: Mapping[str, str]) -> int:
        return 0

    async def image_labels(self, image: str) -> dict[str, str]:
        return {}

    async def ready(self, image: str) -> tuple[bool, str]:
        return True, "ok"

    async def close(self) -> None:
        pass


def spec(folder: Path) -> SandboxSpec:
    return SandboxSpec(
        image="x", job_dir=folder, memory_mb=64, cpus=1, pids=64, tmp_mb=8, file_size_mb=8, open_files=64
    )


async def run_once(tmp_path: Path, answer: Callable[[dict[str, object]], bytes]) -> tuple[ExitStatus, bytes, str]:
    """Start a sandbox whose side answers a ``run`` with ``answer(run)``; returns (exit, output, broken reason)."""

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        run = orjson.loads(await reader.readline())
        writer.write(answer(run))
        await writer.drain()
        await reader.read()  # until the service hangs up

    backend = StandIn(server)
    sandbox = ResidentSandbox(backend, spec(tmp_path / "sandbox"))
    await sandbox.start()
    output = bytearray()
    run = await sandbox.run("job_1", {}, lambda _stream, data: output.extend(data))
    status = await asyncio.wait_for(run.wait(), 10)
    broken = sandbox.broken or ""
    await sandbox.destroy()
    await asyncio.gather(*backend.tasks, return_exceptions=True)
    return status, bytes(output), broken


def frame(n: int, data: bytes) -> bytes:
    return orjson.dumps({"op": "out", "id": "job_1", "stream": "stdout", "n": n}) + b"\n" + data


async def test_an_honest_run_reports_its_output_and_exit(tmp_path: Path) -> None:
    status, output, broken = await run_once(
        tmp_path,
        lambda run: frame(3, b"hi\n") + b'{"op": "exit", "id": "job_1", "exit_code": 3, "oom_killed": false}\n',
    )
    assert (status, output, broken) == (ExitStatus(3, False), b"hi\n", "")


@pytest.mark.parametrize(
    "lie",
    [
        frame(MAX_FRAME_BYTES + 1, b"x" * 10),  # a frame larger than the runtime ever sends: never buffered
        frame(-1, b""),
        b'{"op": "out", "id": "job_1", "stream": "stdin", "n": 1}\nx',
        b'{"op": "exit", "id": "job_1", "exit_code": ' + b"9" * 4000 + b', "oom_killed": false}\n',
        b'{"op": "exit", "id": "job_1", "exit_code": "0", "oom_killed": false}\n',
        b"not json\n",
        b"x" * (200 * 1024),  # a line past the reader's limit
    ],
)
async def test_a_lying_sandbox_is_broken_and_its_run_lost(tmp_path: Path, lie: bytes) -> None:
    status, output, broken = await run_once(tmp_path, lambda run: lie)
    assert status.lost and status.exit_code == 137 and output == b""
    assert broken


async def test_a_run_that_left_processes_behind_breaks_the_sandbox(tmp_path: Path) -> None:
    status, _, broken = await run_once(
        tmp_path, lambda run: b'{"op": "exit", "id": "job_1", "exit_code": 0, "oom_killed": false, "left": 2}\n'
    )
    assert status == ExitStatus(0, False)  # the script's own exit; the sandbox serves nothing more
    assert "still there" in broken


async def test_a_sessions_env_travels_with_each_run_not_in_the_container(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []

    def answer(run: dict[str, object]) -> bytes:
        seen.append(run)
        return b'{"op": "exit", "id": "job_1", "exit_code": 0, "oom_killed": false, "left": 0}\n'

    started: list[SandboxSpec] = []

    class Recording(StandIn):
        async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
            started.append(spec)
            return await super().start(spec, sink)

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer(orjson.loads(await reader.readline())))
        await writer.drain()
        await reader.read()

    backend = Recording(server)
    base = spec(tmp_path / "sandbox")
    sandbox = ResidentSandbox(backend, SandboxSpec(**{**base.__dict__, "env": {"A": "session", "B": "session"}}))
    await sandbox.start()
    run = await sandbox.run("job_1", {"B": "run"}, lambda _stream, _data: None)
    assert await asyncio.wait_for(run.wait(), 10) == ExitStatus(0, False)
    await sandbox.destroy()
    await asyncio.gather(*backend.tasks, return_exceptions=True)
    assert dict(started[0].env) == {"PTC_SESSION": "1"}  # the interpreter's environment (/proc/1/environ)
    assert seen[0]["env"] == {"A": "session", "B": "run"}
