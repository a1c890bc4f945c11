"""The small interface every sandbox backend implements (start, wait, kill, remove, list, sweep).

A backend runs the sandbox image with a folder mounted read-only at
``/run/ptc`` (control socket, broker socket, ``tools`` package,
``script.py``); the image's entrypoint starts the resident interpreter, which
runs scripts on the service's request (``service.sandbox.resident``). The
container's own output (the interpreter's, outside any script) is pushed to
an ``OutputSink`` as raw bytes. All methods are coroutines: blocking engine
calls run off the event loop. Backends: ``docker.DockerBackend`` (the engine)
and ``fake.FakeBackend`` (in memory, for tests without an engine).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ptc_runtime import protocol

Stream = Literal["stdout", "stderr"]
OutputSink = Callable[[Stream, bytes], None]
"""Receives each chunk of output as it arrives: a run's (``ResidentRun``, on the event loop) or a container's own
(from a backend's thread: the Docker backend's attach reader)."""

RUN_DIR = protocol.RUN_DIR
"""Where the sandbox's folder appears inside the sandbox."""


def write_run_files(folder: Path, script: str, stub_source: str | None, language: str = protocol.PYTHON) -> None:
    """Lay out a run in ``folder``: the script of ``language`` (``protocol.SCRIPTS``: ``script.py``, ``script.mjs``,
    ``script.ts``) and (unless ``stub_source`` is None: unchanged) its stubs: ``tools/__init__.py`` for Python,
    ``tools.mjs`` (``protocol.JS_TOOLS``) for JavaScript and TypeScript.

    The folder and files are world-readable (the sandbox user reads them through the read-only mount).
    The broker's ``tools.sock`` is added by the broker itself.
    """
    folder.mkdir(parents=True, mode=0o755, exist_ok=True)
    os.chmod(folder, 0o755)
    if language != protocol.PYTHON:
        for name, text in ((protocol.JS_TOOLS, stub_source), (protocol.SCRIPTS[language], script)):
            if text is not None:
                (folder / name).write_text(text, encoding="utf-8", errors="surrogatepass")
                os.chmod(folder / name, 0o644)
        return
    if stub_source is not None:
        package = folder / "tools"
        package.mkdir(mode=0o755, exist_ok=True)
        os.chmod(package, 0o755)
        (package / "__init__.py").write_text(stub_source, encoding="utf-8")
        os.chmod(package / "__init__.py", 0o644)
    (folder / "script.py").write_text(script, encoding="utf-8", errors="surrogatepass")
    os.chmod(folder / "script.py", 0o644)


@dataclass(frozen=True)
class SandboxSpec:
    """What one sandbox is given.

    Attributes:
        image: image reference.
        job_dir: host folder mounted read-only at ``RUN_DIR``.
        memory_mb: memory limit in MiB; swap is not added (memory+swap = memory).
        cpus: CPU quota in CPUs (fractions allowed).
        pids: maximum processes and threads.
        tmp_mb: size of the tmpfs at ``/tmp`` in MiB.
        file_size_mb: RLIMIT_FSIZE in MiB.
        open_files: RLIMIT_NOFILE.
        env: extra environment variables for the script.
        labels: engine labels: the instance (for the start-up sweep) and one unique to the sandbox (a start that
            fails removes whatever carries all of them).
        runtime: OCI runtime name (``runsc`` for gVisor), None for the engine default.
        hash_seed: the seed of the interpreter's string hashing (``PYTHONHASHSEED``, 1 to 2**32 - 1): a replay of a
            job runs with its first run's; None: one drawn for each sandbox (``ResidentSandbox``).
    """

    image: str
    job_dir: Path
    memory_mb: int
    cpus: float
    pids: int
    tmp_mb: int
    file_size_mb: int
    open_files: int
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    runtime: str | None = None
    hash_seed: int | None = None


@dataclass(frozen=True)
class ExitStatus:
    """How a script ended: ``exit_code`` (128+N for signal N), whether the OOM killer ended it, ``lost``: why
    the sandbox could not say (its resident interpreter died or misbehaved), None when it did, and ``killed``:
    whether it died by a signal the sandbox sent at the service's request (stop, timeout) while it still ran;
    ``stamps``: the sandbox's own moments of the run and when its exit was read, for a timed request's breakdown
    only (``service.observability.stages``; untrusted, never part of a view)."""

    exit_code: int
    oom_killed: bool
    lost: str | None = None
    killed: bool = False
    stamps: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass
class SandboxHandle:
    """A started sandbox: ``id`` is the engine's container id."""

    id: str
    spec: SandboxSpec


class SandboxBackend(abc.ABC):
    """One container engine."""

    @abc.abstractmethod
    async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
        """Create and start a sandbox, streaming its output to ``sink`` from the first byte.

        Raises:
            SandboxError: the engine refused or failed (nothing is left behind).
            EngineUnavailable: the engine cannot be reached.
        """

    @abc.abstractmethod
    async def wait(self, handle: SandboxHandle) -> ExitStatus:
        """Wait (without limit) until the main process exits and all output has reached the sink."""

    @abc.abstractmethod
    async def exited(self, handle: SandboxHandle) -> ExitStatus | None:
        """How the sandbox ended, or None while it runs (never blocks: one look at the engine)."""

    async def oom_reported(self, handle: SandboxHandle, wait_s: float) -> bool:
        """Whether the engine saw the kernel's OOM killer act in the sandbox (a source no script can write), waiting
        up to ``wait_s`` seconds for a report that comes after the exit; returns as soon as one is seen.

        The default looks at the sandbox's exit once (``ExitStatus.oom_killed``); a backend whose engine reports an
        OOM kill apart from the exit (Docker's ``oom`` event) overrides it.
        """
        ended = await self.exited(handle)
        return ended is not None and ended.oom_killed

    @abc.abstractmethod
    async def kill(self, handle: SandboxHandle) -> None:
        """SIGKILL everything in the sandbox; no error if it has already exited."""

    @abc.abstractmethod
    async def remove(self, handle: SandboxHandle) -> None:
        """Remove the sandbox whatever its state; no error if it is already gone."""

    @abc.abstractmethod
    async def labelled(self, labels: Mapping[str, str]) -> list[str]:
        """The ids of every sandbox (running or not, not yet removed) carrying all of ``labels``.

        Raises:
            SandboxError: the engine failed.
            EngineUnavailable: the engine cannot be reached.
        """

    @abc.abstractmethod
    async def remove_labelled(self, labels: Mapping[str, str]) -> int:
        """Remove every sandbox carrying all of ``labels``; returns how many."""

    @abc.abstractmethod
    async def image_labels(self, image: str) -> dict[str, str]:
        """The image's labels: {} when the image is missing or has none.

        Raises:
            SandboxError: the engine failed.
            EngineUnavailable: the engine cannot be reached (never answered as {}: a caller that reads a feature
                from the labels must not conclude the image lacks it).
        """

    @abc.abstractmethod
    async def ready(self, image: str) -> tuple[bool, str]:
        """(ok, reason): the engine answers and ``image`` is present."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the backend's resources (not the sandboxes)."""
