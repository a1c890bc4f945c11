"""The Monty engine's sandbox: a one-shot job's or a session's place in its key's worker pool (``MontySandbox``),
and the ``tools`` module of a manifest's plan (``tools_module``, made once per plan)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from functools import lru_cache
from typing import IO, TYPE_CHECKING, Any

from service.engines.interface import PYTHON, CallPort, EngineRun, OutputSink
from service.engines.monty_run import MontyRun, ToolTable
from service.engines.monty_workers import WorkersBusy
from service.errors import FileRefused, NoSuchFile, SandboxError
from service.sandbox.ports import OutputCollector
from service.sandbox.spec import SandboxLimits
from service.toolkit.stubs import StubTool

if TYPE_CHECKING:
    from service.engines.monty import MontyEngine

log = logging.getLogger(__name__)

PRINT_FLUSH_S = 0.001  # a worker holds printed output at most this long: a worker that dies loses at most that
# (0, a message per line, made 300,000 prints take 7 s instead of 0.2 s)
INLINE_PLAN_CHARS = 65536  # a larger plan's tools module is made on a worker thread
TIME_BACKSTOP_S = 2.0  # the interpreter's own feed time limit is the job's timeout plus this
SESSION_SUSPENSIONS = 100  # a session's checkout serves many scripts: its suspensions budget is this many jobs'


@lru_cache(maxsize=64)
def tools_module(plan: str) -> ToolTable:
    """The ``tools`` module of a plan (``MontyEngine.stubs``), made once per plan text."""
    tools = [StubTool(t["tool"], t["path"], tuple(map(tuple, t["parameters"])), t["renames"], t["object"])
             for t in json.loads(plan)]  # fmt: skip
    return ToolTable(tools)


class MontySandbox:
    """A one-shot job's or a session's place in its key's worker pool (``Sandbox``). A one-shot job's worker is
    checked out for its run and given back after it; a session's (``keep``) is checked out at its first script and
    kept for the next ones, so a session keeps its interpreter's state between scripts (globals, functions, imports)
    until it ends. A run that ends the interpreter's guarantees about its state (killed: a stop or the time limit;
    out of memory; its worker died) ends a session ``broken``."""

    started = True
    hash_seed: int | None = None

    def __init__(self, engine: MontyEngine, owner: str, limits: SandboxLimits, keep: bool = False) -> None:
        self._engine = engine
        self._owner = owner
        self._limits = limits
        self._keep = keep
        self.sandbox_id: str | None = "monty-" + secrets.token_hex(8)
        self.broken: str | None = None
        self.stop_reason = "session" if keep else "job"
        self._script = ""
        self._plan = "[]"
        self._port: CallPort | None = None
        self._checkout: Any = None
        self._session: Any = None
        self._modules: dict[str, Any] = {}  # the checkout's external modules, read live: a new manifest's tools
        self._run: MontyRun | None = None
        self._state: bytes | None = None  # what the next run continues from (``restore``)

    async def start(self) -> None:
        return None

    async def lay_out(self, script: str, stubs: str | None, language: str = PYTHON) -> None:
        self._script = script
        if stubs is not None:
            self._plan = stubs

    async def restore(self, state: bytes) -> None:
        """Make the next run continue from ``state`` (``MontyRun.suspend``'s) in a new interpreter session."""
        if self._keep:
            raise SandboxError("a session's script is not resumed from a saved state")
        self._state = state

    async def connect(self, port: CallPort) -> None:
        self._port = port

    async def put_files(self, files: list[tuple[str, bytes]]) -> None:
        """Raises FileRefused: a Monty script has no file system (the container engine's have one)."""
        if files:
            raise FileRefused("failed", "the monty engine has no file system: send files to a container engine job")

    async def run(
        self, job_id: str, env: dict[str, str], sink: OutputSink, outputs: OutputCollector | None = None
    ) -> EngineRun:
        """Check a worker out of the key's pool (a session's: at its first script) and start the script in it.
        Raises SandboxError (EngineUnavailable: the engine cannot start workers here)."""
        if self._port is None:
            raise SandboxError("the run was not connected to its broker")
        if self.broken is not None:
            raise SandboxError(self.broken)
        plan = self._plan
        table = await asyncio.to_thread(tools_module, plan) if len(plan) > INLINE_PLAN_CHARS else tools_module(plan)
        self._modules["tools"] = table.module
        if outputs is not None:
            outputs.end()  # no outputs/: nothing to collect
        # the worker is waited for inside the run: its time limit and a stop bound the wait
        run = self._run = MontyRun(self._session_now, self._script, table, self._port, sink, self._state)
        run.exit.add_done_callback(lambda _: asyncio.ensure_future(self._ended(run)))
        return run

    async def _session_now(self) -> Any:
        """The run's interpreter session: the session's kept one, or one of the key's workers checked out now."""
        if self._session is None:
            await self._check_out()
        return self._session

    async def _check_out(self) -> None:
        timeout_s = float(getattr(self._limits, "timeout_s", self._engine.max_timeout_s))
        limits = {
            "max_memory": self._limits.memory_mb * 1024 * 1024,
            "max_feed_duration_secs": (self._engine.max_timeout_s if self._keep else timeout_s) + TIME_BACKSTOP_S,
            "max_suspensions": self._engine.max_suspensions * (SESSION_SUSPENSIONS if self._keep else 1),
        }
        self._checkout = self._engine.workers().checkout(
            self._owner, limits=limits, external_modules=self._modules, print_flush_interval=PRINT_FLUSH_S
        )
        try:
            self._session = await self._checkout.__aenter__()
        except WorkersBusy:
            self._checkout = None
            raise
        except Exception as exc:
            self._checkout = None
            raise SandboxError(f"no Monty worker could be started: {exc}") from exc

    async def _ended(self, run: MontyRun) -> None:
        """After a run: a one-shot job's worker given back; a session's kept, unless the run spoiled it."""
        if self._keep and run.spoiled is not None:
            self.broken = self.broken or f"the session's interpreter was lost: {run.spoiled}"
        if not self._keep or self.broken is not None:
            await self._give_back()

    async def _give_back(self) -> None:
        checkout, self._checkout, self._session = self._checkout, None, None
        if checkout is not None:
            try:
                await checkout.__aexit__(None, None, None)
            except Exception:  # a worker that died is replaced by its pool
                log.debug("a Monty worker was not given back cleanly", exc_info=True)

    async def get_file_into(self, path: str, max_bytes: int, into: IO[bytes]) -> int:
        raise NoSuchFile(path)

    async def list_files(self, max_entries: int) -> tuple[list[dict[str, Any]], bool]:
        return [], False

    def forget_env(self) -> None:
        return None

    async def destroy(self, reason: str | None = None) -> None:
        """End a run still going and give its worker back. Never raises."""
        self.broken = self.broken or reason
        if self._run is not None and not self._run.task.done():
            await self._run.kill()
            await asyncio.gather(self._run.task, return_exceptions=True)
        await self._give_back()
