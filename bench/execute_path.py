"""Measurement (not a test): which modules of ``service/`` the handling of one ``POST /execute`` passes through.

    python -m bench.execute_path [--cold] [--no-tool] [--fake] [--no-warmup] [--json]
    (another checkout, with this file: cd OTHER && PYTHONPATH=.:sandbox_image python /path/to/bench/execute_path.py)

Builds the service in this process (``create_app(settings, backend)``, the lifespan run as the unit tests run it,
requests through ``httpx.ASGITransport``: every middleware and route of the app, no HTTP server), with a scratch
work dir, authentication off, and by default the Docker backend on ``PTC_DOCKER_HOST`` with the sandbox image of
``PTC_SANDBOX_IMAGE`` (``--fake``: the in-memory backend of ``service/sandbox/fake.py``, no engine needed). It
imports only ``service.api.create_app``, ``service.settings.Settings`` and with ``--fake``
``service.sandbox.fake.FakeBackend``, so it runs on checkouts whose modules are laid out differently.

The request: ``POST /execute`` of ``import tools; tools.echo(x=1); print(1)`` with one tool, ``echo`` (the service
answers it itself: the broker's path, no network), or with ``--no-tool`` of ``print(1)`` with no tools. By default a
warm pool of one sandbox is kept (the service's default path: a pooled sandbox, ``sandbox_start`` ``warm``), and
the pool is stocked before each request; ``--cold``: no pool, the request starts its own sandbox. An untraced
warm-up request runs first (the first request's lazy imports and caches are not the path; ``--no-warmup``: measure
the first one).

What is counted: with ``sys.setprofile`` and ``threading.setprofile`` (installed before start-up, so the service's
threads have it), each *fresh* call (a coroutine or generator resumed is not a call) of a function whose source is
a file under ``service/``, made while handling the request: in the request's own task, in every task created from
it (a task's context is copied when it is created: the job's runner, the broker's connection), and on worker
threads given work from them (``asyncio.to_thread``, and ``run_in_executor``, which this script makes copy the
context as ``to_thread`` does). Start-up, the warm pool's refills and the service's own background loops (lease,
purge) run in contexts of their own and are not counted. The window closes once the answer is in and every task
created from the request has ended (a job's sandbox removal included).

Reported:

- (a) the distinct files under ``service/`` whose functions were called, in the order first entered;
- (b) transitions: fresh calls into a file from another file of ``service/`` (the caller is the nearest frame of a
  ``service/`` file up the stack, through framework frames: Starlette calling a route is a transition from the
  middleware's file to the route's); plus the number of distinct (from, to) pairs, and the entries from outside
  ``service/`` (the event loop starting a task, a worker thread, the framework without a ``service/`` frame above).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dis
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

TRACED: contextvars.ContextVar[bool] = contextvars.ContextVar("execute_path_traced", default=False)

ECHO = {"name": "echo", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}
SCRIPT_TOOL = "import tools\ntools.echo(x=1)\nprint(1)\n"
SCRIPT_PLAIN = "print(1)\n"
GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
OUTSIDE = "(outside service/)"


@functools.cache
def _first_resume(code: CodeType) -> int:
    """The offset of the first RESUME of a generator-like code object (3.11+): where a fresh frame's 'call' is."""
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RESUME":
            return instruction.offset
    return -1


def _fresh(frame: FrameType) -> bool:
    """Whether this 'call' event starts the frame (not a coroutine or generator resumed)."""
    code = frame.f_code
    if not code.co_flags & GENERATOR_FLAGS or frame.f_lasti < 0:
        return True
    return frame.f_lasti <= _first_resume(code)


@dataclass
class Trace:
    """What the profiler saw of ``root`` (the service package's folder) while ``TRACED`` was set."""

    root: str
    order: dict[str, int] = field(default_factory=dict)  # file -> rank of first entry
    first: dict[str, str] = field(default_factory=dict)  # file -> the first function entered there
    calls: Counter[str] = field(default_factory=Counter)  # file -> fresh calls into it
    edges: Counter[tuple[str, str]] = field(default_factory=Counter)  # (caller's file, callee's file), files differ
    outside: Counter[str] = field(default_factory=Counter)  # file -> entries with no service/ frame above
    on: bool = False
    _names: dict[str, str | None] = field(default_factory=dict)  # co_filename -> relative path, None: not ours
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _relative(self, filename: str) -> str | None:
        try:
            return self._names[filename]
        except KeyError:
            path = os.path.realpath(filename)
            name = os.path.relpath(path, self.root) if path.startswith(self.root + os.sep) else None
            self._names[filename] = name
            return name

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on or not TRACED.get():
            return
        callee = self._relative(frame.f_code.co_filename)
        if callee is None or not _fresh(frame):
            return
        caller = None
        up = frame.f_back
        while up is not None:
            caller = self._relative(up.f_code.co_filename)
            if caller is not None:
                break
            up = up.f_back
        with self._lock:
            if callee not in self.order:
                self.order[callee] = len(self.order)
                self.first[callee] = frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") else ""
            self.calls[callee] += 1
            if caller is None:
                self.outside[callee] += 1
            elif caller != callee:
                self.edges[caller, callee] += 1

    def summary(self) -> dict[str, Any]:
        files = sorted(self.order, key=self.order.__getitem__)
        into = Counter(callee for (_, callee), count in self.edges.items() for _ in range(count))
        out = Counter(caller for (caller, _), count in self.edges.items() for _ in range(count))
        return {
            "files": [
                {
                    "file": name,
                    "calls": self.calls[name],
                    "in_from_other_files": into[name],
                    "out_to_other_files": out[name],
                    "from_outside": self.outside[name],
                    "first_function": self.first[name],
                }
                for name in files
            ],
            "distinct_files": len(files),
            "transitions": sum(self.edges.values()),
            "distinct_edges": len(self.edges),
            "entries_from_outside": sum(self.outside.values()),
            "fresh_calls": sum(self.calls.values()),
        }


def _context_copying_executor() -> None:
    """Make ``run_in_executor`` run its function in a copy of the caller's context, as ``asyncio.to_thread`` does,
    so work a traced task hands to a thread (the Docker SDK's calls, SQLite's thread) is traced too."""
    base = asyncio.base_events.BaseEventLoop
    original = base.run_in_executor

    def run_in_executor(self: Any, executor: Any, func: Callable[..., Any], *args: Any) -> Any:
        return original(self, executor, functools.partial(contextvars.copy_context().run, func), *args)

    setattr(base, "run_in_executor", run_in_executor)  # noqa: B010  (an assignment: mypy refuses a method replaced)


def _track_tasks(loop: asyncio.AbstractEventLoop, spawned: set[asyncio.Task[Any]]) -> None:
    """Note every task created while ``TRACED`` is set (a task factory runs in its creator's context)."""

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if TRACED.get():
            spawned.add(task)
        return task

    loop.set_task_factory(factory)


async def _pool_stocked(client: Any, timeout_s: float = 120.0) -> None:
    """Wait until the warm pool has a sandbox waiting (``ptc_sandbox_pool_size`` above 0)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        if any(float(value) > 0 for value in re.findall(r"^ptc_sandbox_pool_size\{[^}]*\} (\S+)$", text, re.M)):
            await asyncio.sleep(0.2)
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the warm pool was not stocked in time")


async def _measure(args: argparse.Namespace, root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    import httpx

    from service.api import create_app
    from service.settings import Settings

    trace = Trace(root)
    threading.setprofile(trace.profile)  # before start-up: every thread the service starts has it
    _context_copying_executor()
    spawned: set[asyncio.Task[Any]] = set()
    _track_tasks(asyncio.get_running_loop(), spawned)

    work_dir = Path(tempfile.mkdtemp(prefix="ptcpath", dir="/tmp"))  # short: unix socket paths under it
    settings = Settings(
        work_dir=work_dir,
        auth="disabled",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0 if args.cold else 1,
        instance_id="bench-path-" + work_dir.name[-8:],
    )
    backend = None
    if args.fake:
        from service.sandbox.fake import FakeBackend

        backend = FakeBackend()
    body: dict[str, Any] = {"script": SCRIPT_PLAIN if args.no_tool else SCRIPT_TOOL}
    if not args.no_tool:
        body["tools"] = [ECHO]
    app = create_app(settings, backend)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=120) as client:
                if not args.no_warmup:
                    if not args.cold:
                        await _pool_stocked(client)
                    warmup = await client.post("/execute", json=body)
                    warmup.raise_for_status()
                if not args.cold:
                    await _pool_stocked(client)
                sys.setprofile(trace.profile)
                trace.on = True
                token = TRACED.set(True)
                try:
                    answer = await client.post("/execute", json=body)
                finally:
                    TRACED.reset(token)  # the tasks created from the request keep it set, until they end
                waited: set[asyncio.Task[Any]] = set()
                deadline = time.monotonic() + 30
                while (pending := {task for task in spawned - waited if not task.done()}) and (
                    time.monotonic() < deadline
                ):
                    await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                    waited |= {task for task in pending if task.done()}
                trace.on = False
                sys.setprofile(None)
                left = sorted(task.get_name() for task in spawned if not task.done())
                view = answer.json()
    finally:
        threading.setprofile(None)
        shutil.rmtree(work_dir, ignore_errors=True)
    result = {
        "status_code": answer.status_code,
        "status": view.get("status"),
        "stdout": view.get("stdout"),
        "sandbox_start": view.get("sandbox_start"),
        "calls": [call.get("status") for call in view.get("calls") or []],
        "tasks_created": len(spawned),
        "tasks_still_running": left,
    }
    return result, trace.summary()


def _print(result: dict[str, Any], summary: dict[str, Any], args: argparse.Namespace) -> None:
    script = "print(1)" if args.no_tool else "print(1) with one echo tool call"
    backend = "fake backend" if args.fake else "Docker backend"
    start = "cold (no pool)" if args.cold else "warm pool of 1"
    print(f"POST /execute of {script}; {backend}, {start}; warm-up request: {'no' if args.no_warmup else 'yes'}")
    print(
        f"answer: {result['status_code']} {result['status']} stdout={result['stdout']!r} "
        f"sandbox_start={result['sandbox_start']} calls={result['calls']}; tasks created from the request: "
        f"{result['tasks_created']}"
        + (f", still running: {result['tasks_still_running']}" if result["tasks_still_running"] else "")
    )
    width = max([len(row["file"]) for row in summary["files"]] + [4])
    header = f"{'#':>3}  {'file (under service/)':<{width}}  {'calls':>6}  {'in':>5}  {'out':>5}  {'ext':>4}"
    print(f"\n{header}  first function")
    for rank, row in enumerate(summary["files"], 1):
        print(
            f"{rank:>3}  {row['file']:<{width}}  {row['calls']:>6}  {row['in_from_other_files']:>5}  "
            f"{row['out_to_other_files']:>5}  {row['from_outside']:>4}  {row['first_function']}"
        )
    print(
        "\n(in/out: calls from / to another file of service/; ext: entries with no service/ frame above)\n"
        f"(a) distinct files of service/ called: {summary['distinct_files']}\n"
        f"(b) transitions between files (cross-file calls): {summary['transitions']} "
        f"over {summary['distinct_edges']} distinct (from, to) pairs; entries from outside service/: "
        f"{summary['entries_from_outside']}; fresh calls in all: {summary['fresh_calls']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="no warm pool: the request starts its own sandbox")
    parser.add_argument("--no-tool", action="store_true", help="print(1) with no tools (default: one echo call)")
    parser.add_argument("--fake", action="store_true", help="the in-memory fake backend (no Docker)")
    parser.add_argument("--no-warmup", action="store_true", help="measure the first request")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    import service

    root = os.path.realpath(os.path.dirname(service.__file__))
    print(f"service/ measured: {root}", file=sys.stderr)
    result, summary = asyncio.run(_measure(args, root))
    if args.json:
        print(json.dumps({"request": result, **summary}, indent=2))
    else:
        _print(result, summary, args)
    if result["status"] != "succeeded":
        sys.exit(f"the request did not succeed: {result}")


if __name__ == "__main__":
    main()
