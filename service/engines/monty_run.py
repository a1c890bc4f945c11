"""One script run in a Monty worker: the ``tools`` module the script imports, and the loop that answers the
interpreter's suspensions (tool calls through the job's ``CallPort``, imports, name lookups) until the script ends.

The ``tools`` module (``ToolTable``, made once per manifest from ``toolkit.stubs.stub_tools``: the same paths,
signatures and names as the container engine's generated package) holds, for each tool, a host function Monty calls
out to: ``tools.<path>`` blocks for the result, ``tools.aio.<path>`` returns an awaitable (``asyncio.gather`` runs
them at once), and each top-level tool is also a global (``<name>(...)``), which blocks, except where Python's would
return a coroutine: awaited at once, inside an ``async def``, or anywhere in a script with top-level ``await``. The
arguments are bound host-side by the container runtime's own binder (``ptc_runtime.stubs``), so a call's record is
the same under both engines. A failed call raises ``RuntimeError("<type>: <message>")`` (Monty has no user-defined
exception classes; ``str(e)`` is what ``tools.ToolError``'s is).

Not available under Monty (docs/engines.md): ``tools.ToolError`` (catch ``RuntimeError`` or ``Exception``), a tool
that is also a namespace (``tools.auth(...)`` beside ``tools.auth.login``), dotted tools as globals.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import bisect
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ptc_runtime.stubs import _Binder

from service.engines.interface import CallPort, ExitStatus, OutputSink
from service.errors import SandboxError
from service.toolkit.stubs import StubTool

log = logging.getLogger(__name__)

SYNC, AWAITABLE, CONTEXT = "sync", "awaitable", "context"
SLEEPS = frozenset({"system.sleep", "system.async_sleep"})  # the interpreter's sleeps, answered by the run
OOM_EXIT = 137  # as a container's script killed by the OOM killer
OOM_MESSAGES = ("memory limit exceeded", "the worker exceeded its memory limit")  # pydantic-monty 1.4's
CRASH_EXIT = 139
PARSED_MAX_CHARS = 100_000  # a longer script's async contexts are not read (``AsyncContexts``)
SETTLE_BATCH_S = 0.001  # after a first answer of a gather, how long others may join it (each resume is a round trip)
FAILED_CALL_MESSAGES = 256  # failure messages kept to tell an uncaught tool failure's report from another error's


def _placeholder(*args: Any, **kwargs: Any) -> None:
    """What a tool is in the ``tools`` module: Monty suspends at a call of it, and the run loop answers."""


@dataclass(frozen=True)
class Entry:
    """A function the script can call: its tool's binder and how its result is given (``SYNC``, ``AWAITABLE``,
    ``CONTEXT``: a global)."""

    binder: _Binder
    mode: str


class ToolTable:
    """The ``tools`` module of one manifest (module docstring): ``module`` (an ``ExternalModule``), ``globals`` (the
    top-level tools, for ``external_lookup``) and ``entries`` (Monty's function name -> ``Entry``).

    Raises:
        ValueError: pydantic-monty refuses a namespace (one named like a module Monty provides: its message names
            it).
    """

    def __init__(self, tools: Iterable[StubTool]) -> None:
        from pydantic_monty import ExternalModule

        self.entries: dict[str, Entry] = {}
        self.globals: dict[str, Any] = {}
        self.namespaced_tools: list[tuple[str, str]] = []  # (tool, namespace path): a module, not callable
        tree: dict[str, Any] = {}
        for tool in tools:
            if tool.path.endswith("__call__"):
                self.namespaced_tools.append((tool.tool, tool.path.removesuffix(".__call__")))
                continue
            binder = _binder(tool)
            self.entries[f"tools.{tool.path}"] = Entry(binder, SYNC)
            self.entries[f"tools.aio.{tool.path}"] = Entry(binder, AWAITABLE)
            *parents, leaf = tool.path.split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            else:
                node[leaf] = _placeholder
            if not parents:
                self.entries[leaf] = Entry(binder, CONTEXT)
                self.globals[leaf] = _placeholder

        def build(node: dict[str, Any]) -> Any:
            return ExternalModule({k: build(v) if isinstance(v, dict) else v for k, v in node.items()})

        self.module = ExternalModule({**{k: build(v) if isinstance(v, dict) else v for k, v in tree.items()},
                                      "aio": build(tree)})  # fmt: skip


def _out_of_memory(message: str, frames: list[Any]) -> bool:
    """Whether a ``MemoryError`` is the interpreter's limit (the heap's, or its worker's), not one the script raised:
    its text is the limit's and the line it was raised at is no ``raise`` statement (a script cannot forge the
    ``oom_killed`` verdict; a real one re-raised by the script counts as its own failure)."""
    if not message.startswith(OOM_MESSAGES):
        return False
    line = frames[-1].source_line if frames else None
    return not (line or "").lstrip().startswith("raise")


async def _slept(delay: float) -> dict[str, Any]:
    """An ``asyncio.sleep`` of the script: its answer, after ``delay`` seconds."""
    await asyncio.sleep(delay)
    return {"ok": True, "result": None}


def _binder(tool: StubTool) -> _Binder:
    """The container runtime's binder for ``tool``'s signature (only names and defaults matter to it)."""
    parameters = [
        inspect.Parameter(
            name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty if required else None
        )
        for name, required in tool.parameters
    ]

    def signature() -> None: ...

    signature.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    signature.__qualname__ = tool.path
    return _Binder(tool.tool, signature, dict(tool.renames), tool.first_takes_object)


class AsyncContexts:
    """Where in a script a global tool returns an awaitable (module docstring): byte ranges of ``async def`` bodies,
    and whether the script awaits at its top level. Parsed by CPython's ``ast`` on first use; a script it cannot parse
    has none (its globals block)."""

    def __init__(self, script: str) -> None:
        self._script = script
        self._parsed = False
        self._top_level = False
        self._spans: list[tuple[int, int]] = []

    async def awaitable_at(self, offset: int) -> bool:
        """Whether a global called at byte ``offset`` of the script returns an awaitable (parsed on first use, on a
        worker thread; a script over ``PARSED_MAX_CHARS`` is not parsed: there only an awaited call is one)."""
        if not self._parsed:
            self._parsed = len(self._script) > PARSED_MAX_CHARS  # CPython's parser holds the interpreter's lock
            if not self._parsed:
                await asyncio.to_thread(self._parse)
        if self._top_level:
            return True
        index = bisect.bisect_right(self._spans, (offset, float("inf"))) - 1
        return any(start <= offset < end for start, end in self._spans[max(index - 64, 0) : index + 1])

    def _parse(self) -> None:
        self._parsed = True
        try:
            tree = ast.parse(self._script)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return
        starts = [0]
        for line in self._script.encode().splitlines(keepends=True):
            starts.append(starts[-1] + len(line))

        def offset(line: int, column: int) -> int:
            return starts[line - 1] + column if line - 1 < len(starts) else starts[-1]

        functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
        for node in ast.walk(tree):
            if isinstance(node, ast.AsyncFunctionDef) and node.end_lineno is not None:
                self._spans.append(
                    (offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset or 0))
                )
        stack: list[ast.AST] = list(tree.body)
        while stack and not self._top_level:
            node = stack.pop()
            if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
                self._top_level = True
            elif not isinstance(node, functions):
                stack.extend(ast.iter_child_nodes(node))
        self._spans.sort()


class MontyRun:
    """One script running in a checked-out Monty session, as an asyncio task (``EngineRun``).

    Args:
        session: the entered ``AsyncMontySession`` (its worker is the run's for as long as it runs).
        script: the script.
        table: its manifest's ``ToolTable``.
        port: the job's broker (``CallPort.call``, ``CallPort.report``).
        sink: the job's output sink (``stdout``/``stderr``, bytes).
    """

    def __init__(
        self,
        session: Callable[[], Awaitable[Any]],
        script: str,
        table: ToolTable,
        port: CallPort,
        sink: OutputSink,
        state: bytes | None = None,
    ) -> None:
        self.exit: asyncio.Future[ExitStatus] = asyncio.get_running_loop().create_future()
        self._get_session = session  # waited for in the run: its time limit and a stop bound the wait
        self._session: Any = None
        self._state = state  # what it continues from (``suspend``'s), else it starts the script
        self._waiting: Any = None  # the snapshot the run waits at while calls are under way (``suspend`` dumps it)
        self._requests: dict[int, dict[str, Any]] = {}  # each awaitable call's request, by the interpreter's id
        self._suspended = False
        self._snapshot: Any = None  # the future snapshot being settled
        self._script = script
        self._table = table
        self._port = port
        self._sink = sink
        self._contexts = AsyncContexts(script)
        self._calls: dict[int, tuple[asyncio.Future[dict[str, Any]], _Binder | None]] = {}  # awaitables pending
        self._sync: asyncio.Future[dict[str, Any]] | None = None  # the call the script blocks on, if any
        self._failures: list[str] = []
        self._signalled = 0
        self.spoiled: str | None = None  # why the interpreter's state can no longer be trusted after this run
        self.task = asyncio.ensure_future(self._run())
        self.task.add_done_callback(self._ended)

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self.exit)

    async def signal(self, signal: str) -> None:
        """``SIGTERM`` and ``SIGKILL`` both end the run now (an interpreter has no handler to give a grace to)."""
        if not self.task.done():
            self._signalled = 9 if signal == "SIGKILL" else 15
            self.task.cancel()

    async def kill(self) -> None:
        await self.signal("SIGKILL")

    async def suspend(self) -> bytes | None:
        """The interpreter's state where the script waits for calls (its dump, and the awaitable calls it waits for),
        for a run that continues from it (``MontyRun(state=...)``); None unless it waits for calls only (one done
        already, a sleep, or no wait: the job resumes by replay). Stops the driving of the run: the calls under way
        go on until the broker ends them."""
        waiting, calls = self._waiting, list(self._calls.values())
        if waiting is None or self.task.done() or any(c.done() or b is None for c, b in calls):
            return None
        if self._sync is not None and self._sync.done():
            return None
        self._suspended = True
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        try:
            dump = waiting.dump()
        except Exception:  # the worker went away: a replay it is
            log.warning("a Monty run could not be dumped for its park", exc_info=True)
            return None
        state = {"dump": base64.b64encode(dump).decode(), "calls": self._requests}
        return json.dumps(state, separators=(",", ":")).encode()

    def _print(self, stream: str, text: str) -> None:
        self._sink("stderr" if stream == "stderr" else "stdout", text.encode("utf-8", "surrogatepass"))

    async def _run(self) -> ExitStatus:
        from pydantic_monty import MontyCrashedError, MontyError, MontyRuntimeError, MontySyntaxError

        try:
            await self._drive()
            return ExitStatus(0, oom_killed=False)
        except MontySyntaxError as exc:
            return self._failed(exc, "SyntaxError", str(exc))
        except MontyRuntimeError as exc:
            inner = exc.exception()
            kind, message = type(inner).__name__, str(inner)
            if isinstance(inner, MemoryError) and _out_of_memory(message, exc.traceback()):
                self._sink("stderr", f"MemoryError: {message}\n".encode())
                self.spoiled = "it ran out of memory"
                return ExitStatus(OOM_EXIT, oom_killed=True)
            if isinstance(inner, TimeoutError) and not exc.traceback():  # the interpreter's own time limit
                self.spoiled = "its time limit stopped it mid-operation"
            if kind == "RuntimeError" and message in self._failures:
                kind = "ToolError"
            return self._failed(exc, kind, message)
        except MontyCrashedError as exc:
            why = "its watchdog ended it" if exc.timed_out else str(exc)
            self.spoiled = f"its worker died ({why})"[:300]
            return ExitStatus(CRASH_EXIT, oom_killed=False, lost=f"the Monty worker died ({why})"[:500])
        except MontyError as exc:
            return self._failed(exc, type(exc).__name__, str(exc))
        except SandboxError as exc:  # no worker for it (``WorkersBusy``, or none could start)
            self._sink("stderr", f"ptc-sandbox: {exc}\n".encode())
            return ExitStatus(CRASH_EXIT, oom_killed=False, lost=str(exc)[:500])
        finally:
            for call, _ in self._calls.values() if not self._suspended else ():  # suspended: the broker ends them
                call.cancel()

    def _failed(self, exc: Any, kind: str, message: str) -> ExitStatus:
        """Exit 1, the interpreter's traceback on stderr and its report to the broker (type, message, line)."""
        report: dict[str, Any] = {"type": kind, "message": message}
        frames = exc.traceback() if hasattr(exc, "traceback") else []
        if frames:
            report["line"] = frames[-1].line
            report["column"] = frames[-1].column
        text = exc.display("traceback") if hasattr(exc, "display") else f"{kind}: {message}"
        self._sink("stderr", text.rstrip("\n").encode("utf-8", "surrogatepass") + b"\n")
        self._port.report(report)
        return ExitStatus(1, oom_killed=False)

    async def _drive(self) -> None:
        from pydantic_monty import AsyncFunctionSnapshot, AsyncFutureSnapshot, MontyComplete

        self._session = await self._get_session()
        if self._state is None:
            snapshot = await self._session.feed_start(
                self._script, print_callback=self._print, external_lookup=self._table.globals
            )
        else:
            snapshot = await self._restore(json.loads(self._state))
        while not isinstance(snapshot, MontyComplete):
            if isinstance(snapshot, AsyncFunctionSnapshot):
                if snapshot.is_os_function and str(snapshot.function_name) in SLEEPS:
                    snapshot = await self._sleep(snapshot)
                elif snapshot.is_os_function:
                    snapshot = await snapshot.resume_auto()  # imports; files and the clock are Monty's defaults
                else:
                    snapshot = await self._call(snapshot)
            elif isinstance(snapshot, AsyncFutureSnapshot):
                self._snapshot = snapshot
                snapshot = await snapshot.resume(await self._settle(snapshot.pending_call_ids))
            else:
                snapshot = await snapshot.resume_auto()  # a name: a global tool or a NameError

    async def _restore(self, state: dict[str, Any]) -> Any:
        """The interpreter's snapshot ``state`` holds (``suspend``'s), re-announced, and its awaitable calls made
        again (the broker answers each from its call log, or waits for the harness as before)."""
        snapshot = await self._session.load_snapshot(
            base64.b64decode(state["dump"]), print_callback=self._print, external_lookup=self._table.globals
        )
        for key, request in state["calls"].items():
            entry = self._table.entries.get(request["name"])
            call = self._port.call(request["tool"], request["args"], request.get("repair"))
            self._calls[int(key)] = (asyncio.ensure_future(call), entry.binder if entry else None)
            self._requests[int(key)] = request
        return snapshot

    async def _sleep(self, snapshot: Any) -> Any:
        """``time.sleep`` waits here (the job's time limit bounds it); ``asyncio.sleep`` is an awaitable that ends
        after its delay, so gathered sleeps overlap."""
        delay = snapshot.args[0] if snapshot.args else None
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < float("inf"):
            return await snapshot.resume({"exc_type": "ValueError", "message": "sleep length must be a number >= 0"})
        if str(snapshot.function_name) == "system.sleep":
            await asyncio.sleep(delay)
            return await snapshot.resume({"return_value": None})
        self._calls[snapshot.call_id] = (asyncio.ensure_future(_slept(delay)), None)
        return await snapshot.resume({"future": ...})

    async def _call(self, snapshot: Any) -> Any:
        name = str(snapshot.function_name)
        entry = self._table.entries.get(name)
        if entry is None:  # a builtin Monty lacks (dir, vars, input), or a tool the manifest has not
            if name.startswith("tools."):
                message = f"module 'tools' has no attribute {name.split('.', 1)[1]!r}"
                return await snapshot.resume({"exc_type": "AttributeError", "message": message})
            return await snapshot.resume({"exc_type": "NameError", "message": f"name {name!r} is not defined"})
        try:
            request = entry.binder.request(tuple(snapshot.args), dict(snapshot.kwargs))
        except TypeError as exc:
            return await snapshot.resume({"exc_type": "TypeError", "message": str(exc)})
        awaitable = entry.mode == AWAITABLE or (
            entry.mode == CONTEXT
            and (snapshot.allow_eager_await or await self._contexts.awaitable_at(snapshot.position.start))
        )
        call = asyncio.ensure_future(self._port.call(request["tool"], request["args"], request.get("repair")))
        if awaitable:
            self._calls[snapshot.call_id] = (call, entry.binder)
            self._requests[snapshot.call_id] = {**request, "name": name}
            return await snapshot.resume({"future": ...})
        self._waiting, self._sync = snapshot, call
        try:
            reply = await asyncio.shield(call)  # a cancelled run (``suspend``) leaves the call to the broker
        finally:
            self._waiting = self._sync = None
        return await snapshot.resume(self._answer(entry.binder, reply))

    async def _settle(self, call_ids: list[int]) -> dict[int, Any]:
        """The answers of the calls ``call_ids`` that have ended, waiting for at least one."""
        waiting = [self._calls[i][0] for i in call_ids if i in self._calls]
        if waiting and not any(call.done() for call in waiting):
            self._waiting = self._snapshot
            try:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.wait(waiting, timeout=SETTLE_BATCH_S)  # the answers close behind it: one resume
            finally:
                self._waiting = None
        settled: dict[int, Any] = {}
        for call_id in call_ids:
            pending = self._calls.get(call_id)
            if pending is None:  # not one of this run's calls: never answered by the loop
                settled[call_id] = {"exc_type": "RuntimeError", "message": "broker_unavailable: the call was lost"}
            elif pending[0].done():
                del self._calls[call_id]
                self._requests.pop(call_id, None)
                settled[call_id] = self._answer(pending[1], pending[0].result())
        return settled

    def _answer(self, binder: _Binder | None, reply: dict[str, Any]) -> dict[str, Any]:
        """What a call's reply resumes the script with: its result, or ``RuntimeError("<type>: <message>")`` (an
        ``invalid_arguments`` message with the stub's signature, as the container runtime's)."""
        if reply.get("ok"):
            return {"return_value": reply.get("result")}
        error = reply.get("error") or {}
        kind, message = str(error.get("type", "internal_error")), str(error.get("message", ""))
        if kind == "invalid_arguments" and binder is not None:
            message = f"{message}; the stub is {binder.signature_text()}"
        text = f"{kind}: {message}"
        if len(self._failures) < FAILED_CALL_MESSAGES:
            self._failures.append(text)
        return {"exc_type": "RuntimeError", "message": text}

    def _ended(self, task: asyncio.Task[ExitStatus]) -> None:
        if self.exit.done():
            return
        if task.cancelled():
            self.spoiled = self.spoiled or "it was killed (a stop or its time limit)"
            self.exit.set_result(ExitStatus(128 + (self._signalled or 9), oom_killed=False, killed=True))
        elif (error := task.exception()) is not None:
            log.error("a Monty run failed in the service", exc_info=error)
            self._sink("stderr", b"ptc-sandbox: the Monty engine failed running this script\n")
            self.exit.set_result(ExitStatus(70, oom_killed=False, lost=f"the Monty engine failed: {error!r}"[:500]))
        else:
            self.exit.set_result(task.result())
