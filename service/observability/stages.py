"""Per-stage timing of one request, for the benchmark's breakdown (``bench/stages.py``): where a job's time goes.

An admin key's request that sends ``X-PTC-Stages: 1`` is timed: the service marks the moments its work passes
(request received, body parsed and checked, job admitted, saves, sandbox found, run files written, the run sent,
the sandbox's own moments, the final save, the view encoded) and answers them in a ``Server-Timing`` header
(W3C Server Timing: ``name;dur=<ms>`` per stage, in the order they happened, each the time since the previous
mark). Any other request is not timed: a mark is then one context-variable lookup. The marks of a job's tool
calls (``CallStages``) are summed per stage and answered as ``call-<stage>`` entries with the number of calls.

The sandbox's moments come from the runtime's ``exit`` frame (``stamps``: ``time.monotonic_ns()`` values of the
sandbox's clock). Under runc the sandbox shares the host's monotonic clock, so they fall between the service's
own marks and are placed on its time line; stamps outside the run's window (another clock, as under gVisor, or a
lie: the sandbox is not trusted) are dropped. None of this changes what a job does or what its view says.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar
from typing import Any

HEADER = "x-ptc-stages"
ANSWER_HEADER = "Server-Timing"
SANDBOX_STAMPS = ("run_received", "go_sent", "script_ended", "reaped", "drained")  # the exit frame's, in order
MAX_CALL_STAGES = 16  # distinct call stages kept (the broker marks a handful)


class Stages:
    """The marks of one timed request: (name, ``time.perf_counter_ns()``), in the order they were made."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, int]] = [("received", time.perf_counter_ns())]
        self.calls: dict[str, list[int]] = {}  # call stage -> [total ns, calls]

    def mark(self, name: str, at_ns: int | None = None) -> None:
        self.marks.append((name, time.perf_counter_ns() if at_ns is None else at_ns))

    def sandbox(self, stamps: Any, window: tuple[int, int]) -> None:
        """Place the runtime's ``stamps`` (a frame's field: any JSON) on this time line, ``window`` = (the run
        sent, its exit frame read), in ``time.perf_counter_ns()``; keep only ints in order inside the window."""
        if not isinstance(stamps, Mapping):
            return
        last = window[0]
        for name in SANDBOX_STAMPS:
            value = stamps.get(name)
            if type(value) is int and last <= value <= window[1]:
                self.mark(f"sandbox-{name}", value)
                last = value

    def call(self, durations: Mapping[str, int]) -> None:
        """Add one tool call's stage durations (ns) to the sums."""
        for name, ns in durations.items():
            total = self.calls.get(name)
            if total is None:
                if len(self.calls) >= MAX_CALL_STAGES:
                    continue
                total = self.calls[name] = [0, 0]
            total[0] += ns
            total[1] += 1

    def header(self) -> str:
        """The ``Server-Timing`` value: each mark's time since the one before (ms, 3 decimals); ``total``;
        ``origin`` (``desc``: the first mark in ``time.perf_counter_ns()``, for placing a script's own stamps);
        ``call-<stage>`` sums with ``desc`` = the number of calls."""
        ordered = sorted(self.marks, key=lambda mark: mark[1])
        parts = [f"{name};dur={(at - ordered[i][1]) / 1e6:.3f}" for i, (name, at) in enumerate(ordered[1:])]
        parts.append(f"total;dur={(ordered[-1][1] - ordered[0][1]) / 1e6:.3f}")
        parts.append(f'origin;desc="{ordered[0][1]}"')  # "received", in ns of the host's monotonic clock
        parts += [f'call-{name};dur={ns / 1e6:.3f};desc="{n}"' for name, (ns, n) in self.calls.items()]
        return ", ".join(parts)


CURRENT: ContextVar[Stages | None] = ContextVar("ptc_stages", default=None)


def mark(name: str, at_ns: int | None = None) -> None:
    """Mark ``name`` (now, or at ``at_ns`` of ``time.perf_counter_ns()``) on the current request's stages, if it
    is timed."""
    stages = CURRENT.get()
    if stages is not None:
        stages.mark(name, at_ns)


def exit_seen(stamps: dict[str, Any] | None, sending: int) -> None:
    """Place a run's ``ExitStatus.stamps`` (the sandbox's, and when its exit frame was read) on the current
    request's stages, if it is timed, for the run sent at ``sending`` (``time.perf_counter_ns()``); mark now."""
    stages = CURRENT.get()
    if stages is not None and stamps is not None:
        stages.sandbox(stamps["sandbox"], (sending, stamps["exit_read"]))
        stages.mark("sandbox-exit-read", stamps["exit_read"])
        stages.mark("exit-seen")


def current() -> Stages | None:
    """The current request's stages (None: not timed)."""
    return CURRENT.get()


class StageTiming:
    """ASGI middleware (outside authentication, so that its time counts): times a request that sends
    ``X-PTC-Stages: 1`` and, when the request's key turned out to be an admin's, answers ``Server-Timing`` (see
    the module's docstring).

    Args:
        app: the ASGI app it wraps.
        admin: whether the request's key (``scope["state"]["key_name"]`` as authentication left it; None when
            keys are off) may see the timing.
    """

    def __init__(self, app: Any, admin: Any) -> None:
        self.app = app
        self.admin = admin

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not any(
            name == HEADER.encode() and value == b"1" for name, value in scope.get("headers") or ()
        ):
            await self.app(scope, receive, send)
            return
        stages = Stages()
        token = CURRENT.set(stages)

        async def timed_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and self.admin((scope.get("state") or {}).get("key_name")):
                stages.mark("answer-encoded")
                headers = list(message.get("headers") or [])
                headers.append((ANSWER_HEADER.encode(), stages.header().encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            CURRENT.reset(token)
