"""Bounded, fair checking of tool-call arguments and results.

Three parts, so that one tenant's expensive calls never delay another's:

- ``enum`` checked by set membership (``enum_keyword``): jsonschema's own
  compares the value with every member in Python (a 3,000-value enum over
  20,000 array items took 4 s per call); here each enum list gets, once, a
  frozenset of its members' canonical forms, where JSON equality holds
  (``1 == 1.0``, but ``true != 1`` and ``false != 0``; arrays and objects by
  content).
- A CPU budget per check (``budgeted``): every schema keyword evaluated
  counts, so does every instance member a keyword loops over (``tick``, also
  weighted: ``tick(n)`` for n units of work done at once), and every
  ``TICKS_PER_CLOCK_READ`` units the thread's CPU time (``time.thread_time``:
  not the time spent waiting for the GIL or a core) is compared with the
  budget; past it the check raises ``CheckTooCostly``. Work that is costly
  in one step (a regex search) asks ``budget_left`` first and is bounded by
  it.
- ``CheckScheduler``: the checks of all jobs share ``threads`` worker
  threads. A job runs at most one check at a time; when a thread is free,
  the next check is taken round-robin over groups (API keys), then over the
  jobs of that group (a group or job served goes to the back of the line, a
  new one joins at the back), so one with many checks waiting never
  overtakes one with a single check. With fewer busy jobs than threads a new
  check starts at once; otherwise it waits for at most one check per group
  ahead of it in line, each bounded by the budget.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jsonschema.exceptions import ValidationError

from service.errors import CheckTooCostly

T = TypeVar("T")

TICKS_PER_CLOCK_READ = 64
INLINE_SHARE_S = 0.25  # CPU time one group (API key) may spend on checks tried on the event loop (at 0.05 a
# 1,000-call fan-out spent it and ran 3.6x slower: 536 against 148 ms, bench.tool_calls on the 2-core machine) ...
INLINE_WINDOW_S = 1.0  # ... per this window; past it, its checks go to the threads, in its turn (``inline``)
ENUM_SET_MIN = 8  # shorter enums are scanned: building and caching a set costs more than it saves
ENUM_CACHE_VALUES = 2_000_000  # enum members kept as sets, over all tools; the oldest lists are dropped past it
ENUM_SHOWN = 20  # members an error message lists


# -- enum by set membership -------------------------------------------------------------------------------------------


def canonical(value: Any, counted: bool = False) -> Hashable:
    """A hashable form of a JSON value in which JSON-equal values are equal.

    Numbers compare by value (``1`` and ``1.0`` are one), booleans are not numbers (``True`` is not ``1``),
    strings, null, arrays (in order) and objects (by key) by content; anything else by its ``repr``.
    ``counted``: every member of every array and object counts against the running check's budget (``tick``);
    for instances (a schema's enum lists are built once and cached, outside any one call's account).
    """
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", value)
    if isinstance(value, list):
        if counted:
            tick(len(value))
        return ("array", tuple(canonical(v, counted) for v in value))
    if isinstance(value, dict):
        if counted:
            tick(len(value))
        return ("object", tuple(sorted((k, canonical(v, counted)) for k, v in value.items())))
    return ("other", repr(value))


_ENUM_SETS: OrderedDict[int, tuple[list[Any], frozenset[Hashable]]] = OrderedDict()
_ENUM_VALUES = 0
_ENUM_LOCK = threading.Lock()


def enum_members(enums: list[Any]) -> frozenset[Hashable]:
    """The canonical forms of ``enums``' members, built once per enum list (by identity) and cached.

    The cache keeps the list itself alive, so its ``id`` cannot be reused by another list while cached.
    """
    global _ENUM_VALUES
    entry = _ENUM_SETS.get(id(enums))
    if entry is not None and entry[0] is enums:
        return entry[1]
    members = frozenset(canonical(v) for v in enums)
    with _ENUM_LOCK:
        if id(enums) not in _ENUM_SETS:
            _ENUM_SETS[id(enums)] = (enums, members)
            _ENUM_VALUES += len(enums)
            while _ENUM_VALUES > ENUM_CACHE_VALUES and len(_ENUM_SETS) > 1:
                _, (dropped, _) = _ENUM_SETS.popitem(last=False)
                _ENUM_VALUES -= len(dropped)
    return members


def enum_keyword(validator: Any, enums: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """``enum`` with JSON equality, by set membership for lists of ``ENUM_SET_MIN`` members or more."""
    if not isinstance(enums, list):  # the metaschema requires an array; be safe anyway
        enums = list(enums) if isinstance(enums, (tuple, set, frozenset)) else [enums]
    key = canonical(instance, counted=True)
    if len(enums) >= ENUM_SET_MIN:
        found = key in enum_members(enums)
    else:
        found = any(canonical(member) == key for member in enums)
    if not found:
        shown = ", ".join(repr(m) for m in enums[:ENUM_SHOWN])
        more = f", ... ({len(enums)} values)" if len(enums) > ENUM_SHOWN else ""
        yield ValidationError(f"{instance!r} is not one of [{shown}{more}]")


# -- the CPU budget of one check ------------------------------------------------------------------------------------


class _Budget(threading.local):
    deadline: float | None = None
    ticks: int = 0
    next_read: int = TICKS_PER_CLOCK_READ
    per_read: int = TICKS_PER_CLOCK_READ
    limit_s: float = 0.0


_BUDGET = _Budget()


def tick(units: int = 1) -> None:
    """Count ``units`` of checking work on this thread (one keyword, one instance member, one container walked);
    raises CheckTooCostly once the thread's budget is spent (the clock is read every ``TICKS_PER_CLOCK_READ``)."""
    budget = _BUDGET
    if budget.deadline is None:
        return
    budget.ticks += units
    if budget.ticks >= budget.next_read:
        budget.next_read = budget.ticks + budget.per_read
        if time.thread_time() > budget.deadline:
            raise CheckTooCostly(budget.limit_s)


def budget_left(cap_s: float) -> float:
    """CPU seconds the running check may still spend, at most ``cap_s`` (``cap_s`` when no check runs here).

    Raises:
        CheckTooCostly: the budget is already spent.
    """
    budget = _BUDGET
    if budget.deadline is None:
        return cap_s
    left = budget.deadline - time.thread_time()
    if left <= 0:
        raise CheckTooCostly(budget.limit_s)
    return min(cap_s, left)


def running_budget_s() -> float | None:
    """The CPU budget (seconds) of the check running on this thread, None when none runs."""
    budget = _BUDGET
    return None if budget.deadline is None else budget.limit_s


def budgeted(keyword: Callable[..., Any]) -> Callable[..., Any]:
    """A jsonschema keyword function that counts against the running check's budget (see ``tick``)."""

    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        tick()
        return keyword(validator, value, instance, schema)

    counted.__name__ = getattr(keyword, "__name__", "keyword")
    return counted


def run_budgeted(budget_s: float, fn: Callable[..., T], *args: Any, per_read: int = TICKS_PER_CLOCK_READ) -> T:
    """``fn(*args)`` on this thread with a CPU budget of ``budget_s`` seconds (raises CheckTooCostly past it);
    ``per_read``: units of work (``tick``) between two reads of the thread's clock (fewer: a tighter bound)."""
    _BUDGET.deadline = time.thread_time() + budget_s
    _BUDGET.limit_s = budget_s
    _BUDGET.ticks = 0
    _BUDGET.next_read = _BUDGET.per_read = per_read
    try:
        return fn(*args)
    finally:
        _BUDGET.deadline = None


def deeper_than(value: Any, limit: int) -> bool:
    """Whether a JSON value nests deeper than ``limit`` (a scalar is 0 deep, ``[]`` 1, ``[[]]`` 2).

    Walks level by level, without recursion, and stops at level ``limit``; every value visited counts against
    the running check's budget (``tick``). About 30 ms of CPU per MiB of ``[[],[],...]``.
    """
    level = [value]
    for depth in range(limit + 1):
        tick(len(level))
        containers = [node for node in level if isinstance(node, (dict, list))]
        if not containers:
            return False
        if depth == limit:
            return True
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
    return False


# -- fair scheduling over a few threads -----------------------------------------------------------------------------


@dataclass
class _Check:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]


@dataclass
class _JobQueue:
    checks: deque[_Check] = field(default_factory=deque)
    running: bool = False


class CheckScheduler:
    """Runs CPU-bound checks (argument and result validation) on ``threads`` threads, fairly (module doc).

    Args:
        threads: worker threads shared by every job.
        budget_s: CPU time one check may take (s); past it the check raises ``CheckTooCostly``.

    Use from one event loop only.
    """

    def __init__(self, threads: int, budget_s: float) -> None:
        self._threads = threads
        self.budget_s = budget_s
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ptc-validate")
        self._groups: OrderedDict[str, OrderedDict[object, _JobQueue]] = OrderedDict()
        self._running = 0
        self._inline_spent: dict[str, tuple[float, float]] = {}  # group -> (its window's start, CPU s spent in it)

    async def run(self, group: str, job: object, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread within the budget, when fairness says it is ``job``'s turn.

        Args:
            group: the fairness group (the API key that owns the job).
            job: the job's identity (any hashable; one check of a job runs at a time).

        Raises:
            CheckTooCostly: the check ran past ``budget_s`` of CPU time.
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        jobs = self._groups.setdefault(group, OrderedDict())
        queue = jobs.get(job)
        if queue is None:
            queue = jobs[job] = _JobQueue()
        queue.checks.append(_Check(fn, args, future))
        self._pump()
        result: T = await future
        return result

    def inline(self, group: str, budget_s: float, per_read: int, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)`` here, on the event loop, within ``budget_s`` of CPU time (the clock read every ``per_read``
        units of work); None past it, or without trying when ``group`` has spent its ``INLINE_SHARE_S`` of the
        loop in this ``INLINE_WINDOW_S``: the caller then checks on the threads (``run``), fairly. Only for checks
        bounded by constants (a small instance, a cheap schema): one key's flood of them holds the loop for at
        most that share.
        """
        now = time.monotonic()
        start, spent = self._inline_spent.get(group, (now, 0.0))
        if now - start >= INLINE_WINDOW_S:
            start, spent = now, 0.0
        if spent >= INLINE_SHARE_S:
            return None
        began = time.thread_time()
        try:
            return run_budgeted(budget_s, fn, *args, per_read=per_read)
        except CheckTooCostly:
            return None
        finally:
            self._inline_spent[group] = (start, spent + time.thread_time() - began)

    def close(self) -> None:
        """Let the threads end once their checks are done (checks still queued are cancelled)."""
        for jobs in self._groups.values():
            for queue in jobs.values():
                for check in queue.checks:
                    check.future.cancel()
        self._groups.clear()
        self._executor.shutdown(wait=False)

    def _pump(self) -> None:
        """Start checks while threads are free: round-robin over groups, then over each group's jobs."""
        while self._running < self._threads:
            picked = self._next()
            if picked is None:
                return
            group, job, queue = picked
            check = queue.checks.popleft()
            if check.future.cancelled():  # its caller went away (the job ended) before it ran
                self._forget_if_idle(group, job, queue)
                continue
            queue.running = True
            self._running += 1
            done = asyncio.wrap_future(self._executor.submit(run_budgeted, self.budget_s, check.fn, *check.args))
            done.add_done_callback(functools.partial(self._finished, group, job, queue, check))

    def _next(self) -> tuple[str, object, _JobQueue] | None:
        for group in list(self._groups):
            jobs = self._groups[group]
            for job in list(jobs):
                queue = jobs[job]
                if queue.running or not queue.checks:
                    continue
                self._groups.move_to_end(group)  # served: this group and this job go to the back
                jobs.move_to_end(job)
                return group, job, queue
        return None

    def _finished(self, group: str, job: object, queue: _JobQueue, check: _Check, done: asyncio.Future[Any]) -> None:
        self._running -= 1
        queue.running = False
        if not check.future.done():
            if done.cancelled():
                check.future.cancel()
            elif (exc := done.exception()) is not None:
                check.future.set_exception(exc)
            else:
                check.future.set_result(done.result())
        self._forget_if_idle(group, job, queue)
        self._pump()

    def _forget_if_idle(self, group: str, job: object, queue: _JobQueue) -> None:
        if queue.running or queue.checks:
            return
        jobs = self._groups.get(group)
        if jobs is not None and jobs.get(job) is queue:
            del jobs[job]
            if not jobs:
                del self._groups[group]
