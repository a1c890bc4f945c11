"""Background tasks of the job service, held until they end: a failure is logged with its traceback at once
(never "Task exception was never retrieved"), and ``close`` cancels and awaits what is left."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Tasks:
    """A set of named background tasks, each held until it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a task named ``name``; an exception it ends with is logged (error level, traceback)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %r failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self, prefix: str) -> int:
        """Cancel the tasks whose name starts with ``prefix``; returns how many."""
        chosen = [task for task in self._tasks if task.get_name().startswith(prefix)]
        for task in chosen:
            task.cancel()
        return len(chosen)

    async def close(self) -> None:
        """Cancel every task still running and wait for all of them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def until_done(
    attempt: Callable[[], Awaitable[None]], what: str, first_s: float = 1.0, most_s: float = 30.0
) -> None:
    """Call ``attempt`` after ``first_s`` seconds, then after twice as long each time (at most ``most_s``), until it
    returns (e.g. a job's final view that the store refused: a finished result is not lost to a store's blip)."""
    delay = first_s
    while True:
        await asyncio.sleep(delay)
        try:
            await attempt()
        except Exception:
            log.warning("%s failed again", what, exc_info=True)
            delay = min(delay * 2, most_s)
            continue
        log.info("%s: done", what)
        return
