"""One job's tool calls from request to reply: read, checked, forwarded to the endpoint, recorded.

A request ``{"id": n, "tool": name, "args": {...}}`` is answered by ``{"id": n, "ok": true, "result": ...}`` or
``{"id": n, "ok": false, "error": {"type", "message"}}`` (the connection adds the id); a report
(``{"op": "report", ...}``) is kept by the records. A tool call's ``"repair": "positional_dict"`` says the stub bound
a lone positional dict as the arguments (``ptc_runtime.stubs``); the record lists it in ``repairs`` (a claim; any
other value is ignored), and the broker's own repair (an argument sent as JSON text, parsed) as ``json_text``.

Bounds, so that one job cannot starve the others: a call that would take the request bytes in flight of all jobs
past ``CallMemory.max_in_flight_bytes`` is refused (``limit_exceeded``, record ``rejected``); at most
``MAX_ENDPOINT_CALLS`` calls per job wait on endpoints at once, and a tool's ``max_concurrency``; arguments and
results nested deeper than ``MAX_JSON_DEPTH`` are refused; every error message is capped at ``REPORT_FIELD_CAP``
characters; an endpoint's header values are scrubbed from its error messages; a fenced replica (``lease``) makes
no call; any fault of the service while handling a call becomes an ``internal_error`` reply (logged with its
traceback) and a final record.

No work that grows with a call's JSON runs on the event loop (``service.broker.checks``): it goes to the shared
``CheckScheduler``'s threads, one check of a job at a time, taken fairly between keys and jobs, each within a CPU
budget (past it the call is refused, type ``limit_exceeded``). The one exception is bounded by constants, not by
the input: a small call (a line read inline) of a tool whose schema the manifest's compile found cheap
(``ToolSpec.cheap_arguments``: no pattern, format or ``$ref``, at most ``CHEAP_SCHEMA_NODES`` values) has its
arguments tried on the loop, and its result too when that is as small (an echo's, or an answer body within
``INLINE_LINE_BYTES``) and ``cheap_result``; each try stops past ``INLINE_CHECK_BUDGET_S`` of CPU (0.2 ms), a
key's tries together take at most ``validation.INLINE_SHARE_S`` of the loop per second (a quarter; then its checks
go to the threads), and a call that fails its try (too costly, or invalid: its message and repair) is checked
again on the check threads, in its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from service.broker.checks import (
    MAX_JSON_DEPTH,
    VALID,
    Request,
    check_arguments,
    check_result,
    inline_body,
    inline_request,
    read_request,
    valid,
)
from service.broker.config import BrokerConfig
from service.broker.durable import DurableLog
from service.broker.paused import ClientResult, PausedCalls
from service.broker.records import CANCELLED, CallRecords, fail
from service.broker.wiring import BrokerHooks, BrokerShared
from service.errors import CheckTooCostly
from service.observability import telemetry
from service.toolkit.endpoints import RawJson, ToolCallFailed
from service.toolkit.specs import ToolSpec
from service.toolkit.validation import CheckScheduler

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_CHECK_BUDGET_S = 1.0  # CPU time of one check, for a broker without the service's scheduler (s)
MAX_ENDPOINT_CALLS = 64
# A small call's argument check (a line read inline, a tool with ``cheap_arguments``) and result check (a result of
# such a call, or an answer body as small as such a line, and a tool with ``cheap_result``) is tried on the event loop
# within this CPU budget, reading the clock every INLINE_TICKS_PER_READ units of work; past it, the check is done
# again on the check threads, in the job's turn (the work the loop did is lost: at most the budget).
INLINE_CHECK_BUDGET_S = 0.0002
INLINE_TICKS_PER_READ = 8
MAX_TOOL_NAME_SHOWN = 256
JSON_TEXT_REPAIR = "json_text"  # the broker's own repair: an argument sent as JSON text, parsed (``repaired``)
MAX_HINTS = 20  # unknown-tool calls per job that get "did you mean" hints (difflib is slow on big manifests)
HINT_NAME_MAX = 64
HINT_CANDIDATES = 1000
RETRY_BACKOFF_S = 0.2
RETRY_BACKOFF_MAX_S = 5.0


class Dispatcher:
    """Reads, checks, forwards and records one job's tool calls.

    Args:
        tools: the job's tools by original name.
        shared: what every job's broker shares: the endpoint clients, the scheduler of checks (None: one of its
            own, with one thread), the service-wide account of request bytes in flight (``BrokerShared``).
        config: the job's limits (``check_group``: the fairness group of its checks).
        records: the job's call records: each call gets one, made final here.
        paused: where client-executed calls and calls awaiting approval wait.
        hooks: the job's span (each call gets a child span), its lease check (a call made without the lease fails
            ``replica_lost`` without reaching any endpoint or client), its call-ended callback and what to call when
            its replay diverged (``BrokerHooks``; ``on_paused_calls`` is ``paused``'s).
        durable: the job's call log (``DurableLog``: each call's intent stored before it goes out, its outcome
            before the script sees it, calls of a resumed job answered from it); None: the job is not durable.
    """

    def __init__(
        self,
        tools: Mapping[str, ToolSpec],
        shared: BrokerShared,
        config: BrokerConfig,
        records: CallRecords,
        paused: PausedCalls,
        hooks: BrokerHooks,
        durable: DurableLog | None = None,
    ) -> None:
        self._tools = tools
        self._durable = durable
        self._on_diverged = hooks.on_diverged
        self._endpoints = shared.endpoints
        self._records = records
        self._paused = paused
        self._checks = shared.checks or CheckScheduler(1, DEFAULT_CHECK_BUDGET_S)
        self._check_group = config.check_group
        self._memory = shared.memory
        self._trace_parent = hooks.trace_parent
        self._lease = hooks.lease
        self._on_call_end = hooks.on_call_end
        self._endpoint_slots = asyncio.Semaphore(MAX_ENDPOINT_CALLS)
        self._per_tool: dict[str, asyncio.Semaphore] = {}
        self._hints_left = MAX_HINTS
        self._reading = 0  # request lines of this job being parsed on the check threads

    async def read(self, line: bytes) -> Request:
        """The request a line carries, parsed (and its arguments depth-checked and encoded for the record) on the
        check threads, in this job's turn, unless the line is small enough to do it here (``inline_request``)."""
        if not self._reading and inline_request(line):
            return read_request(line, check_depth=False)
        self._reading += 1  # while one is parsed off the loop, later lines follow it there: records keep line order
        try:
            return await self._off_loop(read_request, line, True)
        finally:
            self._reading -= 1

    async def answer(self, request: Request, size: int) -> dict[str, Any]:
        """The reply (without its id) to a parsed request of ``size`` bytes (its line). Raises only what the
        service's own faults raise (the connection answers those ``internal_error``)."""
        if request.problem is not None:
            return {"ok": False, "error": {"type": "bad_request", "message": request.problem}}
        if request.report is not None:
            self._records.note_report(request.report, request.ran_as_coroutine)
            return {"ok": True, "result": None}
        if not self._records.admit():
            return {
                "ok": False,
                "error": {
                    "type": "limit_exceeded",
                    "message": f"this job may make at most {self._records.max_calls} tool calls",
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
        record = self._records.open(tool_name)
        record["args_dropped_bytes"] = size
        message = (
            "the service is handling its maximum of tool-call bytes for all jobs (PTC_MAX_CALL_BYTES_IN_FLIGHT_TOTAL);"
            " try again shortly"
        )
        reply = fail(record, "rejected", "limit_exceeded", message)
        record["duration_ms"] = 0.0
        telemetry.end_call(telemetry.start_call(self._trace_parent, record), record)
        if self._on_call_end is not None:
            self._on_call_end(record)
        return reply

    async def _call(self, tool_name: str, request: Request) -> dict[str, Any]:
        """Validate, dispatch and record one call; returns the reply without its id (``internal_error`` if the
        service fails, so the record is always final)."""
        record = self._records.open(tool_name)
        if request.repair is not None:
            record["repairs"].append(request.repair)
        if request.args_json is not None:
            self._records.keep(record, "args", request.args_json)
        started = time.perf_counter()
        span = telemetry.start_call(self._trace_parent, record)
        try:
            with telemetry.current(span):  # the endpoint's request names the call's span
                if self._durable is None:
                    reply = await self._dispatch(tool_name, request, record)
                else:
                    reply = await self._logged(self._durable, tool_name, request, record, started)
        except asyncio.CancelledError:
            record.update(status="error", error=dict(CANCELLED))
            raise
        except Exception:
            log.exception("broker: a call of tool %r failed unexpectedly", tool_name)
            reply = fail(
                record, "error", "internal_error", "the service failed to handle this call; see the service log"
            )
        finally:
            if record["duration_ms"] is None:  # a call answered from the log keeps its first run's
                record["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
            telemetry.end_call(span, record)
            if self._on_call_end is not None:
                self._on_call_end(record)
        return reply

    async def _logged(
        self, durable: DurableLog, tool_name: str, request: Request, record: dict[str, Any], started: float
    ) -> dict[str, Any]:
        """A durable job's call: logged, made and its outcome logged, or answered from the log
        (``DurableLog.run``)."""
        args = request.args_json if request.args_json is not None else b""

        def make() -> Awaitable[dict[str, Any]]:
            return self._dispatch(tool_name, request, record)

        return await durable.run(tool_name, args, record, make, self._records.keep, self._on_diverged, started)

    async def _dispatch(self, tool_name: str, request: Request, record: dict[str, Any]) -> dict[str, Any]:
        """Take a recorded call through the lease, the tool, its arguments' checks and its pause, if any, to its
        endpoint or client; returns the reply (without its id)."""
        if self._lease is not None and not self._lease():  # a fenced replica forwards no tool call
            return fail(record, "error", "replica_lost", "this replica lost its lease: no tool call is made")
        tool = self._tools.get(tool_name)
        if tool is None:
            hint = await self._hint(tool_name)
            return fail(record, "rejected", "unknown_tool", f"no tool named {tool_name!r}{hint}")
        if request.too_costly is not None:
            return fail(record, "rejected", "limit_exceeded", f"{tool_name}: arguments refused: {request.too_costly}")
        if request.deep:
            return fail(
                record, "rejected", "invalid_arguments", f"{tool_name}: arguments nested deeper than {MAX_JSON_DEPTH}"
            )
        if not tool.callable_from_code:
            return fail(
                record, "rejected", "not_allowed", f"{tool_name} is not callable from code (see its allowed_callers)"
            )
        checked = VALID if request.small and tool.cheap_arguments and self._inline(valid, tool, request.args) else None
        if checked is None:
            try:
                checked = await self._off_loop(check_arguments, tool, request.args)
            except CheckTooCostly as exc:
                return fail(record, "rejected", "limit_exceeded", f"{tool_name}: arguments refused: {exc}")
        check, args_json = checked.check, request.args_json
        if check.problem is not None:
            return fail(record, "rejected", "invalid_arguments", f"{tool_name}: {check.problem}")
        args = request.args if checked is VALID else check.args
        if check.repaired:
            self._records.unkeep(record, "args", len(request.args_json or b""))
            if checked.args_json is None:
                message = f"{tool_name}: arguments nested deeper than {MAX_JSON_DEPTH}"
                return fail(record, "rejected", "invalid_arguments", message)
            args_json = checked.args_json
            self._records.keep(record, "args", args_json)
            record["repaired"] = True
            record["repairs"].append(JSON_TEXT_REPAIR)
        if tool.endpoint.kind == "client":
            answer = await self._paused.ask_client(tool, args_json or b"null", record)
            if not isinstance(answer, ClientResult):
                return answer
            return await self._accept_result(tool, record, answer.value)
        if checked.needs_approval:
            refused = await self._paused.await_approval(tool, args_json or b"null", record)
            if refused is not None:
                return refused
        return await self._forward(tool, args, record, request.small)

    async def _hint(self, tool_name: str) -> str:
        """The hint ``; did you mean 'a', 'b'?`` for an unknown tool's name (for the job's first ``MAX_HINTS`` such
        calls, names of at most ``HINT_NAME_MAX`` characters; difflib on the check threads), or an empty string."""
        if self._hints_left <= 0 or len(tool_name) > HINT_NAME_MAX:
            return ""
        self._hints_left -= 1
        visible = [name for name, spec in self._tools.items() if spec.callable_from_code][:HINT_CANDIDATES]
        close = await self._off_loop(difflib.get_close_matches, tool_name, visible, 3)
        return f"; did you mean {', '.join(map(repr, close))}?" if close else ""

    async def _forward(self, tool: ToolSpec, args: Any, record: dict[str, Any], small: bool) -> dict[str, Any]:
        """Call the tool's endpoint (within the job's and the tool's concurrency), then check its result;
        ``small``: the call's line was read on the loop. Returns the reply."""
        try:
            async with self._endpoint_slots, self._tool_slots(tool):
                result, attempts = await self._call_endpoint(tool, args, record["call_id"])
        except ToolCallFailed as exc:
            if exc.attempts > 1:
                record["attempts"] = exc.attempts
            message = _scrub(exc.message, tool)
            return fail(record, "timeout" if exc.type == "timeout" else "error", exc.type, message)
        except Exception:
            log.exception("broker: endpoint of tool %s failed unexpectedly", tool.name)
            return fail(record, "error", "endpoint_error", "the tool's endpoint failed; see the service log")
        if attempts > 1:
            record["attempts"] = attempts
        # An echo's result holds the arguments of a line read on the loop; an answer body as small as such a line
        small = small if tool.endpoint.kind == "echo" else isinstance(result, RawJson) and inline_body(result)
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
                return fail(record, "error", "limit_exceeded", f"{tool.name}: result refused: {exc}")
        if checked.result_json is None:
            type_, message = checked.problem or ("bad_response", "the result cannot be encoded as JSON")
            return fail(record, "error", type_, message)
        self._records.keep(record, "result", checked.result_json)
        record["status"] = "ok"
        return {"ok": True, "result": orjson.Fragment(checked.result_json)}

    def _tool_slots(self, tool: ToolSpec) -> contextlib.AbstractAsyncContextManager[Any]:
        """The tool's ``max_concurrency`` semaphore for this job (created on first use), or no limit."""
        if tool.max_concurrency is None:
            return contextlib.nullcontext()
        slots = self._per_tool.get(tool.name)
        if slots is None:
            slots = self._per_tool[tool.name] = asyncio.Semaphore(tool.max_concurrency)
        return slots

    async def _call_endpoint(self, tool: ToolSpec, args: dict[str, Any], call_id: str) -> tuple[Any, int]:
        """Call the endpoint (an HTTP endpoint gets ``call_id`` as ``Idempotency-Key``, every attempt); an
        idempotent tool is retried (exponential backoff, tenacity) after a failure that may pass (timeout,
        unreachable, 5xx), up to ``tool.retries`` more times. Returns (result, attempts)."""
        if not tool.idempotent or tool.retries == 0:
            return await self._endpoints.call(tool, args, raw=True, call_id=call_id), 1
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
                    return await self._endpoints.call(tool, args, raw=True, call_id=call_id), attempts
        except ToolCallFailed as exc:
            exc.attempts = attempts
            raise
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    def _inline(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)`` here, on the event loop, within ``INLINE_CHECK_BUDGET_S`` of CPU time and the job's key's
        share of the loop (``CheckScheduler.inline``); None past either (the caller does the check again on the
        check threads). Only for checks bounded by ``cheap_schema`` and a small instance."""
        return self._checks.inline(self._check_group, INLINE_CHECK_BUDGET_S, INLINE_TICKS_PER_READ, fn, *args)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound checking on the shared check threads (one at a time per job, fairly, within the budget)."""
        return await self._checks.run(self._check_group, self, fn, *args)


def _scrub(message: str, tool: ToolSpec) -> str:
    """``message`` without the endpoint's header values (an endpoint may echo credentials in an error page)."""
    for value in tool.endpoint.headers.values():
        if len(value) >= 4:
            message = message.replace(value, "[redacted]")
            _, _, token = value.partition(" ")  # "Bearer <token>": the token alone too
            if len(token) >= 4:
                message = message.replace(token, "[redacted]")
    return message


def _transient(exc: BaseException) -> bool:
    """Failures worth another attempt of an idempotent tool."""
    if not isinstance(exc, ToolCallFailed):
        return False
    return exc.type in ("timeout", "endpoint_unreachable") or exc.message.startswith("HTTP 5")
