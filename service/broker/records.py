"""A job's call records, the only authority on which tool calls happened, and the bytes they hold.

Every request naming a tool gets a call record (``CallRecords.open``), appended when it arrives (``seq`` in
arrival order, status ``pending``) and completed when it ends:

- ``rejected``: unknown tool, or arguments that fail the tool's schema;
- ``ok`` / ``error`` / ``timeout``: the endpoint's outcome;
- ``error`` with type ``cancelled``: the job ended while the call was in flight (``CallRecords.cancel_pending``).

Records hold arguments and results as raw JSON (``orjson.Fragment``), not as Python objects, and at most
``BrokerConfig.max_record_bytes`` of them per job (and ``CallMemory.max_record_bytes`` for all jobs together, and
what is left of the owner's ``output_bytes`` quota, ``budget``): past that, a record keeps its call (tool, status,
timing, error) but its ``args`` / ``result`` become null with ``args_dropped_bytes`` / ``result_dropped_bytes``
saying how many bytes were not kept. Past ``BrokerConfig.max_calls`` a call is refused without a record (counted
in ``calls_over_limit``).

The runtime's reports (``{"op": "report"}``) are kept here too, as the script's claims: ``script_report`` (its
uncaught exception; ``service.verdict`` only labels it inside the error the service observed) and
``ran_as_coroutine`` (the script had top-level ``await``).
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

import orjson

from service.broker.config import REPORT_FIELD_CAP, BrokerConfig
from service.files import FileBudget

MAX_REPORT_INT = 1 << 31  # a report's line and column are kept when 0 <= value < this
CANCELLED = {"type": "cancelled", "message": "the job ended before the tool answered"}


def now() -> datetime:
    """The time a record notes (``started_at``, an approval's ``at``): aware, UTC."""
    return datetime.now(UTC)


def fail(record: dict[str, Any], status: str, type_: str, message: str) -> dict[str, Any]:
    """End ``record`` with ``status`` and the error ``{"type", "message"}`` (the message capped at
    ``REPORT_FIELD_CAP`` characters: a schema error may quote a whole argument); returns the reply (without its
    id) that tells the script."""
    if len(message) > REPORT_FIELD_CAP:
        message = message[: REPORT_FIELD_CAP - 5] + " [...]"
    error = {"type": type_, "message": message}
    record.update(status=status, error=error)
    return {"ok": False, "error": error}


class CallMemory:
    """Bytes of tool-call JSON the service holds for all its live jobs, and their two service-wide caps.

    Args:
        max_record_bytes: arguments and results kept in the call records of all live jobs (JSON bytes); a
            record that would pass it keeps its call but not its arguments/result (``*_dropped_bytes``).
        max_in_flight_bytes: request lines of the calls being handled, all jobs together (JSON bytes); a call
            that would pass it is refused with ``limit_exceeded`` (record ``rejected``).

    A job's records return their kept bytes with ``CallRecords.release`` once the job's final view is saved.
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


class CallRecords:
    """One job's call records and the script's reports; the bytes the records keep, within their three caps.

    Args:
        config: the job's ``max_calls`` and ``max_record_bytes``.
        memory: the service-wide account of kept record bytes (shared by every job's records).
        budget: what the job's owner may still keep (its ``output_bytes`` quota, shared with its retained output):
            the records' kept bytes are taken from it and stay taken after the job (until its purge gives them
            back: ``kept_bytes`` says how many); None: no owner cap.

    Attributes:
        max_calls: calls that may get a record (``BrokerConfig.max_calls``).
        calls: the records, in arrival order: dicts with every field of ``schemas.job_models.CallRecord``; the job's
            ``calls`` (the same list, read live by its views).
        calls_over_limit: calls refused past ``max_calls``, which got no record.
        script_report: the runtime's last report of the script's uncaught exception (``type``, ``message``,
            ``text``, ``line``, ``column``; strings capped at ``REPORT_FIELD_CAP``), unverified; None if none.
        ran_as_coroutine: the runtime said the script ran as a coroutine (top-level ``await``).
        kept_bytes: bytes of arguments and results kept in the records (``release`` does not reset it).

    Event-loop thread only.
    """

    def __init__(self, config: BrokerConfig, memory: CallMemory, budget: FileBudget | None = None) -> None:
        self.max_calls = config.max_calls
        self._cap = config.max_record_bytes
        self._memory = memory
        self._budget = budget
        self._held = 0  # bytes kept and still counted in ``memory`` (``release`` gives them back)
        self.calls: list[dict[str, Any]] = []
        self.calls_over_limit = 0
        self.script_report: dict[str, Any] | None = None
        self.ran_as_coroutine = False
        self.kept_bytes = 0

    def admit(self) -> bool:
        """Whether another call may have a record (fewer than ``max_calls`` so far); when not, it is counted in
        ``calls_over_limit``."""
        if len(self.calls) < self.max_calls:
            return True
        self.calls_over_limit += 1
        return False

    def open(self, tool_name: str) -> dict[str, Any]:
        """A new record, appended: every field of ``schemas.job_models.CallRecord`` (in its order), status ``pending``,
        ``seq`` its place (from 1), a fresh ``call_id``."""
        record = {
            "seq": len(self.calls) + 1,
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
            "started_at": now(),
            "duration_ms": None,
            "args_dropped_bytes": None,
            "result_dropped_bytes": None,
            "approval": None,
        }
        self.calls.append(record)
        return record

    def keep(self, record: dict[str, Any], field: str, encoded: bytes) -> None:
        """Keep ``encoded`` (JSON) as ``record[field]`` (``args`` or ``result``) if the job's and the service's
        record caps and the owner's budget allow; else null with ``<field>_dropped_bytes``."""
        size = len(encoded)
        if self._held + size <= self._cap and self._memory.keep(size) and self._owner_keeps(size):
            self._held += size
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

    def unkeep(self, record: dict[str, Any], field: str, size: int) -> None:
        """Drop ``record[field]`` (``size`` bytes of JSON) and give back the bytes it kept, if it kept them."""
        if isinstance(record[field], orjson.Fragment):
            self._held -= size
            self.kept_bytes -= size
            self._memory.forget(size)
            if self._budget is not None:
                self._budget.give_back(size)
        record[field] = None
        record[f"{field}_dropped_bytes"] = None

    def release(self, keep_budget: bool = True) -> None:
        """Return the kept record bytes to the service-wide account (the job's final view has been saved); the
        owner's budget keeps them taken, unless not ``keep_budget`` (the job was parked: the replay of its resume
        keeps them, and takes them, again)."""
        self._memory.forget(self._held)
        if not keep_budget and self._budget is not None:
            self._budget.give_back(self.kept_bytes)
        self._held = 0

    def cancel_pending(self) -> None:
        """End every record still ``pending`` as ``error``/``cancelled`` (calls cancelled before their task ran):
        once the broker has closed, the records are final."""
        for record in self.calls:
            if record["status"] == "pending":
                record.update(status="error", error=dict(CANCELLED))

    def note_report(self, error: Any, ran_as_coroutine: bool) -> None:
        """Keep a runtime report: the last error report with a ``type`` (the runtime's comes after the script's
        code) as ``script_report``, its fields checked and capped; ``ran_as_coroutine`` once said stays."""
        self.ran_as_coroutine = self.ran_as_coroutine or ran_as_coroutine
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
