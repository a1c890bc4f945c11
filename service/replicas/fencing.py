"""Self-fencing: what a replica does once its lease is lost (docs/scaling.md, Heartbeat, lease, fencing).

Nothing it holds in memory is trusted after a lost lease (its jobs are marked ``lost`` by another replica, which
may deliver their callbacks), so it stops for good and restarting is the one recovery path: it removes every
sandbox with this instance's labels (its scripts stop; their brokers forward no call already:
``Replicas.holds_lease``), cancels its callback deliveries, and exits with status ``EXIT_FENCED`` (75,
``EX_TEMPFAIL``: its supervisor starts it again, as a new incarnation, whose start-up sweeps only this instance's
leftovers). With SQLite nothing ever fences the one replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from service.jobs.tasks import Tasks

log = logging.getLogger(__name__)

EXIT_FENCED = 75
"""The exit status of a fenced replica (``EX_TEMPFAIL``)."""
SWEEP_TIMEOUT_S = 30.0
"""How long the sandboxes' removal may take before the process exits anyway (its restart sweeps what is left)."""
CALLBACK_TASKS = "callback "
"""The name prefix of callback delivery tasks (``Webhooks``)."""


class SelfFence:
    """The ``Replicas.on_fenced`` callback of the service.

    Args:
        sweep: removes every sandbox with this instance's labels (``Recovery.sweep``).
        tasks: the service's background tasks (callback deliveries are cancelled).
        exit: ends the process with a status (``os._exit``: no graceful shutdown, whose saves would all be refused;
            tests pass their own).
    """

    def __init__(
        self,
        sweep: Callable[[str], Awaitable[int]],
        tasks: Tasks,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self._sweep = sweep
        self._tasks = tasks
        self._exit = exit
        self.task: asyncio.Task[None] | None = None

    def __call__(self) -> None:
        """Start fencing (once; on the event loop)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run(), name="self-fence")

    async def run(self) -> None:
        """Cancel callback deliveries, remove this instance's sandboxes (at most ``SWEEP_TIMEOUT_S``), then exit."""
        try:
            cancelled = self._tasks.cancel(CALLBACK_TASKS)
            if cancelled:
                log.warning("fenced: %d callback delivery(ies) cancelled", cancelled)
            await asyncio.wait_for(self._sweep("of a fenced replica"), SWEEP_TIMEOUT_S)
        except Exception:
            log.exception("fenced: removing this replica's sandboxes failed; its restart sweeps them")
        finally:
            log.error("fenced: this replica lost its lease; exiting with status %d to be started again", EXIT_FENCED)
            for handler in logging.getLogger().handlers:
                handler.flush()
            self._exit(EXIT_FENCED)
