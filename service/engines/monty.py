"""The Monty engine: Python scripts in the Monty interpreter (PyPI ``pydantic-monty``: pydantic's sandboxed Python
subset, in Rust), in worker processes confined by the operating system (``monty_workers``), one pool per API key.

A job's sandbox (``monty_sandbox.MontySandbox``) is a worker of its key's pool, checked out for the run: no
container, no file system, nothing to start. The script's tool calls reach the job's broker in this process
(``CallPort.call``), through the ``tools`` module ``monty_run`` gives it; the broker, records, limits, quotas, views
and store are the container engine's. Limits: ``memory_mb`` is the interpreter's heap limit (a script past it ends
``oom_killed``), ``timeout_s`` is the runner's as for any job (the interpreter's own time limit, a little longer, is a
backstop); recursion depth is the interpreter's (1000).

What Monty runs is a subset of Python (docs/engines.md): ``MONTY_MODULES`` are the modules it provides. ``engine:
"auto"`` picks Monty for a script that compiles under Monty and imports only those (``MontyEngine.suits``), decided
before anything runs.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service import normalize
from service.engines.interface import PYTHON, Engine, EngineSite, Sandbox
from service.engines.monty_sandbox import INLINE_PLAN_CHARS, MontySandbox, tools_module
from service.engines.monty_workers import (
    WorkerPools,
    WorkersBusy,
    WorkersUnavailable,
    monty_binary,
    remove_launcher,
    write_launcher,
)
from service.errors import EngineUnavailable, InvalidField
from service.normalize import Normalized
from service.sandbox.ports import Held
from service.sandbox.spec import SandboxLimits
from service.settings import DEFAULT_IMAGE
from service.toolkit.cache import CompiledManifest
from service.toolkit.stubs import stub_tools, type_stubs_of

log = logging.getLogger(__name__)

MONTY = "monty"
"""The Monty engine's name."""

MONTY_MODULES = frozenset(
    "asyncio base64 binascii bisect collections copy csv dataclasses datetime decimal functools hashlib itertools "
    "json math os os.path pathlib random re sys time tomllib typing unicodedata tools".split()
)
"""Modules a script may import under Monty 1.4 (measured: ``import <name>`` succeeds in a worker), and ``tools``."""
CHECK_STOP = "ptc_check_stop_"
"""The function a checked script is made to call first (``MontyEngine.check``; its name ends in a new random suffix
each time, so the script cannot define it): nothing of the script runs."""
AST_MAX_CHARS = 100_000
"""Scripts up to this long are read by CPython's parser for ``auto`` and for what Monty cannot offer; the parser holds
the interpreter's lock (a 1 MiB script: seconds), so a longer one is never sent to Monty by ``auto``."""
CHECK_LIMIT_S = 5.0  # the type check's own time limit (a check past it is not the script's error: a 422)
CHECKOUT_WAIT_S = 5.0  # how long a check or ``auto``'s test waits for one of the key's workers
TYPE_STUBS_KEPT_CHARS = 4 * 1024 * 1024  # a manifest's .pyi is kept with it up to this (1,000 tools: ~1 MB)
SUSPENSIONS_PER_CALL = 3  # a call's suspensions (the call, its future's settling, a lookup), for max_suspensions


class MontyEngine(Engine):
    """Python scripts in confined Monty workers (module docstring).

    Args:
        site: what it is built from: its settings (``PTC_MONTY_*``, ``PTC_MAX_TOOL_CALLS``, ``PTC_MAX_TIMEOUT_S``).
    """

    name = MONTY
    languages = (PYTHON,)
    kill_confirm_s = 2.0
    takes_files = False
    takes_env = False

    def __init__(self, site: EngineSite) -> None:
        self._settings = site.settings
        self._launcher: Path | None = None
        self._workers: WorkerPools | None = None
        self._why: str | None = "the Monty engine has not started"
        self.max_suspensions = SUSPENSIONS_PER_CALL * site.settings.max_tool_calls + 10_000
        self.max_timeout_s = site.settings.max_timeout_s
        self._checks: dict[str, asyncio.Semaphore] = {}  # per key (configured keys: bounded): one check at a time

    def prepare(self, script: str, repair: bool, language: str = PYTHON) -> Normalized:
        """Python's repairs of a script that does not compile, and the compile verdict (``service.normalize``)."""
        return normalize.prepare(script, repair)

    def stubs(self, manifest: CompiledManifest, language: str) -> str:
        """The plan of the ``tools`` module (``toolkit.stubs.stub_tools`` as JSON), made once per manifest."""

        def plan() -> str:
            return json.dumps(
                [{"tool": t.tool, "path": t.path, "parameters": t.parameters, "renames": t.renames,
                  "object": t.first_takes_object} for t in stub_tools(manifest.tools.values())],
                separators=(",", ":"),
            )  # fmt: skip

        return manifest.derived("monty", plan)

    async def unsupported(self, manifest: CompiledManifest, script: str) -> str | None:
        """What of ``manifest`` Monty cannot offer ``script``: a namespace of tools named like a module Monty or its
        type checker provides (``math.factorial``: Monty's ``math`` cannot be replaced), or a call of a tool that is
        also a namespace (``tools.auth(...)`` beside ``auth.login``: a module cannot be called; its other tools
        can be); None when it can offer them all."""
        plan = self.stubs(manifest, PYTHON)
        try:
            table = await asyncio.to_thread(tools_module, plan) if len(plan) > INLINE_PLAN_CHARS else tools_module(plan)
        except ValueError as exc:  # pydantic-monty refuses the module (its message names it)
            return str(exc)
        if not table.namespaced_tools:
            return None
        called = await asyncio.to_thread(_called_names, script) if len(script) <= AST_MAX_CHARS else None
        for tool, path in table.namespaced_tools:
            if called is None or {f"tools.{path}", f"tools.aio.{path}", path} & called:  # a long script: refused
                return f"the tool {tool!r} is also a namespace of tools ({tool}.*): Monty cannot call a module"
        return None

    def workers(self) -> WorkerPools:
        """The worker pools. Raises EngineUnavailable (why the engine cannot run scripts here)."""
        if self._workers is None:
            raise EngineUnavailable(f"the monty engine cannot run scripts here: {self._why}")
        return self._workers

    def take(
        self, job_id: str, owner: str, limits: SandboxLimits, image: str, hash_seed: int | None = None
    ) -> Sandbox | None:
        self.workers()
        return MontySandbox(self, owner, limits)

    async def open_session(
        self,
        session_id: str,
        limits: SandboxLimits,
        env: Mapping[str, str],
        image: str,
        runtime: str | None,
        held: Held | None,
        owner: str = "",
    ) -> Sandbox:
        """A session's place in ``owner``'s pool: its worker is checked out at its first script and kept until it
        ends (``MontySandbox``). Raises EngineUnavailable."""
        self.workers()
        return MontySandbox(self, owner, limits, keep=True)

    async def require_image(self, image: str, language: str = PYTHON) -> None:
        """Raise InvalidField (``image``) for any image but the default: a Monty script runs in no image."""
        if image != DEFAULT_IMAGE:
            raise InvalidField(
                "the monty engine runs no image: leave image out, or use the container engine", ("body", "image")
            )

    async def ready(self) -> tuple[bool, str]:
        """Ready when its workers can start; a service whose default engine is another one is ready without it
        (its requests for ``monty`` are refused with why, and the start-up logs it)."""
        if self._why is None or self._settings.default_engine != MONTY:
            return True, "ok"
        return False, self._why

    async def suits(self, script: str, language: str | None, owner: str) -> bool:
        """Whether ``script`` runs under Monty (``engine: "auto"``): it is Python, imports only ``MONTY_MODULES`` and
        names no ``ToolError`` (read by CPython's parser), and Monty's own parser accepts it (fed, inside
        ``if False:``, to one of ``owner``'s workers: nothing of it runs). False when the engine cannot run scripts
        here."""
        if self._workers is None or language not in (None, PYTHON) or len(script) > AST_MAX_CHARS:
            return False
        if not await asyncio.to_thread(_imports_only, script, MONTY_MODULES):
            return False
        from pydantic_monty import MontyError

        guarded = "if False:\n" + "".join("    " + line for line in script.splitlines(keepends=True)) + "\n    pass\n"
        try:
            async with asyncio.timeout(CHECKOUT_WAIT_S), self._workers.checkout(owner) as session:
                await session.feed_run(guarded)
        except (MontyError, TimeoutError, WorkersBusy):  # not Monty's, or its workers busy: a container then
            return False
        return True

    async def check(
        self, script: str, manifest: CompiledManifest, language: str | None, owner: str, target: str
    ) -> list[dict[str, Any]] | None:
        """Monty's type check (ty, in one of ``owner``'s workers) of a Python ``script`` against the ``.pyi`` of
        ``manifest``'s tools (``toolkit.stubs.type_stubs``: with ``tools.ToolError`` unless ``target``, the engine
        the script is for, is this one) and the tools as globals: its diagnostics (``Diagnostic``'s fields), empty
        when it passes. Nothing of the script runs: a call to ``CHECK_STOP``, put before its first line, suspends
        the interpreter before anything else once the check has passed. None for another language. Raises
        EngineUnavailable."""
        if language not in (None, PYTHON):
            return None
        from pydantic_monty import ExternalModule, MontyCrashedError, MontyError, MontySyntaxError, MontyTypingError

        workers = self.workers()
        tool_error = target != self.name
        stop = CHECK_STOP + secrets.token_hex(8)

        def make() -> str:
            return type_stubs_of(manifest.stub_source, tool_error)

        stubs = await asyncio.to_thread(manifest.derived, f"pyi-{tool_error}", make, TYPE_STUBS_KEPT_CHARS)
        module = ExternalModule({}, stubs=stubs)
        options = {
            "type_check": True,
            "type_check_format": "jsonlines",
            "type_check_stubs": f"{stubs}\n\ndef {stop}() -> None: ...\n",
            "external_modules": {"tools": module},
            "limits": {"max_feed_duration_secs": CHECK_LIMIT_S, "max_memory": 256 * 1024 * 1024},
        }
        turn = self._checks.setdefault(owner, asyncio.Semaphore(1))  # one check of a key at a time: one core at most
        try:
            async with asyncio.timeout(CHECKOUT_WAIT_S):
                await turn.acquire()
                try:
                    checkout = workers.checkout(owner, **options)
                    session = await checkout.__aenter__()
                except BaseException:
                    turn.release()
                    raise
        except (TimeoutError, WorkersBusy) as exc:
            raise EngineUnavailable(f"the key's Monty workers are all busy; try again ({exc or 'timed out'})") from exc
        try:
            snapshot = await session.feed_start(f"{stop}()\n{script}", print_callback=lambda *_: None)
            while getattr(snapshot, "function_name", None) == "import_stubs":
                snapshot = await snapshot.resume_auto()
        except MontyTypingError as exc:
            return _diagnostics(exc.display())
        except MontySyntaxError as exc:
            return [_diagnostic(exc, "invalid-syntax")]
        except MontyCrashedError as exc:  # the checker's own limits: not the script's error
            why = f"the type check did not end within its limits ({exc}): the script was not checked"
            raise InvalidField(why, ("body", "script")) from exc
        except MontyError as exc:  # what Monty's parser does not support (a class with a base, a yield)
            return [_diagnostic(exc, "unsupported-syntax")]
        finally:
            turn.release()
            with contextlib.suppress(Exception):
                await checkout.__aexit__(None, None, None)
        return []

    async def start(self) -> None:
        """Write the confined launcher and open a probe pool (a worker starts and runs ``1``); if that fails the
        engine stays unavailable, saying why (logged)."""
        try:
            binary = monty_binary()
            launcher = await asyncio.to_thread(write_launcher, binary, self._settings.monty_worker_address_space_mb)
        except (WorkersUnavailable, OSError) as exc:
            self._why = str(exc)
            log.warning("the monty engine is unavailable: %s", self._why)
            return
        settings = self._settings
        workers = WorkerPools(
            launcher,
            settings.monty_workers_per_key,
            settings.monty_max_pools,
            settings.monty_pool_idle_s,
            request_timeout_s=settings.max_timeout_s + 60,
        )
        try:
            async with workers.checkout("\x00probe") as session:
                await session.feed_run("1")
        except Exception as exc:
            await workers.close()
            await asyncio.to_thread(remove_launcher, launcher)
            self._why = f"a confined Monty worker did not start: {exc}"
            log.warning("the monty engine is unavailable: %s", self._why)
            return
        await workers.close()
        workers.start()
        self._workers, self._why, self._launcher = workers, None, launcher

    async def close(self) -> None:
        """End every worker and remove their folder."""
        if self._workers is not None:
            await self._workers.close()
            self._workers = None
        if self._launcher is not None:
            await asyncio.to_thread(remove_launcher, self._launcher)
            self._launcher = None


def _imports_only(script: str, allowed: frozenset[str]) -> bool:
    """Whether every import of ``script`` names a module in ``allowed`` and it names no ``ToolError`` (False when
    CPython cannot parse it)."""
    try:
        tree = ast.parse(script)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and "ToolError" in (
            getattr(node, "id", None),
            getattr(node, "attr", None),
        ):
            return False  # tools.ToolError is the container runtime's
        if isinstance(node, ast.Import):
            if any(alias.name not in allowed for alias in node.names):
                return False
        elif isinstance(node, ast.ImportFrom):
            if node.level or node.module not in allowed:
                return False
    return True


def _diagnostics(text: str) -> list[dict[str, Any]]:
    """The diagnostics of ty's ``jsonlines`` output, their lines those of the script as sent (``CHECK_STOP``'s line
    taken off)."""
    found: list[dict[str, Any]] = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            item = json.loads(line)
            start, end = item.get("location") or {}, item.get("end_location") or {}
            found.append(
                {
                    "line": max(int(start["row"]) - 1, 1),
                    "column": int(start["column"]),
                    "end_line": max(int(end.get("row", start["row"])) - 1, 1),
                    "end_column": int(end.get("column", start["column"])),
                    "code": str(item.get("code") or "error"),
                    "severity": str(item.get("severity") or "error"),
                    "message": str(item.get("message") or ""),
                }
            )
    return found


def _diagnostic(exc: Any, code: str) -> dict[str, Any]:
    """One diagnostic of a Monty error raised before the script ran (its last frame's place, less ``CHECK_STOP``'s
    line)."""
    frames = exc.traceback() if hasattr(exc, "traceback") else []
    line, column = (frames[-1].line, frames[-1].column) if frames else (2, 1)
    message = str(exc.exception()) if hasattr(exc, "exception") else str(exc)
    return {"line": max(line - 1, 1), "column": column, "end_line": max(line - 1, 1), "end_column": column,
            "code": code, "severity": "error", "message": message}  # fmt: skip


def _called_names(script: str) -> set[str]:
    """The dotted names ``script`` calls (``tools.auth`` for ``tools.auth(...)``; empty when CPython cannot parse
    it)."""
    try:
        tree = ast.parse(script)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, target = [], node.func
            while isinstance(target, ast.Attribute):
                parts.append(target.attr)
                target = target.value
            if isinstance(target, ast.Name):
                called.add(".".join([target.id, *reversed(parts)]))
    return called
