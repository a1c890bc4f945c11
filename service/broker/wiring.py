"""What a job's broker is wired to, besides its tools and limits: what every job's broker shares with the others
(``BrokerShared``: the endpoint clients, the check threads, the service-wide call memory) and the job's own hooks
(``BrokerHooks``: its span, the lease check, the call-ended and paused-calls callbacks). Both are frozen: fixed for
a broker's life."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from service.broker.config import UNBOUNDED
from service.broker.records import CallMemory
from service.toolkit.endpoints import EndpointClients
from service.toolkit.validation import CheckScheduler


def _unbounded() -> CallMemory:
    return CallMemory(UNBOUNDED, UNBOUNDED)


@dataclass(frozen=True)
class BrokerShared:
    """What every job's broker shares (the service builds one; a broker used alone, as in tests, its own).

    Attributes:
        endpoints: the shared endpoint clients (and their egress rules).
        checks: the service's scheduler of argument and result checks; None: each broker's dispatcher makes one of
            its own, with one thread.
        memory: the service-wide bounds of kept record bytes and request bytes in flight (JSON bytes); by default
            unbounded (a new ``CallMemory`` per ``BrokerShared``).
    """

    endpoints: EndpointClients
    checks: CheckScheduler | None = None
    memory: CallMemory = field(default_factory=_unbounded)


@dataclass(frozen=True)
class BrokerHooks:
    """One job's hooks into its broker; each None: not used.

    Attributes:
        trace_parent: the job's span: each call gets a child span (``service.observability.telemetry``).
        lease: asked before each call whether this replica still holds its lease (``Replicas.holds_lease``): when
            not, the call fails (``replica_lost``) without reaching any endpoint or client.
        on_call_end: called with each completed record (the job's ``CallEnded`` event: metrics and logs).
        on_paused_calls: called with the number of calls waiting for the harness (client-executed calls and calls
            awaiting approval), whenever it changes.
        on_diverged: called with the message when a resumed job's replay diverged from its call log
            (``service.broker.durable``): the job must end ``failed`` (``replay_diverged``).
    """

    trace_parent: Span | None = None
    lease: Callable[[], bool] | None = None
    on_call_end: Callable[[dict[str, Any]], None] | None = None
    on_paused_calls: Callable[[int], None] | None = None
    on_diverged: Callable[[str], None] | None = None


NO_HOOKS = BrokerHooks()
"""A broker without hooks (a broker used alone)."""
