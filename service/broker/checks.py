"""The work on one request's or result's JSON, sized by the sandbox or an endpoint: parsing, depth checks,
encoding for the record, argument and result checks.

Its CPU time grows with the input, so these run on the shared ``CheckScheduler``'s threads, in the job's turn,
within a CPU budget (``CheckTooCostly`` past it): never on the event loop, but for what is bounded by constants,
not by the input: a line ``inline_request`` accepts is read there (``read_request(line, check_depth=False)``),
and a small call of a tool with ``cheap_arguments`` / ``cheap_result`` is tried there
(``service.broker.dispatch``). Values keep their exact meaning (``service.exactjson``): integers of any size
cross exactly both ways (past Python's 4,300 digits a request is refused as not JSON); NaN, infinities and lone
surrogates are refused. Large texts are parsed with the garbage collector paused (``collector.gc_paused``), whose
collections inside the parser would hold the GIL.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import referencing.exceptions

from service import exactjson
from service.broker.config import REPORT_FIELD_CAP
from service.collector import gc_paused
from service.errors import CheckTooCostly
from service.toolkit.endpoints import RawJson
from service.toolkit.specs import ArgumentCheck, ToolSpec
from service.toolkit.validation import deeper_than

MAX_JSON_DEPTH = 64  # arguments and results nested deeper are refused
# A request line this short, with at most MAX_JSON_DEPTH brackets (so it cannot nest deeper), is parsed on the event
# loop: parsing 4 KiB takes microseconds, less than a hop to a check thread; any longer line (or one with more
# brackets) is parsed, depth-checked and encoded on the check threads, in its job's turn.
INLINE_LINE_BYTES = 4096
STUB_REPAIRS = frozenset({"positional_dict"})  # a request's "repair" values a record lists (``CallRecord.repairs``)

# Parsing is kept to ``parse_request_line`` and ``parse_result_body``, one function each.


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


def _fits_64(request_id: int | str) -> bool:
    """A string, or an integer a reply can carry (orjson writes 64-bit integers only)."""
    return isinstance(request_id, str) or -(1 << 63) <= request_id < 1 << 64


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


VALID = CheckedArguments(ArgumentCheck(None, None))  # ``valid`` said so: the request's own arguments go out


@dataclass(frozen=True)
class CheckedResult:
    """A result checked: ``result_json`` (its JSON bytes), or ``problem`` (error type, message)."""

    result_json: bytes | None = None
    problem: tuple[str, str] | None = None


def check_result(tool: ToolSpec, result: Any) -> CheckedResult:
    """Parse (``RawJson``), depth-check, check against the output schema and encode one result; a large one with
    the collector paused from its parse until its parsed value is gone (``_check_result`` returned): with the
    collector on while that value lived, each collection walked every one of its objects (a million for an 8 MiB
    nested result, ~150 ms each here), the event loop waiting all the while.

    Raises:
        CheckTooCostly: past the check's CPU budget.
    """
    if isinstance(result, RawJson) and len(result.body) > INLINE_LINE_BYTES:
        with gc_paused():
            return _check_result(tool, result)
    return _check_result(tool, result)


def _check_result(tool: ToolSpec, result: Any) -> CheckedResult:
    if isinstance(result, RawJson):
        try:
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
    """``value`` as JSON bytes (``exactjson``), None when it cannot be encoded."""
    try:
        return exactjson.dumps(value)
    except ValueError:
        return None
