"""A durable job's call log as its broker keeps it: every call's intent stored before its request goes out, its
outcome stored before the script sees it, and, when the job is resumed, each call answered from the log.

- **Ids.** A logged call's id is derived from the job and the call's place in the log (``call_id``): the same
  call keeps its id across every run of the job, and HTTP endpoints get it as ``Idempotency-Key``.
- **Writes.** ``DurableLog.begin`` (a call's intent) and ``outcome`` hand their entry to the job's writer, which
  stores what arrived in one turn of the event loop as one batch (``CallLogPort``), batches in order; each caller
  waits for its batch. A call whose intent could not be stored is not made, and the job gives up durability.
- **Bounded.** A job's log holds at most the bytes of its ``bounds`` (arguments and outcomes): a call that would
  pass them makes the job give up durability (``give_up``: its log and run spec dropped before anything more
  happens); it and every later call are made unlogged.
- **Replay.** A resumed job's broker starts with the log of its earlier runs (``logged``). A call takes the first
  unconsumed entry of the same tool and arguments (the arguments' JSON bytes as the script sent them, so
  concurrent calls match in any order): an entry with an outcome answers it from the log (``Replayed``); one with
  only an intent (the earlier run died with its request perhaps sent) is made again, with the same id. A call
  that matches nothing while entries remain waits until the log is consumed (then it goes live) or until no call
  has consumed an entry for ``SETTLE_S``: the replay has diverged (``Diverged``), and no waiting call ever reaches
  an endpoint.

An outcome is stored as one line of JSON (the reply's ``ok`` and ``error``, and the record's fields) followed by
a newline and the result's JSON bytes as the endpoint gave them (nothing to parse to answer from the log).

- **Answers.** A call that waited for the harness when its job was parked (``service.jobs.parking``) has only its
  intent; the harness's answer to it (or its expiry) is stored in its entry's place as ``{"answer": ...}``
  (``encode_answer``) until the call's outcome replaces it: the replay makes the call again, under its id, and the
  answer is handed to it (``answers``, for ``PausedCalls``), through the same checks as a live answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import orjson

from service import exactjson
from service.broker.records import fail

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # how long an unmatched call waits for the log to be consumed by others before the replay diverged
ARGS_SHOWN = 200  # characters of a call's arguments a divergence message quotes
RECORD_FIELDS = ("status", "error", "repaired", "repairs", "caller", "attempts", "duration_ms", "approval")


def call_id(job_id: str, seq: int) -> str:
    """The id of the ``seq``-th logged call of ``job_id`` (``call_`` and 16 hex digits of SHA-256): the same on
    every run of the job, unguessable without the job's id."""
    return "call_" + hashlib.sha256(f"{job_id}/{seq}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Logged:
    """One entry of a call log (``service.store.call_log.LoggedCall`` as the broker sees it): place, id, tool,
    arguments (JSON bytes as sent), outcome (``encode_outcome``) or None while only the intent is stored."""

    seq: int
    call_id: str
    tool: str
    args: bytes
    outcome: bytes | None = None


class CallLogPort(Protocol):
    """Where a job's call log is stored (the job service adapts its store to it)."""

    def __call__(self, entries: Sequence[Logged]) -> Awaitable[None]:
        """Store ``entries`` (each replacing the entry of its ``seq``) in one transaction; raises what the store
        raises."""
        ...


@dataclass(frozen=True)
class Replayed:
    """A call answered from the log: the reply the script gets and the record's fields as the first run ended
    them (``result``: the result's JSON bytes, None without one)."""

    reply: dict[str, Any]
    fields: dict[str, Any]
    result: bytes | None


class Diverged(Exception):
    """The replay made a call the log does not hold while logged calls remained unconsumed."""


class LogFull(Exception):
    """The call log would pass its bytes cap: the job has given up durability (``DurableLog.give_up``)."""


def encode_outcome(record: dict[str, Any], reply: dict[str, Any]) -> bytes:
    """A finished call's outcome as stored: one JSON line (``ok``, ``error``, the record's ``RECORD_FIELDS`` and
    ``started_at``), a newline, then the result's JSON bytes (none when the call failed)."""
    head = {name: record.get(name) for name in RECORD_FIELDS}
    head["started_at"] = record["started_at"].isoformat() if record.get("started_at") else None
    head["ok"] = bool(reply.get("ok"))
    head["error"] = reply.get("error")
    result = reply.get("result") if reply.get("ok") else None
    tail = b"" if result is None else orjson.dumps(result)  # a fragment (an endpoint's body) as it is
    return orjson.dumps(head) + b"\n" + tail


ANSWER = b'{"answer":'  # how an entry holding an answer (``encode_answer``) begins; no outcome begins so


def encode_answer(answer: dict[str, Any]) -> bytes:
    """An answer given to a parked job's waiting call, as stored in the call's entry (see the module): exactly
    (integers of any size). Raises ValueError for a value JSON cannot carry exactly (NaN, infinities, a lone
    surrogate: ``PausedCalls.invalid_answer`` stands for such a client result)."""
    return ANSWER + exactjson.strict_dumps(answer) + b"}"


def decode_answer(outcome: bytes | None) -> dict[str, Any] | None:
    """The answer an entry holds in place of its outcome (``encode_answer``); None for an outcome or none."""
    if outcome is None or not outcome.startswith(ANSWER):
        return None
    answer: dict[str, Any] = exactjson.loads(outcome)["answer"]
    return answer


def decode_outcome(outcome: bytes) -> Replayed:
    """A stored outcome (``encode_outcome``) as the reply and record fields it gives."""
    line, _, tail = outcome.partition(b"\n")
    head = orjson.loads(line)
    fields = {name: head.get(name) for name in RECORD_FIELDS}
    if head.get("started_at"):
        fields["started_at"] = datetime.fromisoformat(head["started_at"])
    if head["ok"]:
        return Replayed({"ok": True, "result": orjson.Fragment(tail or b"null")}, fields, tail or b"null")
    return Replayed({"ok": False, "error": head["error"]}, fields, None)


class DurableLog:
    """One durable job's call log in its broker (event-loop thread only).

    Args:
        job_id: the job (the calls' ids derive from it).
        port: where entries are stored.
        logged: the log of the job's earlier runs, by ``seq`` (empty for a first run).
        settle_s: how long an unmatched call waits before the replay is declared diverged.
        bounds: the most bytes of arguments and outcomes the log may hold (``PTC_MAX_CALL_LOG_BYTES``), and what
            drops the log and the run spec when a call would pass it (``give_up``; None: no cap).
    """

    def __init__(
        self,
        job_id: str,
        port: CallLogPort,
        logged: Sequence[Logged] = (),
        settle_s: float = SETTLE_S,
        bounds: tuple[int, Callable[[], Awaitable[None]]] | None = None,
    ) -> None:
        self._job_id = job_id
        self._port = port
        self._bounds = bounds
        self.answers: dict[str, dict[str, Any]] = {}  # answers given while the job was parked, by call id
        entries = list(logged)
        for index, entry in enumerate(entries):
            answer = decode_answer(entry.outcome)
            if answer is not None:
                self.answers[entry.call_id] = answer
                entries[index] = Logged(entry.seq, entry.call_id, entry.tool, entry.args)  # its intent only
        self.logged_bytes = sum(len(entry.args) + len(entry.outcome or b"") for entry in entries)
        self._counted = {entry.seq for entry in entries}  # entries whose arguments ``logged_bytes`` counts
        self.given_up = False
        self._unconsumed: dict[tuple[str, bytes], deque[Logged]] = {}  # by (tool, arguments), each by seq
        for entry in sorted(entries, key=lambda entry: entry.seq):
            self._unconsumed.setdefault((entry.tool, entry.args), deque()).append(entry)
        self._left = len(entries)
        self._next_seq = max((entry.seq for entry in entries), default=0) + 1
        self._settle_s = settle_s
        self._held = 0  # calls waiting for the log to be consumed (they match nothing in it)
        self._consumed_at = 0.0  # loop time of the last consumption (the settle watchdog reads it)
        self._settled = asyncio.Event()  # set once the log is consumed or the replay has diverged
        self._watchdog: asyncio.Task[None] | None = None
        self._diverged: str | None = None
        self._first_held: tuple[str, bytes] = ("", b"")  # the first call still waiting, for the message
        self._batch: dict[int, Logged] = {}
        self._batch_done: asyncio.Future[None] | None = None
        self._writing = asyncio.Lock()  # batches reach the store in order
        self._tasks: set[asyncio.Task[None]] = set()
        self.replayed = 0  # calls answered from the log

    @property
    def replaying(self) -> bool:
        """Whether logged calls remain unconsumed."""
        return self._left > 0

    async def begin(self, tool: str, args: bytes) -> tuple[int, str, Replayed | None]:
        """Place a call in the log: ``(seq, call_id, replayed)``, ``replayed`` set when the log answers it (nothing
        to store or send). Otherwise its intent is stored before this returns (a logged intent without outcome is
        made again under its id).

        Raises:
            Diverged: the replay made a call the log does not hold (see the module).
            Exception: what the store raises (the call must not be made).
        """
        entry = await self._match(tool, args)
        if entry is None:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            entry = Logged(seq, call_id(self._job_id, seq), tool, args)
            await self._write(entry)
        elif entry.outcome is not None:
            self.replayed += 1
            return entry.seq, entry.call_id, decode_outcome(entry.outcome)
        return entry.seq, entry.call_id, None  # a logged intent is stored (an answer with it, until its outcome)

    async def run(
        self,
        tool: str,
        args: bytes,
        record: dict[str, Any],
        make: Callable[[], Awaitable[dict[str, Any]]],
        keep: Callable[[dict[str, Any], str, bytes], None],
        on_diverged: Callable[[str], None] | None,
        started: float,
    ) -> dict[str, Any]:
        """One call of the job, ``record`` its record: its intent stored, then made (``make``: the reply), its
        outcome stored, then the reply; or answered from the log, ``record`` restored as the first run ended it
        (the result kept through ``keep``, within the record caps). A call the replay diverged at (``on_diverged``
        is told) or whose intent the store refused is not made: its reply says so. ``started``: the call's
        ``time.perf_counter()`` at arrival (its duration is stored with its outcome)."""
        if self.given_up:
            return await make()
        try:
            seq, call, replayed = await self.begin(tool, args)
        except LogFull:
            return await make()
        except Diverged as exc:
            if on_diverged is not None:
                on_diverged(str(exc))
            return fail(record, "rejected", "replay_diverged", str(exc))
        except Exception:
            log.exception("broker: the call log did not take an intent of tool %r; the job is durable no more", tool)
            try:  # a refusal the log does not hold would make a replay diverge: the job is not resumed
                await self.give_up()
            except Exception:
                log.exception("broker: the job's call log could not be dropped either")
            return fail(record, "error", "store_unavailable", "the job store did not take this call: it was not made")
        record["call_id"] = call
        if replayed is not None:
            record.update(replayed.fields)
            if replayed.result is not None:
                keep(record, "result", replayed.result)
            return replayed.reply
        reply = await make()
        record["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
        try:
            await self.outcome(seq, (call, tool, args), record, reply)
        except LogFull:
            return reply
        except Exception:
            log.exception("broker: the call log did not take an outcome of tool %r", tool)
            message = f"the job store did not take this call's outcome (the call was made, as {call})"
            return fail(record, "error", "store_unavailable", message)
        return reply

    async def outcome(
        self, seq: int, ids: tuple[str, str, bytes], record: dict[str, Any], reply: dict[str, Any]
    ) -> None:
        """Store a made call's outcome (``ids``: its call id, tool and arguments) before the script sees it;
        raises what the store raises."""
        call, tool, args = ids
        await self._write(Logged(seq, call, tool, args, encode_outcome(record, reply)))

    async def _match(self, tool: str, args: bytes) -> Logged | None:
        """Consume the first unconsumed entry of ``tool`` and ``args``; None once the log is consumed (a live
        call). A call that matches nothing waits, without any work per later call, until the log is consumed
        (then it goes live) or until no entry has been consumed for ``settle_s`` (one watchdog per job: the replay
        has diverged); once it has, every call raises.

        Raises:
            Diverged: see the module.
        """
        if self._diverged is not None:
            raise Diverged(self._diverged)
        if not self._left:
            return None
        entries = self._unconsumed.get((tool, args))
        if entries:
            entry = entries.popleft()
            if not entries:
                del self._unconsumed[(tool, args)]
            self._left -= 1
            self._consumed_at = asyncio.get_running_loop().time()
            if not self._left:
                self._settled.set()
            return entry
        self._held += 1
        self._first_held = self._first_held if self._held > 1 else (tool, args)
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
        try:
            await self._settled.wait()
        finally:
            self._held -= 1
        if self._diverged is not None:
            raise Diverged(self._diverged)
        return None

    async def _watch(self) -> None:
        """While calls wait and entries remain: the replay has diverged once none was consumed for ``settle_s``."""
        loop = asyncio.get_running_loop()
        self._consumed_at = max(self._consumed_at, loop.time())
        while self._held and self._left and self._diverged is None:
            quiet = loop.time() - self._consumed_at
            if quiet < self._settle_s:
                await asyncio.sleep(self._settle_s - quiet)
                continue
            tool, args = self._first_held
            first = min((entries[0] for entries in self._unconsumed.values()), key=lambda entry: entry.seq)
            self._diverged = (
                f"the replay called {_shown(tool, args)}, which the call log does not hold, while {self._left} "
                f"logged call(s) were not made again, the first: {_shown(first.tool, first.args)} (call {first.seq})"
            )
            self._settled.set()
        self._watchdog = None

    def unmade(self) -> str | None:
        """What a replay left unconsumed, said as a divergence (the script ended without making these calls
        again); None once the log was consumed, or for a job not resumed."""
        if not self._left or self._diverged is not None:
            return None
        first = min((entries[0] for entries in self._unconsumed.values()), key=lambda entry: entry.seq)
        return (
            f"the replay ended with {self._left} logged call(s) not made again, the first: "
            f"{_shown(first.tool, first.args)} (call {first.seq})"
        )

    async def flushed(self) -> None:
        """Wait for the writes under way to reach the store (the broker closes: its job's log may be dropped next,
        and no batch may land after that). Never raises."""
        if self._batch_done is not None:
            self._flush()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def give_up(self) -> None:
        """Stop logging (the cap was reached): the job's log and run spec are dropped (``bounds``' hook) before
        this returns; later calls are made unlogged. Raises what the hook raises."""
        if not self.given_up:
            self.given_up = True
            if self._bounds is not None:
                await self._bounds[1]()

    async def _write(self, entry: Logged) -> None:
        """Store ``entry`` with the others of this loop turn; returns once its batch is stored. Raises LogFull
        (after ``give_up``) when the log would pass its cap."""
        if self.given_up:
            raise LogFull()
        if self._bounds is not None:
            size = (0 if entry.seq in self._counted else len(entry.args)) + len(entry.outcome or b"")
            if self.logged_bytes + size > self._bounds[0]:
                await self.give_up()
                raise LogFull()
            self.logged_bytes += size
            self._counted.add(entry.seq)
        self._batch[entry.seq] = entry
        if self._batch_done is None:
            loop = asyncio.get_running_loop()
            self._batch_done = loop.create_future()
            loop.call_soon(self._flush)
        await asyncio.shield(self._batch_done)

    def _flush(self) -> None:
        batch, done = self._batch, self._batch_done
        if done is None:  # flushed already (``flushed``)
            return
        self._batch, self._batch_done = {}, None
        task = asyncio.ensure_future(self._store(list(batch.values()), done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store(self, entries: list[Logged], done: asyncio.Future[None]) -> None:
        async with self._writing:
            try:
                await self._port(entries)
            except BaseException as exc:
                if not done.done():
                    done.set_exception(exc)
                    done.exception()  # retrieved: a batch nobody waits for any more is not logged as lost
                if not isinstance(exc, Exception):
                    raise
            else:
                if not done.done():
                    done.set_result(None)


def _shown(tool: str, args: bytes) -> str:
    """``tool(<args>)`` for a message, the arguments cut at ``ARGS_SHOWN`` characters."""
    text = args.decode("utf-8", "replace")
    return f"{tool}({text[:ARGS_SHOWN]}{' [...]' if len(text) > ARGS_SHOWN else ''})"
