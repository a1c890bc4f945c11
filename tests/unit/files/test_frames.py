"""The service checks every file frame a sandbox sends (a script may have taken its interpreter over): output
files only under ``outputs/``, within the caps the run asked for, data only inside a file or a request; anything
else breaks the sandbox and nothing half-sent is listed. The sandbox's side is a coroutine on the real socket."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from ptc_runtime.protocol import CONTROL_SOCKET, MAX_FRAME_BYTES

from service.errors import FileRefused, NoSuchFile, SandboxError
from service.files import OutputFiles
from service.sandbox.backend import ExitStatus, OutputSink, SandboxHandle, SandboxSpec
from service.sandbox.resident import ResidentSandbox
from tests.unit.test_control_protocol import StandIn, spec

EXIT = b'{"op": "exit", "id": "job_1", "exit_code": 0, "oom_killed": false, "left": 0, "files_omitted": 0}\n'


class FilesStandIn(StandIn):
    """A sandbox side that says it serves files (``features`` in its hello)."""

    async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
        async def connect() -> None:
            reader, writer = await asyncio.open_unix_connection(str(spec.job_dir / CONTROL_SOCKET))
            writer.write(b'{"op": "hello", "pid": 7, "features": ["files"]}\n')
            await self.server(reader, writer)
            writer.close()

        self.tasks.append(asyncio.create_task(connect()))
        return SandboxHandle(id="0" * 64, spec=spec)


def op(message: dict[str, object], data: bytes = b"") -> bytes:
    return orjson.dumps(message) + b"\n" + data


def file(path: str) -> bytes:
    return op({"op": "file", "id": "job_1", "path": path})


def data(payload: bytes, rid: str = "job_1") -> bytes:
    return op({"op": "data", "id": rid, "n": len(payload)}, payload)


async def run_with_outputs(
    tmp_path: Path, answer: Callable[[dict[str, object]], bytes]
) -> tuple[ExitStatus, OutputFiles, str, dict[str, object]]:
    """A run whose sandbox side answers with ``answer(run)``; returns (exit, outputs, broken reason, run frame)."""
    seen: dict[str, object] = {}

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        run = orjson.loads(await reader.readline())
        seen.update(run)
        writer.write(answer(run))
        await writer.drain()
        await reader.read()

    backend = FilesStandIn(server)
    sandbox = ResidentSandbox(backend, spec(tmp_path / "sandbox"))
    await sandbox.start()
    outputs = OutputFiles(tmp_path / "job", max_files=2, max_bytes=10)
    (tmp_path / "job").mkdir()
    run = await sandbox.run("job_1", {}, lambda _s, _d: None, outputs)
    status = await asyncio.wait_for(run.wait(), 10)
    broken = sandbox.broken or ""
    await sandbox.destroy()
    await asyncio.gather(*backend.tasks, return_exceptions=True)
    return status, outputs, broken, seen


async def test_honest_outputs_are_kept_under_names_of_the_services_own(tmp_path: Path) -> None:
    frames = (
        file("outputs/a.csv")
        + data(b"1,2\n")
        + data(b"3\n")
        + op({"op": "skipped", "id": "job_1", "path": "outputs/link", "reason": "symlink"})
        + file("outputs/sub/b.png")
        + data(b"png")
        + EXIT
    )
    status, outputs, broken, run = await run_with_outputs(tmp_path, lambda _run: frames)
    assert (status, broken) == (ExitStatus(0, False), "")
    assert run["outputs"] == {"max_files": 2, "max_bytes": 10}
    assert outputs.files == [
        {
            "path": "outputs/a.csv",
            "bytes": 6,
            "sha256": hashlib.sha256(b"1,2\n3\n").hexdigest(),
            "content_type": "text/csv",
        },
        {
            "path": "outputs/sub/b.png",
            "bytes": 3,
            "sha256": hashlib.sha256(b"png").hexdigest(),
            "content_type": "image/png",
        },
    ]
    assert (outputs.omitted, outputs.skipped) == (1, [{"path": "outputs/link", "reason": "symlink"}])
    assert sorted(p.name for p in (tmp_path / "job" / "files").iterdir()) == ["0", "1"]
    assert (tmp_path / "job" / "files" / "0").read_bytes() == b"1,2\n3\n"


@pytest.mark.parametrize(
    "lie",
    [
        file("etc/passwd") + EXIT,  # not under outputs/
        file("../x") + EXIT,
        file("outputs/../../x") + EXIT,
        file("/etc/passwd") + EXIT,
        file("outputs") + EXIT,
        file("outputs/a\x00b") + EXIT,
        op({"op": "file", "id": "job_1", "path": 7}) + EXIT,
        file("outputs/1") + file("outputs/2") + file("outputs/3") + EXIT,  # past the count cap
        file("outputs/1") + data(b"x" * 11) + EXIT,  # past the bytes cap
        data(b"orphan") + EXIT,  # data outside any file
        op({"op": "data", "id": "job_1", "n": MAX_FRAME_BYTES + 1}, b"x") + EXIT,
        op({"op": "data", "id": "job_1", "n": -1}) + EXIT,
        op({"op": "entry", "id": "f1", "path": "x", "bytes": 1}) + EXIT,  # an entry of no request
        op({"op": "done", "id": "f9", "error": None}) + EXIT,  # a done of no request
    ],
)
async def test_a_lying_sandbox_is_broken_and_lists_nothing(tmp_path: Path, lie: bytes) -> None:
    status, outputs, broken, _ = await run_with_outputs(tmp_path, lambda _run: lie)
    assert broken and status.lost
    assert outputs.files == []


async def file_request(
    tmp_path: Path, answer: Callable[[dict[str, object]], bytes], ask: Callable[[ResidentSandbox], object]
) -> tuple[object, str]:
    """Send one file request (``ask``) to a sandbox side answering ``answer(request)``; (result or error, broken)."""

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(answer(orjson.loads(line)))
            await writer.drain()

    backend = FilesStandIn(server)
    sandbox = ResidentSandbox(backend, spec(tmp_path / "sandbox"))
    await sandbox.start()
    try:
        result: object = await ask(sandbox)  # type: ignore[misc]
    except (FileRefused, NoSuchFile, SandboxError) as exc:
        result = exc
    broken = sandbox.broken or ""
    await sandbox.destroy()
    await asyncio.gather(*backend.tasks, return_exceptions=True)
    return result, broken


async def test_a_get_takes_the_bytes_and_no_more_than_asked(tmp_path: Path) -> None:
    def honest(request: dict[str, object]) -> bytes:
        rid = str(request["id"])
        return data(b"abc", rid) + op({"op": "done", "id": rid, "error": None, "bytes": 3})

    result, broken = await file_request(tmp_path, honest, lambda s: s.get_file("x", 3))
    assert (result, broken) == (b"abc", "")
    result, broken = await file_request(tmp_path, honest, lambda s: s.get_file("x", 2))
    assert isinstance(result, SandboxError) and "broke the control protocol" in broken


@pytest.mark.parametrize(
    ("error", "expected"),
    [("not_found", NoSuchFile), ("not_a_file", FileRefused), ("no_space", FileRefused), ("made_up", SandboxError)],
)
async def test_a_gets_error_is_the_services_own(tmp_path: Path, error: str, expected: type[Exception]) -> None:
    def answer(request: dict[str, object]) -> bytes:
        return op({"op": "done", "id": request["id"], "error": error, "message": "m"})

    result, _ = await file_request(tmp_path, answer, lambda s: s.get_file("x", 3))
    assert type(result) is expected


async def test_a_listing_takes_no_more_entries_than_asked(tmp_path: Path) -> None:
    def answer(request: dict[str, object]) -> bytes:
        rid = request["id"]
        entries = b"".join(
            op({"op": "entry", "id": rid, "path": f"f{n}", "bytes": n, "skipped": None}) for n in range(3)
        )
        return entries + op({"op": "done", "id": rid, "error": None, "truncated": False})

    result, broken = await file_request(tmp_path, answer, lambda s: s.list_files(3))
    assert result == ([{"path": f"f{n}", "bytes": n, "skipped": None} for n in range(3)], False) and not broken
    result, broken = await file_request(tmp_path, answer, lambda s: s.list_files(2))
    assert isinstance(result, SandboxError) and broken


async def test_an_old_runtime_is_refused_clearly(tmp_path: Path) -> None:
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    backend = StandIn(server)  # its hello names no feature
    sandbox = ResidentSandbox(backend, spec(tmp_path / "sandbox"))
    await sandbox.start()
    with pytest.raises(SandboxError, match="rebuild it"):
        await sandbox.put_files([("a", b"x")])
    await sandbox.destroy()
    await asyncio.gather(*backend.tasks, return_exceptions=True)


def test_a_file_past_the_owners_quota_is_not_kept_and_its_bytes_given_back(tmp_path: Path) -> None:
    from service.jobs.marks import OWNER_FILE
    from service.jobs.recovery import _retained
    from service.quotas import OutputBudget

    (tmp_path / OWNER_FILE).write_text("alice")
    budget = OutputBudget(limit=10)
    outputs = OutputFiles(tmp_path, max_files=5, max_bytes=100, budget=budget)
    outputs.begin("outputs/a.txt")
    outputs.add(b"x" * 6)
    outputs.begin("outputs/b.txt")
    outputs.add(b"y" * 3)
    outputs.add(b"y" * 3)  # 12 > 10: b is dropped whole, its 3 bytes given back
    outputs.add(b"y")  # and the rest of it ignored
    outputs.begin("outputs/c.txt")
    outputs.add(b"z" * 4)
    outputs.end()
    assert [(f["path"], f["bytes"]) for f in outputs.files] == [("outputs/a.txt", 6), ("outputs/c.txt", 4)]
    assert (outputs.omitted, outputs.skipped) == (1, [{"path": "outputs/b.txt", "reason": "output quota"}])
    assert budget.used == 10
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["0", "1"]  # named by index in the list
    assert files_find_all(tmp_path, outputs) == [b"x" * 6, b"z" * 4]
    assert _retained(tmp_path) == ("alice", 10)  # at start-up and purge, output files count with the output


def files_find_all(folder: Path, outputs: OutputFiles) -> list[bytes]:
    from service.files import find

    found = [find(folder, outputs.files, entry["path"]) for entry in outputs.files]
    return [path.read_bytes() for path, _ in (f for f in found if f is not None)]


async def test_the_exits_count_of_omitted_entries_is_kept(tmp_path: Path) -> None:
    exit_frame = EXIT.replace(b'"files_omitted": 0', b'"files_omitted": 5000')
    frames = op({"op": "skipped", "id": "job_1", "path": "outputs/x", "reason": "cap"}) + exit_frame
    _, outputs, broken, _ = await run_with_outputs(tmp_path, lambda _run: frames)
    assert (broken, outputs.omitted, len(outputs.skipped)) == ("", 5000, 1)
