"""The broker: one unix-socket server per job, the only authority on which tool calls happened.

Protocol: newline-delimited JSON.
A request ``{"id": n, "tool": name, "args": {...}}`` is answered, in any
order, by ``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false,
"error": {"type", "message"}}``. Each request is handled in its own task, so
many calls are in flight at once on one connection. One control request
exists: ``{"id": n, "op": "report", "error": {...}}``, by which the runtime
describes the script's uncaught exception; it is kept as ``script_report``,
the script's own claim: the job's ``error`` is built from what the service
observed (``service.verdict``), with this report only labelled inside it.
``{"id": n, "op": "report", "ran_as": "coroutine"}`` says the script had
top-level ``await`` and ran as a coroutine (``ran_as_coroutine``, also a claim).

A ``Broker`` is four collaborating parts, one module each:

- ``connection``: the ports (``Connections``): the socket's connections, the in-process port's lines, the line cap,
  reading lines at a pace (``Pacer``), the requests and bytes in flight, replies written together;
- ``records``: the call records (``CallRecords``): one per call, final once the broker has closed, the bytes they
  keep within the job's, the service's (``CallMemory``) and the owner's caps, and the runtime's reports;
- ``dispatch`` and ``checks``: each call read, checked (on the shared check threads, or within a small budget on
  the loop), forwarded to its endpoint and recorded (``Dispatcher``);
- ``paused``: calls that wait for the harness (``PausedCalls``): client-executed calls and calls awaiting approval.

Its limits are one frozen ``BrokerConfig`` (``config``); what it shares with every job's broker and the job's hooks
are two more (``BrokerShared``, ``BrokerHooks``: ``wiring``). A script's calls reach it over its socket (``start``: a
script in a container) or, from a script engine that runs in this process, one ``call`` at a time: either way a
call is bounded alike (``max_line_bytes``, the requests and bytes in flight, the pace: ``Connections``), read,
checked, forwarded and recorded alike, and the runtime's report kept alike (``report``;
``service.engines.interface.CallPort``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from service.broker.checks import INLINE_LINE_BYTES
from service.broker.config import BrokerConfig
from service.broker.connection import Connections
from service.broker.dispatch import Dispatcher
from service.broker.durable import DurableLog
from service.broker.paused import PausedCalls
from service.broker.records import CallMemory, CallRecords
from service.broker.wiring import NO_HOOKS, BrokerHooks, BrokerShared
from service.files import FileBudget
from service.toolkit.specs import ToolSpec

__all__ = [
    "Broker", "BrokerConfig", "BrokerHooks", "BrokerShared", "CallMemory", "CallRecords", "PausedCalls",
]  # fmt: skip


class Broker:
    """One job's broker: its socket, its call records, its paused calls.

    Args:
        tools: the job's tools by original name.
        shared: what every job's broker shares (``BrokerShared``): the endpoint clients, the check threads (None:
            one of the broker's own, with one thread, for a broker used alone as in tests), the service-wide bounds
            of kept record bytes and request bytes in flight.
        config: the job's limits and timeouts.
        budget: what the job's owner may still keep (its ``output_bytes`` quota, shared with its retained output):
            the records' kept bytes are taken from it and stay taken after the job (until its purge gives them
            back: ``records.kept_bytes`` says how many); None: no owner cap.
        hooks: the job's span, lease check and callbacks (``BrokerHooks``); by default none.
        durable: the job's call log (``service.broker.durable``); None: the job is not durable. A job resumed after
            it was parked takes the answers given meanwhile from it (``DurableLog.answers``).
        carried: a job resumed after it was parked: the calls that waited then, unanswered (call id -> what they
            await and when they expire: ``PausedCalls``).

    Attributes:
        records: the job's call records and the script's reports (``CallRecords``); ``records.release()`` once
            the job's final view is saved.
        paused: the calls waiting for the harness (``PausedCalls``): ``pending_calls``, ``answer_client_call``,
            ``decide_approval``.
    """

    def __init__(
        self,
        tools: Mapping[str, ToolSpec],
        shared: BrokerShared,
        config: BrokerConfig,
        *,
        budget: FileBudget | None = None,
        hooks: BrokerHooks = NO_HOOKS,
        durable: DurableLog | None = None,
        carried: Mapping[str, tuple[str, datetime]] | None = None,
    ) -> None:
        self.records = CallRecords(config, shared.memory, budget)
        answers = durable.answers if durable is not None else None
        self.paused = PausedCalls(config, hooks.on_paused_calls, answers, carried)
        self.durable = durable
        dispatcher = Dispatcher(tools, shared, config, self.records, self.paused, hooks, durable)
        self._connections = Connections(config, dispatcher)  # both ports: the socket and ``call``'s lines
        self._in_process_calls = 0

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (a unix socket, mode 0666 so the sandbox user can connect)."""
        await self._connections.start(path)

    async def call(self, tool: str, args: Any) -> dict[str, Any]:
        """Make one call of ``tool`` with ``args`` (JSON values) from this process, as the line
        ``{"id": n, "tool": tool, "args": args}`` on the socket would be: bounded (``Connections.call``: a line over
        ``max_line_bytes`` closes the port as it would a connection; the requests and bytes in flight, the pace),
        read, checked, forwarded and recorded.

        Returns the reply: ``{"ok": true, "result": value}`` or ``{"ok": false, "error": {"type", "message"}}``
        (``bad_request`` for arguments JSON cannot carry, ``broker_unavailable`` from a line over
        ``max_line_bytes`` on, ``cancelled`` once the broker is closed, ``internal_error`` for a fault of the
        service). Raises only CancelledError (the call's record then ends ``cancelled`` at ``close``).
        """
        self._in_process_calls += 1
        try:
            line = orjson.dumps({"id": self._in_process_calls, "tool": tool, "args": args})
        except TypeError as exc:
            return {"ok": False, "error": {"type": "bad_request", "message": f"the arguments are not JSON: {exc}"}}
        reply = await self._connections.call(line)
        reply.pop("id", None)
        data = orjson.dumps(reply)  # a result may be the endpoint's body as it came (a fragment): made values
        if len(data) <= INLINE_LINE_BYTES:
            decoded: dict[str, Any] = orjson.loads(data)
        else:
            decoded = await asyncio.to_thread(orjson.loads, data)
        return decoded

    def report(self, error: dict[str, Any] | None, ran_as_coroutine: bool = False) -> None:
        """Keep a report of the script's runtime made from this process, as the line ``{"op": "report", "error":
        error}`` would be (``CallRecords.note_report``: checked and capped, a claim only)."""
        self.records.note_report(error, ran_as_coroutine)

    async def close(self) -> None:
        """Stop listening and reading, cancel calls in flight (records end ``cancelled``), close connections, let the
        call log's writes under way land: the records are final."""
        await self._connections.stop()
        self.records.cancel_pending()
        await self._connections.wait_closed()
        if self.durable is not None:
            await self.durable.flushed()
