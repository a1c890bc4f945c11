"""The server's first SIGTERM drains the job service before the server stops (docs/durability.md, Drain).

uvicorn stops listening at once on SIGTERM; ``DrainingServer`` first lets the job service drain
(``JobManager.drain``): new jobs and sessions are refused with ``503`` ``draining`` and ``Retry-After``, ``/readyz``
answers ``503`` ``draining`` (a balancer sends work elsewhere), and running jobs have ``PTC_DRAIN_S`` to end. Then the
server stops as before; its shutdown parks the durable jobs still running (``JobManager.close``). A second SIGTERM,
or SIGINT, stops it at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains ``app``'s job service for ``drain_s`` seconds first."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_s: float, retry_after_s: int) -> None:
        super().__init__(config)
        self._app = app
        self._drain_s = drain_s
        self._retry_after_s = retry_after_s
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        jobs = getattr(self._app.state, "jobs", None)
        if sig == signal.SIGTERM and self._draining is None and not self.should_exit and jobs is not None:
            loop = asyncio.get_event_loop()
            self._draining = loop.create_task(self._drain(jobs))
            return
        super().handle_exit(sig, frame)

    async def _drain(self, jobs: Any) -> None:
        try:
            replicas = getattr(self._app.state, "replicas", None)
            if replicas is not None:
                replicas.draining = True  # /readyz: 503 draining
            log.warning("SIGTERM: draining for at most %g s (new jobs and sessions get 503)", self._drain_s)
            left = await jobs.drain(self._drain_s, self._retry_after_s)
            if left:
                log.warning("drained: %d job(s) still running; durable ones are parked, the others lost", left)
        except Exception:
            log.exception("draining failed; stopping")
        finally:
            self.should_exit = True
