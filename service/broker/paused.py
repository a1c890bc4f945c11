"""Calls paused until the harness answers them over the API (``pending_calls``; the job is ``waiting`` meanwhile).

Two kinds of call pause: a client-executed tool's call (``PausedCalls.answer_client_call``), and a call that needs
approval (``ToolSpec.approval``), once its arguments are valid (``PausedCalls.decide_approval``): approved, it goes
on to its endpoint; denied, it ends ``error`` with type ``denied``; undecided for its approval timeout, ``timeout``
with type ``approval_timeout`` (the endpoint never saw it). Its record's ``approval`` says who decided, and when.
A client's answer is held to the same rules as an endpoint's (NaN, infinities and lone surrogates refused,
``bad_response``); the dispatcher then checks it as a result.

No call waits past ``BrokerConfig.max_pause_s`` (``PTC_MAX_PARK_S``), whatever its tool says. A durable job parked
while calls waited (``service.jobs.parking``) resumes with the answers given meanwhile (``answers``: each is taken
by its call when the replay makes it again, at once) and the expiry of the calls still unanswered (``carried``:
such a call, made again, waits only until its first expiry, and an answer to it that comes before the replay made
it again is kept for it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson

from service import exactjson
from service.broker.config import REPORT_FIELD_CAP, BrokerConfig
from service.broker.records import fail, now
from service.errors import CallNotPending, PayloadTooLarge
from service.toolkit.specs import ToolSpec


@dataclass(frozen=True)
class _Paused:
    """A call held until the harness answers it: the answer's future, what it awaits (``client`` or ``approval``),
    its arguments (JSON), its record and when it stops waiting."""

    future: asyncio.Future[Any]
    awaiting: str
    args: orjson.Fragment
    record: dict[str, Any]
    expires_at: datetime


Answer = dict[str, Any]
"""An answer given while its job was parked (stored in its call log, ``durable.encode_answer``):
``{"kind": "client", "ok": bool, "value": result or {"type", "message"}}``, ``{"kind": "approval", "approval":
{"decision", "by", "at", "reason"}}`` or ``{"kind": "timeout"}``."""


@dataclass(frozen=True)
class ClientResult:
    """A client's result for a client-executed call, strict JSON, not yet checked against the tool's output
    schema."""

    value: Any


class PausedCalls:
    """One job's calls waiting for the harness, by call id.

    Args:
        config: the job's ``client_call_timeout_s`` and ``approval_timeout_s``.
        on_change: called with the number of calls waiting (client-executed calls and calls awaiting approval)
            whenever it changes; None: not told.

    Event-loop thread only.
    """

    def __init__(
        self,
        config: BrokerConfig,
        on_change: Callable[[int], None] | None = None,
        answers: Mapping[str, Answer] | None = None,
        carried: Mapping[str, tuple[str, datetime]] | None = None,
    ) -> None:
        self._client_timeout = config.client_call_timeout_s
        self._approval_timeout = config.approval_timeout_s
        self._max_pause = config.max_pause_s
        self._on_change = on_change
        self._paused: dict[str, _Paused] = {}
        self._answers: dict[str, Answer] = dict(answers or {})  # given while parked, by call id (see the module)
        self._early: dict[str, int] = {}  # bytes of each answer kept before its call was made again
        self._max_early_bytes = config.max_in_flight_bytes
        self._carried: dict[str, tuple[str, datetime]] = dict(carried or {})  # awaiting, expiry, by call id
        self.waiting_since: float | None = None  # loop time since which some call has waited without a break

    @property
    def waiting(self) -> int:
        """How many calls wait for the harness now."""
        return sum(not p.future.done() for p in self._paused.values())

    @property
    def pending_calls(self) -> list[dict[str, Any]]:
        """Calls waiting for the harness, in arrival order: ``{"call_id", "tool", "args", "awaiting"}`` each, with
        ``awaiting`` ``"client"`` (a client-executed call: ``answer_client_call``) or ``"approval"``
        (``decide_approval``); ``args`` raw JSON (``orjson.Fragment``)."""
        waiting = sorted(self._paused.values(), key=lambda paused: int(paused.record["seq"]))
        return [
            {
                "call_id": p.record["call_id"],
                "tool": p.record["tool"],
                "args": p.args,
                "awaiting": p.awaiting,
                "expires_at": p.expires_at,
            }
            for p in waiting
            if p.record["status"] == "pending"
        ]

    def answer_client_call(self, call_id: str, ok: bool, value: Any) -> bool:
        """Resolve a waiting client-executed call with a result (``ok``) or an error ``{"type", "message"}``; True
        when the answer was kept for a call the resumed job has not made again yet (``carried``: the caller stores
        it in the job's call log too).

        Raises:
            CallNotPending: no client-executed call of that id is waiting (unknown, already answered or timed out).
            PayloadTooLarge: an answer kept early would take the job's early answers past ``max_in_flight_bytes``.
        """
        if self._keep_early(call_id, "client", client_answer(ok, value)):
            return True
        self._waiting(call_id, "client").future.set_result((ok, value))
        return False

    def decide_approval(self, call_id: str, approved: bool, by: str, reason: str | None) -> bool:
        """Approve (the call goes on to its endpoint) or deny (the script gets a ``denied`` ToolError) a call
        awaiting approval; its record's ``approval`` says so at once.

        Args:
            by: the API key name that decided.
            reason: free text (at most ``REPORT_FIELD_CAP`` characters kept); a denial's reaches the script.

        Raises:
            CallNotPending: no call of that id awaits approval (unknown, decided, timed out, or client-executed).
        """
        decision = approval_decision(approved, by, reason)
        if self._keep_early(call_id, "approval", {"kind": "approval", "approval": decision}):
            return True
        paused = self._waiting(call_id, "approval")
        paused.record["approval"] = decision
        paused.future.set_result(approved)
        return False

    def _keep_early(self, call_id: str, awaiting: str, answer: Answer) -> bool:
        """Keep an answer to a call its parked job had waiting, which its replay has not made again yet, within
        ``max_in_flight_bytes`` for all such answers of the job (else PayloadTooLarge); False for any other call."""
        carried = self._carried.get(call_id)
        if carried is None or carried[0] != awaiting or call_id in self._paused or call_id in self._answers:
            return False
        size = len(exactjson.dumps(answer.get("value"))) if answer["kind"] == "client" else 0
        if sum(self._early.values()) + size > self._max_early_bytes:
            message = (
                f"this job holds {self._max_early_bytes} bytes of answers to calls its resumed script has not made "
                "again yet; answer this call once it is listed in pending_calls"
            )
            raise PayloadTooLarge(message, ("body",), self._max_early_bytes)
        self._early[call_id] = size
        self._answers[call_id] = answer
        return True

    async def await_approval(self, tool: ToolSpec, args_json: bytes, record: dict[str, Any]) -> dict[str, Any] | None:
        """Hold a call that needs approval until it is decided; None when approved, else the failure reply
        (``denied``, or ``approval_timeout`` once the tool's or the job's approval timeout passes).
        ``args_json``: its arguments, shown by ``pending_calls``."""
        timeout = (tool.approval.timeout_s if tool.approval is not None else None) or self._approval_timeout
        try:
            approved = await self._pause(record, "approval", args_json, min(timeout, self._max_pause))
        except TimeoutError:
            record["approval"] = {"decision": "timed_out", "by": None, "at": now(), "reason": None}
            message = f"{tool.name}: no approval came within {timeout:g} s; the call was not made"
            return fail(record, "timeout", "approval_timeout", message)
        if approved:
            return None
        reason = record["approval"]["reason"]
        return fail(record, "error", "denied", f"{tool.name}: denied" + (f": {reason}" if reason else ""))

    async def ask_client(
        self, tool: ToolSpec, args_json: bytes, record: dict[str, Any]
    ) -> ClientResult | dict[str, Any]:
        """Hold a client-executed call until the client answers it (POST /jobs/{id}/calls/{call_id}) or the tool's
        or the job's timeout passes. Returns the client's result (``ClientResult``), or the failure reply: its
        error (type and message capped at ``REPORT_FIELD_CAP``), ``timeout``, or ``bad_response`` for a result
        that is not strict JSON. ``args_json``: the call's arguments, shown by ``pending_calls``."""
        timeout = min(tool.timeout_s or self._client_timeout, self._max_pause)
        try:
            ok, value = await self._pause(record, "client", args_json, timeout)
        except TimeoutError:
            return fail(record, "timeout", "timeout", f"{tool.name}: the client did not answer within {timeout:g} s")
        if isinstance(value, InvalidAnswer):  # given while the job was parked: refused as it would have been then
            return fail(record, "error", "bad_response", f"{tool.name}: {value.message}")
        if not ok:
            kind = str(value.get("type", "client_error"))[:REPORT_FIELD_CAP]
            return fail(record, "error", kind, str(value.get("message", ""))[:REPORT_FIELD_CAP])
        try:
            exactjson.strict_dumps(value)  # the API's JSON reader lets NaN and infinities through
        except ValueError as exc:
            return fail(record, "error", "bad_response", f"{tool.name}: the client's result is not JSON: {exc}")
        return ClientResult(value)

    def _waiting(self, call_id: str, awaiting: str) -> _Paused:
        """The paused call ``call_id`` if it waits for ``awaiting``; raises CallNotPending if not (unknown,
        answered, timed out, or waiting for the other kind of answer)."""
        paused = self._paused.get(call_id)
        if paused is None or paused.awaiting != awaiting or paused.future.done():
            raise CallNotPending(call_id)
        return paused

    async def _pause(self, record: dict[str, Any], awaiting: str, args_json: bytes, timeout_s: float) -> Any:
        """Hold the call until the harness answers it (the value ``answer_client_call`` or ``decide_approval`` set)
        or ``timeout_s`` passes (TimeoutError); an answer given while its job was parked is taken at once, and a
        call its parked job had waiting waits only until its first expiry."""
        call_id = record["call_id"]
        carried = self._carried.pop(call_id, None)
        answer = self._answers.pop(call_id, None)
        self._early.pop(call_id, None)  # taken: its bytes are the call's now
        if answer is not None:
            return _taken(answer, record)
        expires_at = now() + timedelta(seconds=timeout_s)
        if carried is not None:
            expires_at = min(expires_at, carried[1])
            timeout_s = max((expires_at - now()).total_seconds(), 0.0)
        future = asyncio.get_running_loop().create_future()
        self._paused[call_id] = _Paused(future, awaiting, orjson.Fragment(args_json), record, expires_at)
        self._changed()
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            del self._paused[call_id]
            self._changed()

    def _changed(self) -> None:
        waiting = self.waiting
        if not waiting:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = asyncio.get_running_loop().time()
        if self._on_change is not None:
            self._on_change(waiting)


def approval_decision(approved: bool, by: str, reason: str | None) -> dict[str, Any]:
    """A call record's ``approval`` for a decision made now by the key ``by``: ``{"decision", "by", "at",
    "reason"}``, the reason capped at ``REPORT_FIELD_CAP`` characters."""
    return {
        "decision": "approved" if approved else "denied",
        "by": by,
        "at": now(),
        "reason": reason[:REPORT_FIELD_CAP] if reason is not None else None,
    }


@dataclass(frozen=True)
class InvalidAnswer:
    """A client's result given while its job was parked that JSON cannot carry exactly (NaN, infinities, a lone
    surrogate): stored as ``{"kind": "client", "invalid": message}`` and refused (``bad_response``) when taken, as
    a live answer would be."""

    message: str


def client_answer(ok: bool, value: Any) -> Answer:
    """A client's answer as a parked job's call log stores it (``Answer``): a result JSON cannot carry exactly
    becomes ``invalid`` with the refusal's message."""
    if ok:
        try:
            exactjson.strict_dumps(value)
        except ValueError as exc:
            return {"kind": "client", "invalid": f"the client's result is not JSON: {exc}"}
    return {"kind": "client", "ok": ok, "value": value}


def _taken(answer: Answer, record: dict[str, Any]) -> Any:
    """What ``_pause`` returns for an answer given while the job was parked (raises TimeoutError for a timeout)."""
    if answer["kind"] == "timeout":
        raise TimeoutError
    if "invalid" in answer:
        return True, InvalidAnswer(str(answer["invalid"]))
    if answer["kind"] == "approval":  # its time as a live decision's (from the log: ISO 8601 text)
        at = answer["approval"]["at"]
        record["approval"] = {
            **answer["approval"],
            "at": at if isinstance(at, datetime) else datetime.fromisoformat(at),
        }
        return answer["approval"]["decision"] == "approved"
    return answer["ok"], answer["value"]
