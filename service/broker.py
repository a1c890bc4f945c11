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
A tool call's ``"repair": "positional_dict"`` says the stub bound a lone positional dict as the arguments
(``ptc_runtime.stubs``); the record lists it in ``repairs`` (a claim too; any other value is ignored).

Every request naming a tool gets a call record, appended when it arrives
(``seq`` in arrival order, status ``pending``) and completed when it ends:

- ``rejected``: unknown tool, or arguments that fail the tool's schema;
- ``ok`` / ``error`` / ``timeout``: the endpoint's outcome;
- ``error`` with type ``cancelled``: the job ended while the call was in flight.

Two kinds of call pause until the harness answers them over the API (``pending_calls``; the job is ``waiting``
meanwhile): a client-executed tool's call (``answer_client_call``), and a call that needs approval
(``ToolSpec.approval``), once its arguments are valid (``decide_approval``): approved, it goes on to its endpoint;
denied, it ends ``error`` with type ``denied``; undecided for its approval timeout, ``timeout`` with type
``approval_timeout`` (the endpoint never saw it). Its record's ``approval`` says who decided, and when.

Nothing from the sandbox is trusted, and one job cannot starve the others:

- past ``max_calls`` a call is refused without a record (counted in
  ``calls_over_limit``);
- records hold arguments and results as raw JSON (``orjson.Fragment``), not
  as Python objects, and at most ``max_record_bytes`` of them per job (and
  ``CallMemory.max_record_bytes`` for all jobs together, and what is left of
  the owner's ``output_bytes`` quota, ``budget``): past that, a record
  keeps its call (tool, status, timing, error) but its ``args`` / ``result``
  become null with ``args_dropped_bytes`` / ``result_dropped_bytes`` saying
  how many bytes were not kept;
- malformed lines get an error reply; a line over ``max_line_bytes`` closes
  its connection; at most ``MAX_CONNECTIONS`` connections per job;
- at most ``MAX_IN_FLIGHT`` requests and ``max_in_flight_bytes`` of request
  lines per job are handled at once (past that the broker stops reading, so
  a flooding script blocks on its own socket); a call that would take the
  request bytes in flight of all jobs past ``CallMemory.max_in_flight_bytes``
  is refused (``limit_exceeded``, record ``rejected``); at most
  ``MAX_ENDPOINT_CALLS`` calls per job wait on endpoints at once;
- arguments and results nested deeper than ``MAX_JSON_DEPTH`` are refused;
- values keep their exact meaning (``service.exactjson``): integers of any size cross exactly both ways (past
  Python's 4,300 digits a request is refused as not JSON); NaN, infinities and lone surrogates are refused, from
  the script (``bad_request``, no record), an endpoint (``bad_response``) or a client's answer alike;
- every error message is capped at ``REPORT_FIELD_CAP`` characters, a request id that is not a string or a
  64-bit integer is answered as null, a report's ``line`` / ``column`` are kept only within ``MAX_REPORT_INT``;
- no work that grows with a call's JSON runs on the event loop: parsing a request line (but for lines of at
  most ``INLINE_LINE_BYTES`` that cannot nest too deep), depth checks, encoding for the record, argument
  validation, parsing an http endpoint's answer and checking results all run on the shared
  ``CheckScheduler``'s threads: one check of a job at a time, taken fairly between keys and jobs, each within
  a CPU budget (past it the call is refused, type ``limit_exceeded``); large texts are parsed with the
  garbage collector paused (``collector.gc_paused``), whose collections inside the parser would hold the GIL.
  The one exception is bounded by constants, not by the input: a small call (a line read inline) of a tool
  whose schema the manifest's compile found cheap (``ToolSpec.cheap_arguments``: no pattern, format or
  ``$ref``, at most ``CHEAP_SCHEMA_NODES`` values) has its arguments tried on the loop, and its result too
  when that is as small (an echo's, or an answer body within ``INLINE_LINE_BYTES``) and ``cheap_result``;
  each try stops past ``INLINE_CHECK_BUDGET_S`` of CPU (0.2 ms), a key's tries together take at most
  ``validation.INLINE_SHARE_S`` of the loop per second (a quarter; then its checks go to the threads), and a
  call that fails its try (too costly, or invalid: its message and repair) is checked again on the check
  threads, in its turn;
- the replies that one connection's calls produce in one turn of the loop are written together, and a call
  stays in flight while its connection's write buffer is full;
- any fault of the service while handling a request becomes an ``internal_error`` reply (logged with its
  traceback), and the call's record, if it has one, gets a final status: never a request left unanswered;
- once ``close`` begins, nothing new is read or dispatched, and calls still
  in flight end ``cancelled``: the records are final.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson
import referencing.exceptions
from opentelemetry.trace import Span
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from service import exactjson, stages, telemetry
from service.collector import gc_paused
from service.errors import CallNotPending, CheckTooCostly
from service.files import FileBudget
from service.toolkit.endpoints import EndpointClients, RawJson, ToolCallFailed
from service.toolkit.manifest import ArgumentCheck, ToolSpec
from service.toolkit.validation import CheckScheduler, deeper_than
from service.unix_sockets import bind_unix

log = logging.getLogger(__name__)

REPORT_FIELD_CAP = 2000
MAX_REPORT_INT = 1 << 31  # a report's line and column are kept when 0 <= value < this
MAX_IN_FLIGHT = 1024
DEFAULT_CHECK_BUDGET_S = 1.0  # CPU time of one check, for a broker without the service's scheduler (s)
MAX_CONNECTIONS = 32
PACE_TURN_S = 0.004  # how long a turn of the event loop may take while a job begins request lines: past it, the job
# begins half as many lines per turn; under it, with its last batch full, twice as many (``Broker._pace``)
PACE_LINES = (8, 1024)  # the fewest and most lines a job begins per turn; it starts at 16. (At 2,000 lines in one turn,
# one job held the loop for 0.64 s; at a fixed 16 a turn, a 1,000-call echo fan-out took 40% longer.)
MAX_ENDPOINT_CALLS = 64
MAX_JSON_DEPTH = 64
# A request line this short, with at most MAX_JSON_DEPTH brackets (so it cannot nest deeper), is parsed on the event
# loop: parsing 4 KiB takes microseconds, less than a hop to a check thread; any longer line (or one with more
# brackets) is parsed, depth-checked and encoded on the check threads, in its job's turn.
INLINE_LINE_BYTES = 4096
# A small call's argument check (a line read inline, a tool with ``cheap_arguments``) and result check (a result of
# such a call, or an answer body as small as such a line, and a tool with ``cheap_result``) is tried on the event loop
# within this CPU budget, reading the clock every INLINE_TICKS_PER_READ units of work; past it, the check is done
# again on the check threads, in the job's turn (the work the loop did is lost: at most the budget).
INLINE_CHECK_BUDGET_S = 0.0002
INLINE_TICKS_PER_READ = 8
MAX_TOOL_NAME_SHOWN = 256
STUB_REPAIRS = frozenset({"positional_dict"})  # a request's "repair" values a record lists (``CallRecord.repairs``)
JSON_TEXT_REPAIR = "json_text"  # the broker's own repair: an argument sent as JSON text, parsed (``repaired``)
MAX_HINTS = 20  # unknown-tool calls per job that get "did you mean" hints (difflib is slow on big manifests)
HINT_NAME_MAX = 64
HINT_CANDIDATES = 1000
T = TypeVar("T")
RETRY_BACKOFF_S = 0.2
RETRY_BACKOFF_MAX_S = 5.0


def _now() -> datetime:
    return datetime.now(UTC)


class CallMemory:
    """Bytes of tool-call JSON the service holds for all its live jobs, and their two service-wide caps.

    Args:
        max_record_bytes: arguments and results kept in the call records of all live jobs (JSON bytes); a
            record that would pass it keeps its call but not its arguments/result (``*_dropped_bytes``).
        max_in_flight_bytes: request lines of the calls being handled, all jobs together (JSON bytes); a call
            that would pass it is refused with ``limit_exceeded`` (record ``rejected``).

    A job's broker returns its kept bytes with ``Broker.release`` once the job's final view is saved.
    Event-loop thread only.
    """

    def __init__(self, max_record_bytes: int, max_in_flight_bytes: int) -> None:
        self.max_record_bytes = max_record_bytes
        self.max_in_flight_bytes = max_in_flight_bytes
        self.record_bytes = 0
        self.in_flight_bytes = 0

    def keep(self, size: int) -> bool:
        """Count ``size`` more record bytes if they fit; False (nothing counted) if not."""
        if self.record_bytes + size > self.max_record_bytes:
            return False
        self.record_bytes += size
        return True

    def forget(self, size: int) -> None:
        """Record bytes no longer held."""
        self.record_bytes -= size

    def enter(self, size: int) -> bool:
        """Count a request of ``size`` bytes in flight if it fits (one always fits alone); False if not."""
        if self.in_flight_bytes and self.in_flight_bytes + size > self.max_in_flight_bytes:
            return False
        self.in_flight_bytes += size
        return True

    def leave(self, size: int) -> None:
        """A request counted by ``enter`` has ended."""
        self.in_flight_bytes -= size


UNBOUNDED = 1 << 62


class Broker:
    """Serves one job's socket.

    Args:
        tools: the job's tools by original name.
        endpoints: the shared endpoint clients.
        max_calls: tool calls accepted for this job.
        max_line_bytes: the longest request line accepted.
        max_record_bytes: bytes of arguments and results the job's records may hold.
        on_call_end: called with each completed record (metrics hook).
        client_call_timeout_s: how long a client-executed call waits for its answer (s).
        on_paused_calls: called with the number of calls waiting for the harness (client-executed calls and calls
            awaiting approval), whenever it changes.
        approval_timeout_s: how long a call waits for approval, for tools without ``approval_timeout_s`` (s).
        checks: the service's scheduler of argument and result checks (shared by every job); None: one of the
            broker's own, with one thread (for a broker used alone, as in tests).
        check_group: the fairness group of this job's checks (the API key that owns the job).
        trace_parent: the job's span: each call gets a child span (``service.telemetry``); None: no spans.
        lease: asked before each call whether this replica still holds its lease (``Replicas.holds_lease``): when
            not, the call fails (``replica_lost``) without reaching any endpoint or client; None: not asked.
        budget: what the job's owner may still keep (its ``output_bytes`` quota, shared with its retained output):
            the records' kept bytes are taken from it and stay taken after the job (until its purge gives them
            back: ``kept_bytes`` says how many); None: no owner cap.
    """

    def __init__(
        self,
        tools: dict[str, ToolSpec],
        endpoints: EndpointClients,
        max_calls: int,
        max_line_bytes: int,
        max_record_bytes: int,
        on_call_end: Callable[[dict[str, Any]], None] | None = None,
        client_call_timeout_s: float = 270.0,
        on_paused_calls: Callable[[int], None] | None = None,
        max_in_flight_bytes: int = UNBOUNDED,
        memory: CallMemory | None = None,
        *,
        checks: CheckScheduler | None = None,
        check_group: str = "",
        approval_timeout_s: float = 270.0,
        trace_parent: Span | None = None,
        lease: Callable[[], bool] | None = None,
        budget: FileBudget | None = None,
    ) -> None:
        self._lease = lease
        self._budget = budget
        self.kept_bytes = 0  # bytes of args and results kept in this job's records (``release`` does not reset it)
        self._checks = checks or CheckScheduler(1, DEFAULT_CHECK_BUDGET_S)
        self._check_group = check_group
        self._client_timeout = client_call_timeout_s
        self._approval_timeout = approval_timeout_s
        self._on_paused_calls = on_paused_calls
        self._paused: dict[str, _Paused] = {}  # calls waiting for the harness, by call id
        self._tools = tools
        self._endpoints = endpoints
        self._max_calls = max_calls
        self._max_line = max_line_bytes
        self._record_cap = max_record_bytes
        self._kept = 0  # bytes of args and results kept in this job's records (counted in memory too)
        self._memory = memory or CallMemory(UNBOUNDED, UNBOUNDED)
        self._flight_cap = max_in_flight_bytes
        self._flight_bytes = 0
        self._flight_freed = asyncio.Event()
        self._on_call_end = on_call_end
        self._closing = False
        self._endpoint_slots = asyncio.Semaphore(MAX_ENDPOINT_CALLS)
        self._hints_left = MAX_HINTS
        self._per_tool: dict[str, asyncio.Semaphore] = {}
        self.records: list[dict[str, Any]] = []
        self.calls_over_limit = 0
        self.script_report: dict[str, Any] | None = None
        self.ran_as_coroutine = False  # the runtime said the script ran as a coroutine (top-level await)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[asyncio.StreamWriter] = set()
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._reading = 0  # request lines of this job being parsed on the check threads
        self._begun = 0  # request lines begun in this turn of the event loop (``_pace``)
        self._per_turn = 16  # how many it may begin per turn (``_turn_took``)
        self._batch_began = 0.0  # time.perf_counter() when the first of them was begun
        self._turn_ended = asyncio.Event()
        self._trace_parent = trace_parent
        self._stages = stages.current()  # the submitting request's, when timed (its calls' stages are summed there)

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (a unix socket, mode 0666 so the sandbox user can connect)."""
        sock = bind_unix(path)  # an address without the work dir's path (a sandbox's /proc/net/unix shows it)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=self._max_line)
        os.chmod(path, 0o666)

    async def close(self) -> None:
        """Stop listening and reading, cancel calls in flight (records end ``cancelled``), close connections."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        while self._tasks:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for record in self.records:
            if record["status"] == "pending":  # cancelled before its task ever ran
                record.update(status="error", error=dict(_CANCELLED))
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or len(self._connections) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._connections.add(writer)
        outbox = _Outbox(writer)
        try:
            while not self._closing:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    log.info("broker: request line over %d bytes; closing the connection", self._max_line)
                    return
                except ConnectionError:
                    return
                if not line:
                    return
                if not line.strip():  # a blank line is no request, but reading it is work: paced like one
                    await self._pace()
                    continue
                await self._in_flight.acquire()
                size = await self._flight_room(len(line))
                await self._pace()
                if self._closing:  # checked after the last wait: no call begins once ``close`` has begun
                    self._task_done(None, size)
                    return
                outbox.handling += 1
                task = asyncio.create_task(self._handle(line, outbox))
                self._tasks.add(task)
                task.add_done_callback(functools.partial(self._task_done, size=size))
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _pace(self) -> None:
        """Wait for a turn of the event loop in which this job (all its connections) has begun fewer than its
        lines per turn, and count one more. The lines begun in one turn are handled in the next, back to back
        (their inline parts: parse, cheap checks, reply); how long that turn took sets the next batch's size
        (``PACE_TURN_S``, ``PACE_LINES``), so a turn stays near 4 ms whether a line costs 20 us or 300 us."""
        # A batch also ends after PACE_TURN_S of the reader's own work: blank lines are read, not handled (a flood
        # of b"\n" came from the buffer in one turn: 0.6 s).
        while self._begun and (self._begun >= self._per_turn or time.perf_counter() - self._batch_began > PACE_TURN_S):
            await self._turn_ended.wait()
        if self._begun == 0:
            self._batch_began = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._next_turn)
        self._begun += 1

    def _next_turn(self) -> None:
        """At the start of the turn that handles the lines begun in the last one: time it, let the readers on."""
        asyncio.get_running_loop().call_soon(self._turn_took, time.perf_counter(), self._begun >= self._per_turn)
        self._begun = 0
        self._turn_ended.set()
        self._turn_ended = asyncio.Event()

    def _turn_took(self, began: float, full: bool) -> None:
        low, high = PACE_LINES
        if time.perf_counter() - began > PACE_TURN_S:
            self._per_turn = max(low, self._per_turn // 2)
        elif full:
            self._per_turn = min(high, self._per_turn * 2)

    async def _flight_room(self, size: int) -> int:
        """Wait until this job's requests in flight leave room for ``size`` bytes (one fits alone); returns the
        bytes counted (``size``, at most the cap)."""
        size = min(size, self._flight_cap)
        while self._flight_bytes and self._flight_bytes + size > self._flight_cap:
            self._flight_freed.clear()
            await self._flight_freed.wait()
        self._flight_bytes += size
        return size

    def _task_done(self, task: asyncio.Task[None] | None, size: int) -> None:
        if task is not None:
            self._tasks.discard(task)
        self._in_flight.release()
        self._flight_bytes -= size
        self._flight_freed.set()

    def release(self) -> None:
        """Return this job's kept record bytes to the service-wide account (its final view has been saved)."""
        self._memory.forget(self._kept)
        self._kept = 0

    def _keep(self, record: dict[str, Any], field: str, encoded: bytes) -> None:
        """Keep ``encoded`` (JSON) as ``record[field]`` if the job's and the service's record caps and the owner's
        budget allow; else null with ``<field>_dropped_bytes``."""
        size = len(encoded)
        if self._kept + size <= self._record_cap and self._memory.keep(size) and self._owner_keeps(size):
            self._kept += size
            self.kept_bytes += size
            record[field] = orjson.Fragment(encoded)
        else:
            record[field] = None
            record[f"{field}_dropped_bytes"] = size

    def _owner_keeps(self, size: int) -> bool:
        """Take ``size`` bytes from the owner's budget, all or nothing; when not, give back the ``size`` bytes
        ``CallMemory.keep`` just counted."""
        if self._budget is None or self._budget.take_all(size):
            return True
        self._memory.forget(size)
        return False

    async def _reply(self, outbox: _Outbox, reply: dict[str, Any]) -> None:
        """Queue ``reply`` on its connection (written with the others of this turn of the loop), then wait while
        the connection's write buffer is full: a script that does not read its replies holds its calls in flight,
        and the broker stops reading its requests."""
        try:
            data = orjson.dumps(reply) + b"\n"
        except orjson.JSONEncodeError:  # cannot happen for depth-checked values; never leave a caller hanging
            data = orjson.dumps(_error(reply.get("id"), "bad_response", "the reply could not be encoded")) + b"\n"
        writer = outbox.writer
        if writer.is_closing():
            return
        outbox.put(data, alone=outbox.handling == 1)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _handle(self, line: bytes, outbox: _Outbox) -> None:
        """Answer one request line. Whatever goes wrong, the script gets a reply (``internal_error`` for a fault of
        the service, logged with its traceback) and the call's record, if it has one, a final status."""
        request_id: int | str | None = None
        began = time.perf_counter_ns()
        parsed = answered = began
        try:
            try:
                request = await self._read(line)
                parsed = time.perf_counter_ns()
                request_id = request.id
                reply = await self._answer(request, len(line))
                answered = time.perf_counter_ns()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("broker: handling a request failed unexpectedly")
                reply = _error(None, "internal_error", "the service failed to handle this request; see the service log")
            reply["id"] = request_id
            await self._reply(outbox, reply)
        finally:
            outbox.handling -= 1
        if self._stages is not None:
            done = time.perf_counter_ns()
            self._stages.call({"parse": parsed - began, "answer": answered - parsed, "reply": done - answered})

    async def _read(self, line: bytes) -> Request:
        """The request a line carries, parsed (and its arguments depth-checked and encoded for the record) on the
        check threads, in this job's turn, unless the line is small enough to do it here (``inline_request``)."""
        if not self._reading and inline_request(line):
            return read_request(line, check_depth=False)
        self._reading += 1  # while one is parsed off the loop, later lines follow it there: records keep line order
        try:
            return await self._off_loop(read_request, line, True)
        finally:
            self._reading -= 1

    async def _answer(self, request: Request, size: int) -> dict[str, Any]:
        """The reply (without its id) to a parsed request of ``size`` bytes."""
        if request.problem is not None:
            return {"ok": False, "error": {"type": "bad_request", "message": request.problem}}
        if request.report is not None:
            self._keep_report(request.report)
            self.ran_as_coroutine = self.ran_as_coroutine or request.ran_as_coroutine
            return {"ok": True, "result": None}
        if len(self.records) >= self._max_calls:
            self.calls_over_limit += 1
            return {
                "ok": False,
                "error": {
                    "type": "limit_exceeded",
                    "message": f"this job may make at most {self._max_calls} tool calls",
                },
            }
        name = request.tool[:MAX_TOOL_NAME_SHOWN]
        if not self._memory.enter(size):
            return self._refuse(name, size)
        try:
            return await self._call(name, request)
        finally:
            self._memory.leave(size)

    def _refuse(self, tool_name: str, size: int) -> dict[str, Any]:
        """Record a call refused because the service's calls in flight hold their cap of bytes; the reply."""
        record = self._new_record(tool_name)
        record["args_dropped_bytes"] = size
        self.records.append(record)
        message = (
            "the service is handling its maximum of tool-call bytes for all jobs (PTC_MAX_CALL_BYTES_IN_FLIGHT_TOTAL);"
            " try again shortly"
        )
        reply = self._fail(record, "rejected", "limit_exceeded", message)
        record["duration_ms"] = 0.0
        telemetry.end_call(telemetry.start_call(self._trace_parent, record), record)
        if self._on_call_end is not None:
            self._on_call_end(record)
        return reply

    def _new_record(self, tool_name: str) -> dict[str, Any]:
        """A new call record with every field of ``schemas.CallRecord`` (in its order), status pending."""
        return {
            "seq": len(self.records) + 1,
            "call_id": "call_" + secrets.token_hex(8),
            "tool": tool_name,
            "args": None,
            "status": "pending",
            "result": None,
            "error": None,
            "repaired": False,
            "repairs": [],
            "caller": "code",
            "attempts": None,
            "started_at": _now(),
            "duration_ms": None,
            "args_dropped_bytes": None,
            "result_dropped_bytes": None,
            "approval": None,
        }

    async def _call(self, tool_name: str, request: Request) -> dict[str, Any]:
        """Validate, dispatch and record one call; returns the reply without its id (``internal_error`` if the
        service fails, so the record is always final)."""
        record = self._new_record(tool_name)
        if request.repair is not None:
            record["repairs"].append(request.repair)
        if request.args_json is not None:
            self._keep(record, "args", request.args_json)
        self.records.append(record)
        started = time.perf_counter()
        span = telemetry.start_call(self._trace_parent, record)
        try:
            with telemetry.current(span):  # the endpoint's request names the call's span
                reply = await self._dispatch(tool_name, request, record)
        except asyncio.CancelledError:
            record.update(status="error", error=dict(_CANCELLED))
            raise
        except Exception:
            log.exception("broker: a call of tool %r failed unexpectedly", tool_name)
            reply = self._fail(
                record, "error", "internal_error", "the service failed to handle this call; see the service log"
            )
        finally:
            record["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
            telemetry.end_call(span, record)
            if self._on_call_end is not None:
                self._on_call_end(record)
        return reply

    async def _dispatch(self, tool_name: str, request: Request, record: dict[str, Any]) -> dict[str, Any]:
        if self._lease is not None and not self._lease():  # a fenced replica forwards no tool call
            return self._fail(record, "error", "replica_lost", "this replica lost its lease: no tool call is made")
        tool = self._tools.get(tool_name)
        if tool is None:
            hint = ""
            if self._hints_left > 0 and len(tool_name) <= HINT_NAME_MAX:
                self._hints_left -= 1
                visible = [name for name, spec in self._tools.items() if spec.callable_from_code][:HINT_CANDIDATES]
                close = await self._off_loop(difflib.get_close_matches, tool_name, visible, 3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            return self._fail(record, "rejected", "unknown_tool", f"no tool named {tool_name!r}{hint}")
        if request.too_costly is not None:
            return self._fail(
                record, "rejected", "limit_exceeded", f"{tool_name}: arguments refused: {request.too_costly}"
            )
        if request.deep:
            return self._fail(
                record, "rejected", "invalid_arguments", f"{tool_name}: arguments nested deeper than {MAX_JSON_DEPTH}"
            )
        if not tool.callable_from_code:
            return self._fail(
                record, "rejected", "not_allowed", f"{tool_name} is not callable from code (see its allowed_callers)"
            )
        checked = _VALID if request.small and tool.cheap_arguments and self._inline(valid, tool, request.args) else None
        if checked is None:
            try:
                checked = await self._off_loop(check_arguments, tool, request.args)
            except CheckTooCostly as exc:
                return self._fail(record, "rejected", "limit_exceeded", f"{tool_name}: arguments refused: {exc}")
        check, args_json = checked.check, request.args_json
        if check.problem is not None:
            return self._fail(record, "rejected", "invalid_arguments", f"{tool_name}: {check.problem}")
        args = request.args if checked is _VALID else check.args
        if check.repaired:
            self._unkeep(record, "args", len(request.args_json or b""))
            if checked.args_json is None:
                return self._fail(
                    record,
                    "rejected",
                    "invalid_arguments",
                    f"{tool_name}: arguments nested deeper than {MAX_JSON_DEPTH}",
                )
            args_json = checked.args_json
            self._keep(record, "args", args_json)
            record["repaired"] = True
            record["repairs"].append(JSON_TEXT_REPAIR)
        if tool.endpoint.kind == "client":
            return await self._call_client(tool, args, args_json or b"null", record)
        if checked.needs_approval:
            refused = await self._await_approval(tool, args_json or b"null", record)
            if refused is not None:
                return refused
        try:
            async with self._endpoint_slots, self._tool_slots(tool):
                result, attempts = await self._call_endpoint(tool, args)
        except ToolCallFailed as exc:
            if exc.attempts > 1:
                record["attempts"] = exc.attempts
            message = _scrub(exc.message, tool)
            return self._fail(record, "timeout" if exc.type == "timeout" else "error", exc.type, message)
        except Exception:
            log.exception("broker: endpoint of tool %s failed unexpectedly", tool_name)
            return self._fail(record, "error", "endpoint_error", "the tool's endpoint failed; see the service log")
        if attempts > 1:
            record["attempts"] = attempts
        # An echo's result holds the arguments of a line read on the loop; an answer body as small as such a line
        small = request.small if tool.endpoint.kind == "echo" else isinstance(result, RawJson) and inline_body(result)
        return await self._accept_result(tool, record, result, small)

    async def _accept_result(
        self, tool: ToolSpec, record: dict[str, Any], result: Any, small: bool = False
    ) -> dict[str, Any]:
        """Check a result (parse, depth, output schema: ``check_result``, on the check threads; for a ``small``
        result of a tool with ``cheap_result``, tried on the loop first), record it within the job's record
        budget; returns the reply."""
        checked = self._inline(check_result, tool, result) if small and tool.cheap_result else None
        if checked is None:
            try:
                checked = await self._off_loop(check_result, tool, result)
            except CheckTooCostly as exc:
                return self._fail(record, "error", "limit_exceeded", f"{tool.name}: result refused: {exc}")
        if checked.result_json is None:
            type_, message = checked.problem or ("bad_response", "the result cannot be encoded as JSON")
            return self._fail(record, "error", type_, message)
        self._keep(record, "result", checked.result_json)
        record["status"] = "ok"
        return {"ok": True, "result": orjson.Fragment(checked.result_json)}

    def _unkeep(self, record: dict[str, Any], field: str, size: int) -> None:
        """Drop ``record[field]`` (``size`` bytes of JSON) and give back the bytes it kept, if it kept them."""
        if isinstance(record[field], orjson.Fragment):
            self._kept -= size
            self.kept_bytes -= size
            self._memory.forget(size)
            if self._budget is not None:
                self._budget.give_back(size)
        record[field] = None
        record[f"{field}_dropped_bytes"] = None

    def _inline(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)`` here, on the event loop, within ``INLINE_CHECK_BUDGET_S`` of CPU time and the job's key's
        share of the loop (``CheckScheduler.inline``); None past either (the caller does the check again on the
        check threads). Only for checks bounded by ``cheap_schema`` and a small instance."""
        return self._checks.inline(self._check_group, INLINE_CHECK_BUDGET_S, INLINE_TICKS_PER_READ, fn, *args)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound checking on the shared check threads (one at a time per job, fairly, within the budget)."""
        return await self._checks.run(self._check_group, self, fn, *args)

    @property
    def pending_calls(self) -> list[dict[str, Any]]:
        """Calls waiting for the harness, in arrival order: ``{"call_id", "tool", "args", "awaiting"}`` each, with
        ``awaiting`` ``"client"`` (a client-executed call: ``answer_client_call``) or ``"approval"``
        (``decide_approval``)."""
        return [
            {"call_id": r["call_id"], "tool": r["tool"], "args": paused.args, "awaiting": paused.awaiting}
            for r in self.records
            if (paused := self._paused.get(r["call_id"])) is not None and r["status"] == "pending"
        ]

    def _paused_call(self, call_id: str, awaiting: str) -> asyncio.Future[Any]:
        """The future of ``call_id`` if it waits for ``awaiting``; raises CallNotPending if not (unknown, answered,
        timed out, or waiting for the other kind of answer)."""
        paused = self._paused.get(call_id)
        if paused is None or paused.awaiting != awaiting or paused.future.done():
            raise CallNotPending(call_id)
        return paused.future

    def answer_client_call(self, call_id: str, ok: bool, value: Any) -> None:
        """Resolve a waiting client-executed call with a result (``ok``) or an error ``{"type", "message"}``.

        Raises:
            CallNotPending: no client-executed call of that id is waiting (unknown, already answered or timed out).
        """
        self._paused_call(call_id, "client").set_result((ok, value))

    def decide_approval(self, call_id: str, approved: bool, by: str, reason: str | None) -> None:
        """Approve (the call goes on to its endpoint) or deny (the script gets a ``denied`` ToolError) a call
        awaiting approval; its record's ``approval`` says so at once.

        Args:
            by: the API key name that decided.
            reason: free text (at most ``REPORT_FIELD_CAP`` characters kept); a denial's reaches the script.

        Raises:
            CallNotPending: no call of that id awaits approval (unknown, decided, timed out, or client-executed).
        """
        future = self._paused_call(call_id, "approval")
        record = next(r for r in self.records if r["call_id"] == call_id)
        record["approval"] = {
            "decision": "approved" if approved else "denied",
            "by": by,
            "at": _now(),
            "reason": reason[:REPORT_FIELD_CAP] if reason is not None else None,
        }
        future.set_result(approved)

    async def _pause(self, record: dict[str, Any], awaiting: str, args_json: bytes, timeout_s: float) -> Any:
        """Hold the call until the harness answers it (the value ``answer_client_call`` or ``decide_approval`` set)
        or ``timeout_s`` passes (TimeoutError); ``args_json``: its arguments, shown by ``pending_calls``."""
        call_id = record["call_id"]
        paused = _Paused(asyncio.get_running_loop().create_future(), awaiting, orjson.Fragment(args_json))
        self._paused[call_id] = paused
        self._paused_changed()
        try:
            return await asyncio.wait_for(paused.future, timeout_s)
        finally:
            del self._paused[call_id]
            self._paused_changed()

    async def _await_approval(self, tool: ToolSpec, args_json: bytes, record: dict[str, Any]) -> dict[str, Any] | None:
        """Hold a call that needs approval until it is decided; None when approved, else the failure reply
        (``denied``, or ``approval_timeout`` once the tool's or the service's approval timeout passes)."""
        timeout = (tool.approval.timeout_s if tool.approval is not None else None) or self._approval_timeout
        try:
            approved = await self._pause(record, "approval", args_json, timeout)
        except TimeoutError:
            record["approval"] = {"decision": "timed_out", "by": None, "at": _now(), "reason": None}
            message = f"{tool.name}: no approval came within {timeout:g} s; the call was not made"
            return self._fail(record, "timeout", "approval_timeout", message)
        if approved:
            return None
        reason = record["approval"]["reason"]
        return self._fail(record, "error", "denied", f"{tool.name}: denied" + (f": {reason}" if reason else ""))

    async def _call_client(self, tool: ToolSpec, args: Any, args_json: bytes, record: dict[str, Any]) -> dict[str, Any]:
        """Pause the call until the client answers it (POST /jobs/{id}/calls/{call_id}) or the timeout passes.
        ``args_json``: ``args`` encoded (shown to the client by ``pending_calls``)."""
        timeout = tool.timeout_s or self._client_timeout
        try:
            ok, value = await self._pause(record, "client", args_json, timeout)
        except TimeoutError:
            return self._fail(
                record, "timeout", "timeout", f"{tool.name}: the client did not answer within {timeout:g} s"
            )
        if not ok:
            kind = str(value.get("type", "client_error"))[:REPORT_FIELD_CAP]
            return self._fail(record, "error", kind, str(value.get("message", ""))[:REPORT_FIELD_CAP])
        try:
            exactjson.strict_dumps(value)  # the API's JSON reader lets NaN and infinities through
        except ValueError as exc:
            return self._fail(record, "error", "bad_response", f"{tool.name}: the client's result is not JSON: {exc}")
        return await self._accept_result(tool, record, value)

    def _paused_changed(self) -> None:
        if self._on_paused_calls is not None:
            self._on_paused_calls(sum(not p.future.done() for p in self._paused.values()))

    def _tool_slots(self, tool: ToolSpec) -> contextlib.AbstractAsyncContextManager[Any]:
        """The tool's ``max_concurrency`` semaphore for this job (created on first use), or no limit."""
        if tool.max_concurrency is None:
            return contextlib.nullcontext()
        slots = self._per_tool.get(tool.name)
        if slots is None:
            slots = self._per_tool[tool.name] = asyncio.Semaphore(tool.max_concurrency)
        return slots

    async def _call_endpoint(self, tool: ToolSpec, args: dict[str, Any]) -> tuple[Any, int]:
        """Call the endpoint; an idempotent tool is retried (exponential backoff, tenacity) after a failure
        that may pass (timeout, unreachable, 5xx), up to ``tool.retries`` more times. Returns (result, attempts)."""
        if not tool.idempotent or tool.retries == 0:
            return await self._endpoints.call(tool, args, raw=True), 1
        attempts = 0
        retrying = AsyncRetrying(
            stop=stop_after_attempt(tool.retries + 1),
            wait=wait_exponential(multiplier=RETRY_BACKOFF_S, max=RETRY_BACKOFF_MAX_S),
            retry=retry_if_exception(_transient),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    return await self._endpoints.call(tool, args, raw=True), attempts
        except ToolCallFailed as exc:
            exc.attempts = attempts
            raise
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    @staticmethod
    def _fail(record: dict[str, Any], status: str, type_: str, message: str) -> dict[str, Any]:
        if len(message) > REPORT_FIELD_CAP:  # a schema error may quote a whole argument
            message = message[: REPORT_FIELD_CAP - 5] + " [...]"
        error = {"type": type_, "message": message}
        record.update(status=status, error=error)
        return {"ok": False, "error": error}

    def _keep_report(self, error: Any) -> None:
        """Keep the last report (the runtime's comes after the script's code): the script's unverified claim."""
        if not isinstance(error, dict):
            return
        kept: dict[str, Any] = {}
        for key in ("type", "message", "text"):
            if isinstance(error.get(key), str):
                kept[key] = error[key][:REPORT_FIELD_CAP]
        for key in ("line", "column"):
            value = error.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_REPORT_INT:
                kept[key] = value
        if "type" in kept:
            self.script_report = kept


def _scrub(message: str, tool: ToolSpec) -> str:
    """``message`` without the endpoint's header values (an endpoint may echo credentials in an error page)."""
    for value in tool.endpoint.headers.values():
        if len(value) >= 4:
            message = message.replace(value, "[redacted]")
            _, _, token = value.partition(" ")  # "Bearer <token>": the token alone too
            if len(token) >= 4:
                message = message.replace(token, "[redacted]")
    return message


def _fits_64(request_id: int | str) -> bool:
    """A string, or an integer a reply can carry (orjson writes 64-bit integers only)."""
    return isinstance(request_id, str) or -(1 << 63) <= request_id < 1 << 64


def _transient(exc: BaseException) -> bool:
    """Failures worth another attempt of an idempotent tool."""
    if not isinstance(exc, ToolCallFailed):
        return False
    return exc.type in ("timeout", "endpoint_unreachable") or exc.message.startswith("HTTP 5")


class _Outbox:
    """The replies of one connection not yet written: those queued in one turn of the event loop go out in one
    write, at the end of the turn (one system call for a fan-out's replies, instead of one each); the reply of a
    connection's only request in flight goes out at once. ``handling``: its requests being handled."""

    __slots__ = ("handling", "lines", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.lines: list[bytes] = []
        self.handling = 0

    def put(self, line: bytes, alone: bool) -> None:
        """Queue ``line``; ``alone``: no other request of the connection is being handled (write it now)."""
        if alone and not self.lines:
            self.writer.write(line)
            return
        if not self.lines:
            asyncio.get_running_loop().call_soon(self.flush)
        self.lines.append(line)

    def flush(self) -> None:
        lines, self.lines = self.lines, []
        if lines and not self.writer.is_closing():
            self.writer.write(b"".join(lines))


@dataclass(frozen=True)
class _Paused:
    """A call held until the harness answers it: the answer's future, what it awaits (``client`` or ``approval``)
    and its arguments (JSON)."""

    future: asyncio.Future[Any]
    awaiting: str
    args: orjson.Fragment


_CANCELLED = {"type": "cancelled", "message": "the job ended before the tool answered"}


def _error(request_id: Any, type_: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"type": type_, "message": message}}


# -- work on one request's or result's JSON, sized by the sandbox or the endpoint: run on the check threads ----------
# (``read_request`` runs inline only for lines that ``inline_request`` accepts.) Parsing is kept to
# ``parse_request_line`` and ``parse_result_body``, one function each.


def parse_request_line(line: bytes) -> Any:
    """The JSON value of one request line, integers exact (``exactjson``). Raises ValueError."""
    return exactjson.loads(line)


def parse_result_body(body: bytes) -> Any:
    """The JSON value of an endpoint's answer, integers exact (``exactjson``). Raises ValueError."""
    return exactjson.loads(body)


@dataclass(frozen=True)
class Request:
    """One request line, read. Exactly one of: ``problem`` (a bad request), ``report`` (the runtime's error
    report), or a tool call (``tool`` and the rest).

    Attributes:
        id: the request's id (None when it has none usable).
        args_json: the arguments encoded (JSON bytes, for the record and the client); None when ``deep``.
        deep: the arguments nest deeper than ``MAX_JSON_DEPTH``.
        too_costly: why checking the arguments' depth was stopped (the check's CPU budget), if it was.
        small: the line was read on the event loop (``inline_request``): its checks may be tried there too.
        repair: what the stub repaired in the call (one of ``STUB_REPAIRS``), if it says so.
    """

    id: int | str | None = None
    problem: str | None = None
    report: dict[str, Any] | None = None
    ran_as_coroutine: bool = False
    tool: str = ""
    args: Any = None
    args_json: bytes | None = None
    deep: bool = False
    too_costly: str | None = None
    small: bool = False
    repair: str | None = None


def inline_request(line: bytes) -> bool:
    """Whether ``line`` is cheap enough to read on the event loop: ``INLINE_LINE_BYTES`` at most, and so few
    brackets that it cannot nest deeper than ``MAX_JSON_DEPTH`` (no depth walk needed)."""
    return len(line) <= INLINE_LINE_BYTES and line.count(b"[") + line.count(b"{") <= MAX_JSON_DEPTH


def inline_body(result: RawJson) -> bool:
    """Whether an endpoint's answer body is as cheap to parse as a line ``inline_request`` accepts."""
    return inline_request(result.body)


def read_request(line: bytes, check_depth: bool) -> Request:
    """Parse one request line; for a tool call, check the arguments' depth (``check_depth``; within the running
    check's budget) and encode them. CPU time grows with the line: run off the event loop unless
    ``inline_request(line)``."""
    try:
        with gc_paused() if check_depth else contextlib.nullcontext():  # a line read inline is too short to matter
            request = parse_request_line(line)
    except ValueError as exc:
        message = f"the request is not valid JSON, or holds what JSON cannot carry exactly: {exc}"
        return Request(problem=message[:REPORT_FIELD_CAP])
    if not isinstance(request, dict):
        return Request(problem="the request must be a JSON object")
    request_id = request.get("id")
    if not isinstance(request_id, (int, str)) or isinstance(request_id, bool) or not _fits_64(request_id):
        request_id = None
    if request.get("op") == "report":
        report = request.get("error")
        coroutine = request.get("ran_as") == "coroutine"
        return Request(request_id, report=report if isinstance(report, dict) else {}, ran_as_coroutine=coroutine)
    tool = request.get("tool")
    if not isinstance(tool, str):
        return Request(request_id, problem="the request names no tool")
    args = request.get("args")
    try:
        deep = check_depth and deeper_than(args, MAX_JSON_DEPTH)
    except CheckTooCostly as exc:
        return Request(request_id, tool=tool, args=args, too_costly=str(exc))
    encoded = None if deep else _encoded(args)
    repair = request.get("repair")
    return Request(
        request_id,
        tool=tool,
        args=args,
        args_json=encoded,
        deep=deep,
        small=not check_depth,
        repair=repair if isinstance(repair, str) and repair in STUB_REPAIRS else None,
    )


@dataclass(frozen=True)
class CheckedArguments:
    """``ToolSpec.check_arguments``'s outcome, with repaired arguments encoded (None: they nest too deep), and
    whether valid arguments need approval (``Approval.needed``)."""

    check: ArgumentCheck
    args_json: bytes | None = None
    needs_approval: bool = False


def check_arguments(tool: ToolSpec, args: Any) -> CheckedArguments:
    """Check ``args`` against ``tool``'s schema; repaired arguments are depth-checked and encoded too; valid ones
    are matched against the tool's approval rule.

    Raises:
        CheckTooCostly: past the check's CPU budget (the schema and the approval rule share it).
    """
    check = tool.check_arguments(args)
    needs = check.problem is None and tool.approval is not None and tool.approval.needed(check.args)
    if check.problem is None and check.repaired and not deeper_than(check.args, MAX_JSON_DEPTH):
        return CheckedArguments(check, _encoded(check.args), needs)
    return CheckedArguments(check, needs_approval=needs)


def valid(tool: ToolSpec, args: Any) -> bool:
    """Whether ``args`` is an object that fits ``tool``'s schema as it is (no repair, no approval rule): the first
    error ends the check, and a call that is not valid is checked again with ``check_arguments`` for its message.

    Raises:
        CheckTooCostly: past the running check's CPU budget.
    """
    if not isinstance(args, dict):
        return False
    try:
        return next(tool.validator.iter_errors(args), None) is None
    except (referencing.exceptions.Unresolvable, RecursionError):
        return False


_VALID = CheckedArguments(ArgumentCheck(None, None))  # ``valid`` said so: the request's own arguments go out


@dataclass(frozen=True)
class CheckedResult:
    """A result checked: ``result_json`` (its JSON bytes), or ``problem`` (error type, message)."""

    result_json: bytes | None = None
    problem: tuple[str, str] | None = None


def check_result(tool: ToolSpec, result: Any) -> CheckedResult:
    """Parse (``RawJson``), depth-check, check against the output schema and encode one result.

    Raises:
        CheckTooCostly: past the check's CPU budget.
    """
    if isinstance(result, RawJson):
        try:
            with gc_paused() if len(result.body) > INLINE_LINE_BYTES else contextlib.nullcontext():
                result = parse_result_body(result.body)
        except ValueError as exc:
            message = f"the endpoint's answer is not JSON, or holds what JSON cannot carry exactly: {exc}"
            return CheckedResult(problem=("bad_response", message[:REPORT_FIELD_CAP]))
    if deeper_than(result, MAX_JSON_DEPTH):
        return CheckedResult(problem=("bad_response", f"the result is nested deeper than {MAX_JSON_DEPTH}"))
    wrong = tool.check_result(result)
    if wrong is not None:
        return CheckedResult(problem=("invalid_result", f"{tool.name}: {wrong}"))
    encoded = _encoded(result)
    if encoded is None:
        return CheckedResult(problem=("bad_response", f"{tool.name}: the result cannot be encoded as JSON"))
    return CheckedResult(encoded)


def _encoded(value: Any) -> bytes | None:
    try:
        return exactjson.dumps(value)
    except ValueError:
        return None
