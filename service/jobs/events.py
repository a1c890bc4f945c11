"""Job lifecycle events and their subscribers: how metrics, logs and webhooks learn what happened to a job.

The runner saves a job to the store itself, then publishes (so "saved before anyone is told" holds for every
subscriber); it imports neither ``observability.metrics`` nor ``observability.logs``. The app factory subscribes them.

==================  =====================================================================================
event               published
==================  =====================================================================================
``StatusChanged``   after a live job's status change was saved (queued, running, waiting, running again)
``CallEnded``       when one of its tool calls has its outcome (its call record)
``SandboxStarted``  when its script was let go in its sandbox, ``seconds`` after its slot was granted
``JobEnded``        after its final view was saved (or its save failed: logged), once it is no longer live
``JobLost``         at start-up, for a job an earlier run left unfinished, once it was saved as ``lost``
``ParkedJobStopped``  for a parked job stopped (``POST /jobs/{id}/stop``), once it was saved as ``stopped``
==================  =====================================================================================

Subscribers run synchronously on the event loop, in the order they subscribed; one that raises is logged
(with its traceback) and the others still run: a subscriber never breaks a job's run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from service.jobs.live import LiveJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatusChanged:
    """A live job's new status was saved."""

    job: LiveJob


@dataclass(frozen=True)
class CallEnded:
    """A tool call of ``job`` has its outcome: ``record`` is its call record."""

    job: LiveJob
    record: Mapping[str, Any]


@dataclass(frozen=True)
class SandboxStarted:
    """``job``'s script was let go ``seconds`` after its slot (mode in ``job.sandbox_start``)."""

    job: LiveJob
    seconds: float


@dataclass(frozen=True)
class JobEnded:
    """``job`` ended; its final view is in the store (unless saving it failed)."""

    job: LiveJob


@dataclass(frozen=True)
class JobLost:
    """A job an earlier run of the service left ``status`` (queued, running, waiting) was saved as lost."""

    job_id: str
    status: str


@dataclass(frozen=True)
class ParkedJobStopped:
    """A parked job was stopped and saved as such from its stored view (it had no live run to end)."""

    job_id: str


@dataclass(frozen=True)
class JobParked:
    """A durable job was parked as the service stopped: left unfinished in the store, resumed at the next start."""

    job: LiveJob


Event = StatusChanged | CallEnded | SandboxStarted | JobEnded | JobLost | JobParked | ParkedJobStopped
E = TypeVar("E", StatusChanged, CallEnded, SandboxStarted, JobEnded, JobLost, JobParked, ParkedJobStopped)


class Events:
    """Subscribers by event type, and ``publish``."""

    def __init__(self) -> None:
        self._subscribers: dict[type[Any], list[Callable[[Any], None]]] = {}

    def subscribe(self, kind: type[E], subscriber: Callable[[E], None]) -> None:
        """Call ``subscriber(event)`` for each published event of type ``kind``."""
        self._subscribers.setdefault(kind, []).append(subscriber)

    def publish(self, event: Event) -> None:
        """Tell the subscribers of ``type(event)``; never raises (a failing subscriber is logged)."""
        for subscriber in self._subscribers.get(type(event), ()):
            try:
                subscriber(event)
            except Exception:
                log.exception("a subscriber of %s failed", type(event).__name__)
