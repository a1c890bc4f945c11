"""Durable jobs' run specs and call logs (tables ``job_runs`` and ``job_calls``): what a job needs to be resumed in a
fresh sandbox by replaying its recorded calls (docs/durability.md).

- A **run spec** is what the job's first run was made from and a replay must use again (the script, its files, env,
  manifest, image, limits, the interpreter's string-hash seed), as one JSON document written by the job service at
  admission (``put_spec``); the store does not read it.
- A **call log** is one row per tool call of the job, at its place ``seq`` (from 1): its deterministic ``call_id``,
  its ``tool``, its arguments as the script sent them (``args``, JSON), and once it has one its ``outcome`` (JSON:
  the reply the script got and the call's record, written by the broker; None: the call's intent only, its request
  may have gone out). A write replaces the row of the same ``(job_id, seq)``.

Both go with their job (``JobRecords.purge``), and are dropped earlier once a job has ended (``forget``).
``CallLog`` is the resource's interface; ``sqlite_call_log`` and ``pg_call_log`` implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LoggedCall:
    """One call of a durable job's log.

    Attributes:
        seq: its place in the log, from 1 (unique per job).
        call_id: its deterministic id (``service.broker.durable.call_id``), sent to HTTP endpoints as
            ``Idempotency-Key``.
        tool: the tool's name as the script called it.
        args: the arguments as the script sent them (JSON bytes).
        outcome: the reply and the record, JSON bytes (``service.broker.durable``), or None while only the intent
            is stored.
    """

    seq: int
    call_id: str
    tool: str
    args: bytes
    outcome: bytes | None = None


class CallLog(Protocol):
    """Durable jobs' run specs and call logs. Coroutines, safe to call concurrently."""

    async def put_spec(self, job_id: str, spec: bytes) -> None:
        """Keep a job's run spec (JSON bytes), replacing an earlier one."""
        ...

    async def spec(self, job_id: str) -> bytes | None:
        """A job's run spec, or None without one."""
        ...

    async def write(self, job_id: str, calls: Sequence[LoggedCall]) -> None:
        """Write ``calls`` of one job in one transaction, each replacing the row of its ``seq`` (a ``seq`` given
        twice: its last); none: nothing is written."""
        ...

    async def calls(self, job_id: str) -> list[LoggedCall]:
        """A job's logged calls, by ``seq``."""
        ...

    async def settle(self, job_id: str, call_id: str, outcome: bytes, over: bytes | None) -> bool:
        """Set the outcome of the call ``call_id`` of a job's log to ``outcome`` (a harness's answer to a parked
        job's call) if it has none yet, or (``over``) one that starts with ``over`` (an earlier answer); whether it
        was set. One row is written; none is read back."""
        ...

    async def settled(self, job_id: str, prefix: bytes) -> set[str]:
        """The call ids of a job's log whose outcome starts with ``prefix`` (the answers ``settle`` stored)."""
        ...

    async def forget(self, job_id: str) -> None:
        """Drop a job's run spec and call log (the job has ended; nothing will resume it)."""
        ...
