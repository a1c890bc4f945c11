"""The script engine seam: what the job service asks of an engine that runs scripts, as one base class and three
small protocols.

An engine takes a job's script in one language, with the tool stubs it generates for that language, runs it in a
sandbox of its own kind, streams its output to the job's sink, ends it on request and reports how it ended; the
script's tool calls reach the job's broker through the ``CallPort`` the broker offers. Today's engine is
``service.engines.container.ContainerEngine`` (CPython in a container, on the Docker backend or the fake one);
another (Node.js in a container, an in-process interpreter) is one module more and one row of the composition
root's table (``service.composition.engine_table.ENGINES``): the broker, the job model, the views, the quotas and
the store do not change for it.

- ``Engine``: the engine: its name, the languages it runs, how a script is prepared (``prepare``: Python's
  repairs), its stubs, where a one-shot job's script runs (``take``, ``room_released``), a session's sandbox
  (``hold_room``, ``open_session``), its images (``require_image``), whether it can run scripts now (``ready``,
  ``missing_images``: ``GET /readyz`` and the start-up check), its warm sandboxes (``warm``), what an earlier run
  left (``sweep``), its start and close.
- ``Sandbox``: where the engine runs a job's script, one at a time: the run's files (``lay_out``), how calls reach
  the broker (``connect``), the run itself (``run``), files in and out between runs, its removal.
- ``EngineRun``: one running script: wait for its exit, signal it, kill it.
- ``CallPort``: what the broker offers an engine: a unix socket to listen on (``start``, for a sandbox in another
  process) or, in this process, one call at a time (``call``) and the runtime's report (``report``).
- ``EngineSite``: what an engine is built from (the composition root's table maps a name to a factory of one).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from service.normalize import Normalized
from service.quotas import HostCapacity
from service.sandbox.backend import ExitStatus, OutputSink, SandboxBackend, Stream
from service.sandbox.ports import Held, OutputCollector, StopHook
from service.sandbox.spec import SandboxLimits
from service.settings import Settings
from service.toolkit.cache import CompiledManifest

__all__ = [
    "JAVASCRIPT", "PYTHON", "TYPESCRIPT", "CallPort", "Engine", "EngineRun", "EngineSite", "ExitStatus",
    "OutputSink", "Sandbox", "Stream",
]  # fmt: skip

PYTHON = "python"
"""A Python script's language (a request's ``language`` when it names none)."""
JAVASCRIPT = "javascript"
"""A JavaScript script's language: an ES module with top-level ``await``."""
TYPESCRIPT = "typescript"
"""A TypeScript script's language: type-stripped by the engine, then run as JavaScript."""


class CallPort(Protocol):
    """How a script's tool calls reach its job's broker (``service.broker.Broker`` is one).

    A call made either way is bounded (the line cap, the requests and bytes in flight, the pace), read, checked,
    forwarded, recorded and answered the same way: the records, quotas, paused calls and views do not know which
    way it came.
    """

    async def start(self, path: Path) -> None:
        """Listen on the unix socket ``path`` (mode 0666): one JSON line per call (``service.broker``'s protocol),
        for a script in another process (a container's)."""

    async def call(self, tool: str, args: Any) -> dict[str, Any]:
        """Make one call from this process; returns the reply: ``{"ok": true, "result": value}`` or
        ``{"ok": false, "error": {"type", "message"}}`` (never raises for the call's own failure). A call whose line
        would pass the socket's line cap closes the port as it would a connection: it and every later call are
        answered ``broker_unavailable``."""

    def report(self, error: dict[str, Any] | None, ran_as_coroutine: bool = False) -> None:
        """Keep the runtime's report of the script's uncaught error (``type``, ``message``, ``line``, ...: the
        script's claim, kept as ``script_report``, never the verdict) and whether it ran as a coroutine, as the
        socket's ``{"op": "report"}`` line does."""


class EngineRun(Protocol):
    """One script running in a sandbox."""

    async def wait(self) -> ExitStatus:
        """The script's exit, once all its output has reached the run's sink (no time limit: the runner has it)."""

    async def signal(self, signal: str) -> None:
        """Send ``SIGTERM`` or ``SIGKILL`` to the script; nothing when it has ended. Whether the signal ended it is
        the exit's to say (``ExitStatus.killed``)."""

    async def kill(self) -> None:
        """End the script now (and what it started); if the sandbox does not confirm within the engine's
        ``kill_confirm_s``, end the sandbox too."""


class Sandbox(Protocol):
    """Where an engine runs scripts, one at a time: a one-shot job's own, or a session's, kept between its scripts.

    Attributes:
        started: whether it can run a script now (a warm sandbox: ``start`` is then not needed).
        sandbox_id: what a job's and a session's view show as ``sandbox_id`` (None before it started).
        broken: why it can run nothing more (None while it can): its session then ends ``broken``.
        stop_reason: what the report of its removal says (``session``, ``pool``, or the job's status).
        hash_seed: the seed its scripts hash strings with (``PYTHONHASHSEED``), kept with a durable job for its
            replays (``Engine.take``); None: its engine has none.
    """

    @property
    def started(self) -> bool: ...

    @property
    def sandbox_id(self) -> str | None: ...

    broken: str | None
    stop_reason: str
    hash_seed: int | None

    async def start(self) -> None:
        """Make it able to run scripts (a cold start). Raises SandboxError (nothing is left behind)."""

    async def lay_out(self, script: str, stubs: str | None, language: str = PYTHON) -> None:
        """Give it the next run's script in ``language`` and its stubs (None: the stubs it holds are the run's; a
        session's scripts are all in one language). Raises OSError."""

    async def connect(self, port: CallPort) -> None:
        """Make the next run's tool calls reach ``port`` (the job's broker)."""

    async def put_files(self, files: list[tuple[str, bytes]]) -> None:
        """Write ``files`` ((path, bytes), paths checked) into the working directory before a run. Raises
        FileRefused, SandboxError."""

    async def run(
        self, job_id: str, env: dict[str, str], sink: OutputSink, outputs: OutputCollector | None = None
    ) -> EngineRun:
        """Start the laid-out script of job ``job_id`` with ``env`` over the sandbox's own; its output goes to
        ``sink`` (on the event loop), the files it leaves in ``outputs/`` to ``outputs``. Raises SandboxError."""

    async def get_file_into(self, path: str, max_bytes: int, into: IO[bytes]) -> int:
        """Copy the regular file ``path`` of the working directory into ``into``; its size (bytes). Raises
        NoSuchFile, FileRefused, SandboxError."""

    async def list_files(self, max_entries: int) -> tuple[list[dict[str, Any]], bool]:
        """(entries, truncated): the working directory's entries (path, bytes, skipped). Raises SandboxError."""

    def forget_env(self) -> None:
        """Drop the environment its runs were given (an ended session keeps only its view)."""

    async def destroy(self, reason: str | None = None) -> None:
        """Remove it and all it holds (idempotent); ``reason`` marks it broken. Never raises."""


class Engine(abc.ABC):
    """One script engine (module docstring): a subclass sets ``name`` and ``languages`` and implements ``stubs``,
    ``take`` and ``open_session``; the rest has defaults for an engine that repairs no script and holds no host
    room and no images.

    Attributes:
        name: its name in the registry (``service.engines.Engines``), kept on each job it runs.
        languages: the script languages it runs (``PYTHON``, ``JAVASCRIPT``, ``TYPESCRIPT``); the first is its
            scripts' when a request names none.
        kill_confirm_s: how long a killed script's end may take to be confirmed (s), before the sandbox is ended.
    """

    name: str = ""
    languages: tuple[str, ...] = ()
    kill_confirm_s: float = 5.0

    @property
    def language(self) -> str:
        """The language of its scripts when a request names none: the first of ``languages``."""
        return self.languages[0]

    def prepare(self, script: str, repair: bool, language: str = PYTHON) -> Normalized:
        """The script in ``language`` to run and the verdict on it before it runs (``normalize.Normalized``):
        ``repair`` asks for the repairs of a script that does not compile (the request's ``normalize``). CPU-bound:
        called on a worker thread. The default runs the script as sent, with no verdict."""
        return Normalized(script, script)

    @abc.abstractmethod
    def stubs(self, manifest: CompiledManifest, language: str) -> str | None:
        """What a script in ``language`` imports to call ``manifest``'s tools (the ``tools`` module's source for
        Python), None when it needs nothing laid out."""

    @abc.abstractmethod
    def take(
        self, job_id: str, owner: str, limits: SandboxLimits, image: str, hash_seed: int | None = None
    ) -> Sandbox | None:
        """A sandbox for one-shot job ``job_id`` of ``owner`` (started or not: ``Sandbox.started``), with its host
        room committed; None when the host has no room for it now (``room_released`` then says when to ask
        again). Never waits. ``hash_seed``: a replay's (``Sandbox.hash_seed`` of the job's first run), for an engine
        whose scripts hash strings with a seed; one without ignores it.

        Raises:
            SandboxError: the engine cannot give the job a sandbox (any other exception is taken as a fault of the
                engine). Either way the job ends ``failed`` (error ``sandbox_error``, ``engine_unavailable`` or
                ``internal_error``: ``jobs.live.end_by_failure``) without running, and its script slot is given
                back by the caller; the engine must hold nothing for the job when it raises (room committed before
                the raise given back, a pooled sandbox taken returned or removed).
        """

    async def room_released(self, stop: asyncio.Event) -> None:
        """Wait until room on the host may have been released, or ``stop`` is set. The default waits for ``stop``
        (an engine whose ``take`` never answers None)."""
        await stop.wait()

    def hold_room(self, limits: SandboxLimits) -> Held | None:
        """Commit host room for a session's sandbox of ``limits`` (None: nothing to give back); raises
        QuotaExceeded when the host has none. Never waits. The default holds nothing."""
        return None

    @abc.abstractmethod
    async def open_session(
        self,
        session_id: str,
        limits: SandboxLimits,
        env: Mapping[str, str],
        image: str,
        runtime: str | None,
        held: Held | None,
    ) -> Sandbox:
        """Start the sandbox of session ``session_id`` (``env``: every run's; ``runtime``: the OCI runtime, None
        for the default); ``held`` (from ``hold_room``) is given back once it is removed. Raises SandboxError."""

    async def require_image(self, image: str, language: str = PYTHON) -> None:
        """Raise (``ImageUnusable``, a SandboxError; InvalidField when it does not run ``language``) unless ``image``
        (a name in ``PTC_IMAGES``) can run scripts in ``language`` here. The default accepts every name."""
        return None

    async def ready(self) -> tuple[bool, str]:
        """(ok, why not): whether it can run scripts now: it can be asked, and what its scripts need by default is
        there (the container engine: the engine answers, has the OCI runtime of ``PTC_RUNTIME``, and the default
        image is present). ``GET /readyz`` answers 503 (``reason`` ``engine``) while it is not. Never raises. The
        default is always ready."""
        return True, "ok"

    async def missing_images(self) -> dict[str, str]:
        """The images of ``PTC_IMAGES`` it cannot run scripts in now, beyond what ``ready`` checks: name -> why
        (by name, never by reference; empty when every one runs). ``GET /readyz`` answers 503 (``reason``
        ``images``) while one is. Raises SandboxError (EngineUnavailable: the engine cannot be asked). The default
        runs every image (as ``require_image``)."""
        return {}

    async def sweep(self) -> int:
        """Remove every sandbox of this instance the engine keeps outside this process (an earlier run's at start-up;
        at shutdown, what escaped its owner); returns how many. Raises SandboxError (EngineUnavailable: the engine
        cannot be asked). The default keeps none."""
        return 0

    def warm(self) -> dict[str, int]:
        """Sandboxes started ahead of time and waiting, by profile name (the ``ptc_sandbox_pool_size`` gauge). The
        default keeps none."""
        return {}

    async def start(self) -> None:
        """Start its background work (a warm pool). The default has none."""
        return None

    async def close(self) -> None:
        """Stop its background work and remove what it keeps (not the jobs' sandboxes). The default has none."""
        return None


@dataclass(frozen=True)
class EngineSite:
    """What an engine is built from (the composition root's ``ENGINES``: name -> factory of a site), the same for
    every engine of a service.

    Attributes:
        settings: the service's settings (the engine reads its own: images, runtime, limits, warm pools).
        backend: the sandbox backend (Docker, or the fake one in tests).
        capacity: the host's room that sandboxes commit their memory and CPUs to.
        folder: the folder its sandboxes' folders go under (``<folder>/jobs``, ``sessions``, ``pool``).
        instance_labels: the labels of every sandbox of this instance (what the start-up sweep removes).
        on_stop: told of each sandbox removed (the ``sandbox_stop`` log event); None: nobody.
    """

    settings: Settings
    backend: SandboxBackend
    capacity: HostCapacity
    folder: Path
    instance_labels: dict[str, str]
    on_stop: StopHook | None = None
