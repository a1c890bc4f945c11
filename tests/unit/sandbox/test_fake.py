"""What the fake backend offers beyond the contract: the hooks a runner test drives, and the run folder's layout."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.errors import SandboxError
from service.sandbox.backend import SandboxSpec, Stream, write_run_files
from service.sandbox.fake import FakeBackend
from service.sandbox.resident import ResidentSandbox


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ptcf", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def spec(folder: Path) -> SandboxSpec:
    return SandboxSpec(
        image="any", job_dir=folder / "s", memory_mb=64, cpus=1, pids=64, tmp_mb=8, file_size_mb=8, open_files=64
    )


async def test_oom_ends_the_script_oom_killed_and_the_sandbox_lives_on(folder: Path) -> None:
    backend = FakeBackend()
    sandbox = ResidentSandbox(backend, spec(folder))
    await sandbox.start()
    try:
        await asyncio.to_thread(
            write_run_files, sandbox.folder, "import time\nprint('up', flush=True)\ntime.sleep(60)\n", None
        )
        out = bytearray()
        run = await sandbox.run("job_1", {}, lambda _s, data: out.extend(data))
        for _ in range(1500):
            if out:
                break
            await asyncio.sleep(0.02)
        assert sandbox.handle is not None and backend.oom(sandbox.handle)
        status = await asyncio.wait_for(run.wait(), 30)
        assert (status.exit_code, status.oom_killed, status.killed, status.lost) == (137, True, False, None)
        assert sandbox.broken is None
    finally:
        await sandbox.destroy()
        await backend.close()


async def test_a_script_imports_the_tools_package_of_its_folder(folder: Path) -> None:
    backend = FakeBackend()
    sandbox = ResidentSandbox(backend, spec(folder))
    await sandbox.start()
    try:
        stub = "def double(x):\n    return 2 * x\n"
        await asyncio.to_thread(write_run_files, sandbox.folder, "import tools\nprint(tools.double(21))\n", stub)
        output: dict[Stream, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        run = await sandbox.run("job_1", {}, lambda s, data: output[s].extend(data))
        status = await asyncio.wait_for(run.wait(), 30)
        assert status.exit_code == 0, bytes(output["stderr"])
        assert bytes(output["stdout"]) == b"42\n"
    finally:
        await sandbox.destroy()
        await backend.close()


async def test_refuse_start_fails_the_next_start_only(folder: Path) -> None:
    backend = FakeBackend()
    backend.refuse_start = "no room (fake)"
    with pytest.raises(SandboxError, match="no room"):
        await ResidentSandbox(backend, spec(folder)).start()
    sandbox = ResidentSandbox(backend, spec(folder))
    await sandbox.start()
    await sandbox.destroy()
    await backend.close()
    assert backend.starts == 1 and backend.sandboxes == {}


async def test_a_run_env_file_planted_as_a_link_is_replaced_not_followed(folder: Path) -> None:
    """Defence in depth (the folder is read-only to scripts): a ``.run-env.json`` left in the folder as a link is
    replaced by the root service writing the next run's env, never written through."""
    sandbox = ResidentSandbox(FakeBackend(), spec(folder))
    sandbox.folder.mkdir()
    target = folder / "host-file"
    target.write_bytes(b"kept")
    (sandbox.folder / ".run-env.json").symlink_to(target)
    sandbox._write_env(b'{"SECRET": "s3"}')
    assert target.read_bytes() == b"kept"
    written = sandbox.folder / ".run-env.json"
    assert not written.is_symlink() and written.read_bytes() == b'{"SECRET": "s3"}'
    assert written.stat().st_mode & 0o777 == 0o644
