"""The contract every sandbox backend keeps, run against the fake (no engine) and Docker (the real engine).

Each case starts ``ResidentSandbox``es on one backend and checks what the rest of the service relies on: start and
hello, runs with output frames and their exit (exit code, signal, ``killed``, ``oom_killed``), stop by SIGTERM and
by SIGKILL, labels and listing, removal, the loss of a sandbox from outside, image labels, and an engine that
cannot be reached. The Docker cases are marked ``integration`` and need the engine and the sandbox image.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.errors import EngineUnavailable, SandboxError
from service.sandbox.backend import SandboxBackend, SandboxHandle, SandboxSpec, Stream, write_run_files
from service.sandbox.docker import DockerBackend
from service.sandbox.fake import RUNTIME_LABELS, FakeBackend
from service.sandbox.labels import FEATURE_SESSION, LABEL_SANDBOX, features
from service.sandbox.resident import ResidentRun, ResidentSandbox

TEST_LABEL = "io.ptc-sandbox.test"
MISSING_IMAGE = "ptc-sandbox-no-such-image:0"


@dataclass
class Harness:
    """One backend under test, and how to do to it what only its engine can (lose a sandbox, be unreachable)."""

    backend: SandboxBackend
    image: str
    folder: Path
    lose: Callable[[SandboxHandle], Awaitable[None]]
    unreachable: Callable[[], SandboxBackend]
    label: str = field(default_factory=lambda: secrets.token_hex(6))
    sandboxes: list[ResidentSandbox] = field(default_factory=list)

    def spec(self, name: str, image: str | None = None, env: dict[str, str] | None = None) -> SandboxSpec:
        return SandboxSpec(
            image=image or self.image,
            job_dir=self.folder / name,
            memory_mb=256,
            cpus=1,
            pids=64,
            tmp_mb=16,
            file_size_mb=8,
            open_files=256,
            env=env or {},
            labels={TEST_LABEL: self.label},
        )

    async def started(self, name: str, env: dict[str, str] | None = None) -> ResidentSandbox:
        sandbox = ResidentSandbox(self.backend, self.spec(name, env=env))
        self.sandboxes.append(sandbox)
        await sandbox.start()
        return sandbox


Output = dict[Stream, bytearray]


async def run(sandbox: ResidentSandbox, script: str, env: dict[str, str] | None = None) -> tuple[ResidentRun, Output]:
    """Write ``script`` into the sandbox's folder and start it; returns the run and its output so far."""
    await asyncio.to_thread(write_run_files, sandbox.folder, script, None)
    output: Output = {"stdout": bytearray(), "stderr": bytearray()}
    started = await sandbox.run("job_" + secrets.token_hex(6), env or {}, lambda s, data: output[s].extend(data))
    return started, output


async def until(output: bytearray, text: bytes, timeout_s: float = 30) -> None:
    """Wait until ``text`` is in ``output``."""
    for _ in range(int(timeout_s / 0.02)):
        if text in output:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{text!r} not in the output after {timeout_s:g} s: {bytes(output[-200:])!r}")


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short folder (unix socket paths stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ptcc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["fake", pytest.param("docker", marks=pytest.mark.integration)])
async def harness(request: pytest.FixtureRequest, folder: Path) -> AsyncIterator[Harness]:
    """The backend under test; at the end every sandbox it started is destroyed and none is left listed."""
    if request.param == "fake":
        fake = FakeBackend(images={"ptc-fake:1": RUNTIME_LABELS})

        async def lose_fake(handle: SandboxHandle) -> None:
            await fake.crash(handle)

        h = Harness(fake, "ptc-fake:1", folder, lose_fake, lambda: FakeBackend(images={}))
        fake_down = h.unreachable()
        assert isinstance(fake_down, FakeBackend)
        fake_down.engine_down = True
        h.unreachable = lambda: fake_down
    else:
        engine = request.getfixturevalue("engine")
        from tests.conftest import IMAGE

        async def lose_container(handle: SandboxHandle) -> None:
            await asyncio.to_thread(engine.api.kill, handle.id)

        nowhere = f"unix://{folder}/no-engine.sock"
        h = Harness(DockerBackend(), IMAGE, folder, lose_container, lambda: DockerBackend(base_url=nowhere))
    try:
        yield h
    finally:
        for sandbox in h.sandboxes:
            await sandbox.destroy()
        left = await h.backend.labelled({TEST_LABEL: h.label})
        await h.backend.remove_labelled({TEST_LABEL: h.label})
        await h.backend.close()
        assert left == []


async def test_a_run_sends_its_output_and_exit(harness: Harness) -> None:
    sandbox = await harness.started("s")
    script = "import sys\nprint('hello')\nsys.stdout.write('x' * 300000)\nprint('oops', file=sys.stderr)\nsys.exit(3)\n"
    started, output = await run(sandbox, script)
    status = await asyncio.wait_for(started.wait(), 60)
    assert (status.exit_code, status.killed, status.oom_killed, status.lost) == (3, False, False, None)
    assert bytes(output["stdout"]) == b"hello\n" + b"x" * 300000
    assert bytes(output["stderr"]) == b"oops\n"
    assert sandbox.broken is None


async def test_runs_follow_each_other_with_their_env_and_the_sandbox_files(harness: Harness) -> None:
    sandbox = await harness.started("s", env={"A": "spec", "B": "spec"})
    first = "import os\nopen('note', 'w').write('kept')\nprint(os.environ['A'], os.environ['B'])\n"
    started, output = await run(sandbox, first, env={"B": "run"})
    assert (await asyncio.wait_for(started.wait(), 60)).exit_code == 0
    assert bytes(output["stdout"]) == b"spec run\n"
    second = "import os\nprint(open('note').read(), os.environ['B'])\n"
    started, output = await run(sandbox, second)
    assert (await asyncio.wait_for(started.wait(), 60)).exit_code == 0
    assert bytes(output["stdout"]) == b"kept spec\n"


async def test_sigterm_ends_a_script_as_killed(harness: Harness) -> None:
    sandbox = await harness.started("s")
    started, output = await run(sandbox, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    await until(output["stdout"], b"ready")
    await started.signal("SIGTERM")
    status = await asyncio.wait_for(started.wait(), 30)
    assert (status.exit_code, status.killed, status.oom_killed, status.lost) == (143, True, False, None)


async def test_kill_ends_a_script_that_ignores_sigterm(harness: Harness) -> None:
    sandbox = await harness.started("s")
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    started, output = await run(sandbox, script)
    await until(output["stdout"], b"ready")
    await started.kill()
    status = await asyncio.wait_for(started.wait(), 30)
    assert (status.exit_code, status.killed, status.lost) == (137, True, None)
    assert sandbox.broken is None  # nothing of the script was left: the sandbox takes the next run
    again, output = await run(sandbox, "print('next')\n")
    assert (await asyncio.wait_for(again.wait(), 60)).exit_code == 0
    assert bytes(output["stdout"]) == b"next\n"


async def test_a_signal_after_the_script_ended_by_itself_is_not_a_kill(harness: Harness) -> None:
    sandbox = await harness.started("s")
    started, _ = await run(sandbox, "import sys\nsys.exit(5)\n")
    status = await asyncio.wait_for(started.wait(), 60)
    await started.signal("SIGKILL")  # too late: nothing to signal
    assert (status.exit_code, status.killed) == (5, False)


async def test_sandboxes_are_listed_by_label_until_removed(harness: Harness) -> None:
    backend = harness.backend
    one = await harness.started("one")
    two = await harness.started("two")
    assert one.handle is not None and two.handle is not None
    assert sorted(await backend.labelled({TEST_LABEL: harness.label})) == sorted([one.handle.id, two.handle.id])
    assert await backend.labelled({TEST_LABEL: harness.label, LABEL_SANDBOX: "one"}) == [one.handle.id]
    assert await backend.exited(one.handle) is None
    await one.destroy()
    assert await backend.labelled({TEST_LABEL: harness.label}) == [two.handle.id]
    assert not one.folder.exists()
    assert await backend.remove_labelled({TEST_LABEL: harness.label}) == 1
    assert await backend.labelled({TEST_LABEL: harness.label}) == []
    await backend.remove(two.handle)  # gone already: not an error
    await backend.kill(two.handle)


async def test_a_sandbox_lost_from_outside_ends_its_run_lost(harness: Harness) -> None:
    sandbox = await harness.started("s")
    started, output = await run(sandbox, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    await until(output["stdout"], b"ready")
    assert sandbox.handle is not None
    await harness.lose(sandbox.handle)
    status = await asyncio.wait_for(started.wait(), 30)
    assert status.lost is not None and status.exit_code == 137 and not status.killed
    assert sandbox.broken is not None
    ended = await harness.backend.exited(sandbox.handle)
    assert ended is not None and ended.exit_code == 137
    with pytest.raises(SandboxError):
        await sandbox.run("job_after", {}, lambda _s, _d: None)


async def test_image_labels_list_the_runtime_features(harness: Harness) -> None:
    assert FEATURE_SESSION in features(await harness.backend.image_labels(harness.image))
    assert await harness.backend.image_labels(MISSING_IMAGE) == {}
    assert (await harness.backend.ready(harness.image))[0]
    assert not (await harness.backend.ready(MISSING_IMAGE))[0]


async def test_a_start_that_fails_leaves_nothing(harness: Harness) -> None:
    sandbox = ResidentSandbox(harness.backend, harness.spec("s", image=MISSING_IMAGE))
    with pytest.raises(SandboxError):
        await sandbox.start()
    assert await harness.backend.labelled({TEST_LABEL: harness.label}) == []
    assert not sandbox.folder.exists()


async def test_an_engine_that_cannot_be_reached_is_engine_unavailable(harness: Harness) -> None:
    backend = harness.unreachable()
    try:
        with pytest.raises(EngineUnavailable):
            await backend.image_labels(harness.image)  # never {}: the image's features are unknown, not absent
        with pytest.raises(EngineUnavailable):
            await backend.labelled({TEST_LABEL: harness.label})
        with pytest.raises(EngineUnavailable):
            await backend.start(harness.spec("s"), lambda _s, _d: None)
        ok, reason = await backend.ready(harness.image)
        assert not ok and "not reachable" in reason
    finally:
        await backend.close()
