"""Job views as JSON bytes: rendered without a Python tree of the call records, and the ended jobs' kept.

A job view (``schemas.job_models.JobView``) is rendered as three parts, always in this order::

    {<head: every other field, validated by JobView>,"pending_calls":[...],"calls":[<record>,<record>,...]}

Call records hold their ``args`` and ``result`` as ``orjson.Fragment`` (raw JSON, ``service.broker.records``), so a
record is encoded by copying bytes, and a view of a running job is rendered a batch of records at a time
(``stream``), giving the event loop back between batches: no request holds more than about
``BATCH_BYTES`` of it at once, whatever the job's size.

An ended job's view is encoded once (``encode``) into an ``EncodedView``: the bytes served and stored, the
head as a dict, and where each record lies in the bytes. ``ViewCache`` keeps the latest ones up to a byte cap;
a view read back from the store is indexed by ``scan``, one record at a time (never the whole tree at once).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from service import exactjson
from service.errors import InvalidField
from service.schemas.job_models import JobView

BATCH_BYTES = 1024 * 1024
"""Bytes rendered between two returns to the event loop, and the size of the slices a body is sent in."""
OPTIONS = orjson.OPT_UTC_Z  # datetimes as pydantic writes them: ...Z
_TAIL_FIELDS = ("pending_calls", "calls")
_VALUE_FIELDS = ("args", "result")  # a record's fields that hold what a script, tool or client sent

CallsMode = Literal["full", "summary", "none"]
"""How a view shows its call records: ``full`` (every field), ``summary`` (``SUMMARY_FIELDS``), ``none``."""
SUMMARY_FIELDS = ("seq", "call_id", "tool", "status", "error", "duration_ms", "approval")
SUMMARY_MESSAGE_CHARS = 200  # a summary's error.message at most (a full record's: 2,000)
"""A call record's fields kept by ``calls=summary``: no arguments, no result, nothing about their bytes (``approval``:
who decided a gated call, when, and the reason given)."""
VIEW_FIELDS: tuple[str, ...] = tuple(JobView.model_fields)
"""The view's top-level fields, the names ``fields=`` may select (in the order a view writes them)."""
ALWAYS_SELECTED = frozenset({"job_id", "status"})
"""The fields every selection includes."""


@dataclass(frozen=True)
class Selection:
    """Which parts of a job view to send (``?calls=`` and ``?fields=``).

    Attributes:
        calls: how call records are shown.
        fields: the top-level fields to include (always with ``ALWAYS_SELECTED``); None: all of them.
    """

    calls: CallsMode = "full"
    fields: frozenset[str] | None = None

    @property
    def full(self) -> bool:
        """The whole view, as it is stored (today's view, byte for byte)."""
        return self.calls == "full" and self.fields is None

    def wants(self, name: str) -> bool:
        """Whether the top-level field ``name`` is sent."""
        return self.fields is None or name in self.fields

    @property
    def records(self) -> CallsMode:
        """How the ``calls`` field is sent: ``none`` when ``fields`` leaves it out."""
        return self.calls if self.wants("calls") else "none"


FULL = Selection()


def select(calls: CallsMode = "full", fields: str | None = None) -> Selection:
    """The selection of ``?calls=`` and ``?fields=`` (comma-separated top-level field names; empty names are
    ignored, ``job_id`` and ``status`` are always included).

    Raises:
        InvalidField: ``fields`` names a field the view does not have (the message lists the allowed ones).
    """
    if fields is None:
        return Selection(calls)
    names = {name.strip() for name in fields.split(",")} - {""}
    unknown = sorted(names - set(VIEW_FIELDS))
    if unknown:
        shown = ", ".join(name[:64] for name in unknown[:5])
        raise InvalidField(f"unknown field(s) {shown}; allowed: {', '.join(VIEW_FIELDS)}", ("query", "fields"))
    return Selection(calls, frozenset(names | ALWAYS_SELECTED))


def render_head(view: dict[str, Any], selection: Selection = FULL) -> bytes:
    """The view without ``pending_calls`` and ``calls``, as a JSON object (validated by ``JobView``); with
    ``selection.fields``, only those fields.

    Raises:
        ValueError: a field does not fit the ``JobView`` schema (pydantic's ValidationError).
    """
    fields = {name: value for name, value in view.items() if name not in _TAIL_FIELDS}
    model = JobView.model_validate({**fields, "calls": []})
    if selection.fields is not None:
        return model.model_dump_json(include=set(selection.fields - set(_TAIL_FIELDS))).encode()
    return model.model_dump_json(exclude=set(_TAIL_FIELDS)).encode()


def summary_record(record: dict[str, Any]) -> bytes:
    """A call record's summary (``SUMMARY_FIELDS``) as JSON: no arguments or result, nor their sizes. Its
    ``error.message`` is cut to ``SUMMARY_MESSAGE_CHARS`` characters (then ending in "…"): a refusal's message
    may quote the argument it refused (up to 2,000 characters in the full record)."""
    summary = {name: record.get(name) for name in SUMMARY_FIELDS}
    error = summary["error"]
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str) and len(message) > SUMMARY_MESSAGE_CHARS:
            summary["error"] = {**error, "message": message[:SUMMARY_MESSAGE_CHARS] + "…"}
    return orjson.dumps(summary, option=OPTIONS)


def encode_record(record: dict[str, Any]) -> bytes:
    """One call record as JSON (its args and result fragments copied as they are).

    A record decoded from a stored view (a job marked lost) holds its args and result as values, which may be
    integers past 64 bits: those are written exactly (``service.exactjson``).
    """
    try:
        return orjson.dumps(record, option=OPTIONS)
    except orjson.JSONEncodeError:
        exact = {
            key: orjson.Fragment(exactjson.dumps(value)) if key in _VALUE_FIELDS and value is not None else value
            for key, value in record.items()
        }
        return orjson.dumps(exact, option=OPTIONS)


def unencodable(view: dict[str, Any]) -> dict[str, Any]:
    """The fields that replace a view's output and calls when it cannot be encoded (the broker and the output
    logs keep it from happening), so that it still says nothing its totals contradict: no text and
    ``*_truncated`` (its bytes stay readable by offset), no records and ``calls_total`` 0, and an error."""
    return {
        "stdout": "",
        "stderr": "",
        "stdout_truncated": view["stdout_bytes"] > 0,
        "stderr_truncated": view["stderr_bytes"] > 0,
        "calls": [],
        "calls_total": 0,
        "calls_by_status": {},
        "error": {"type": "internal_error", "message": "the job's output or calls could not be encoded"},
    }


def snapshot(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as they are now: ended records never change again, pending ones are copied."""
    return [record if record["status"] != "pending" else dict(record) for record in records]


def _parts(
    head: bytes,
    pending: list[dict[str, Any]] | None,
    records: Iterable[dict[str, Any] | bytes | memoryview] | None,
) -> Iterator[bytes | memoryview]:
    """The view's pieces: ``head`` (a JSON object), then ``pending_calls`` and ``calls`` unless None."""
    start = head[:-1]
    if pending is not None:
        start += b',"pending_calls":' + orjson.dumps(pending, option=OPTIONS)
    if records is None:
        yield start + b"}"
        return
    yield start + b',"calls":['
    first = True
    for record in records:
        if not first:
            yield b","
        first = False
        yield record if isinstance(record, bytes | memoryview) else encode_record(record)
    yield b"]}"


def join(
    head: bytes,
    pending: list[dict[str, Any]] | None,
    records: Iterable[dict[str, Any] | bytes | memoryview] | None,
) -> bytes:
    """The view's bytes at once (for small views: summaries, or no records)."""
    return b"".join(_parts(head, pending, records))


async def stream(
    head: bytes,
    pending: list[dict[str, Any]] | None,
    records: Iterable[dict[str, Any] | bytes | memoryview] | None,
) -> AsyncIterator[bytes]:
    """The view's bytes in pieces of about ``BATCH_BYTES``, yielding to the event loop between them.

    ``records`` must not change while this runs (``snapshot``, or an ``EncodedView``'s). ``pending`` or
    ``records`` None: that field is left out.
    """
    batch: list[bytes | memoryview] = []
    size = 0
    for part in _parts(head, pending, records):
        batch.append(part)
        size += len(part)
        if size >= BATCH_BYTES:
            yield b"".join(batch)
            batch, size = [], 0
            await asyncio.sleep(0)
    if batch:
        yield b"".join(batch)


_TAIL = b',"pending_calls":[],"calls":['  # what follows the head in an ended view written by ``encode``


@dataclass
class EncodedView:
    """An ended job's view, encoded once.

    Attributes:
        head: the view's fields but ``pending_calls`` and ``calls``, as JSON values.
        body: the whole view as JSON bytes (what is served and stored).
        spans: (start, end) of each call record in ``body``, in order.
        summaries: each call record's ``summary_record``, in order (kept beside ``body`` so that a
            ``calls=summary`` view never decodes a record); None until made (``JobViews`` makes them once).
        head_end: where the head's fields end in ``body`` (``_TAIL`` follows), when ``body`` has that layout
            (every view ``encode`` wrote); None: render the head again.
    """

    head: dict[str, Any]
    body: bytes
    spans: list[tuple[int, int]]
    summaries: list[bytes] | None = None
    head_end: int | None = None

    def records(self) -> Iterator[memoryview]:
        """Each call record's JSON, in order (views into ``body``)."""
        view = memoryview(self.body)
        return (view[start:end] for start, end in self.spans)

    @property
    def size(self) -> int:
        """Bytes held: the body and the summaries."""
        return len(self.body) + sum(map(len, self.summaries or ()))

    def head_bytes(self) -> bytes | None:
        """The head as a JSON object, cut from ``body`` (None when ``head_end`` is unknown)."""
        return None if self.head_end is None else self.body[: self.head_end] + b"}"


def head_end(body: bytes, spans: list[tuple[int, int]]) -> int | None:
    """Where the head's fields end in a stored view whose last fields are ``"pending_calls":[]`` and then
    ``"calls"`` (as ``encode`` writes them), from the record spans ``scan`` found; None for another layout."""
    if spans:
        at = spans[0][0] - len(_TAIL)
        return at if at > 0 and body[at : spans[0][0]] == _TAIL else None
    at = len(body) - len(_TAIL) - 2
    return at if at > 0 and body[at:] == _TAIL + b"]}" else None


async def encode(
    head: bytes,
    records: Iterable[dict[str, Any] | bytes | memoryview],
    summaries: list[bytes] | None = None,
    pending: list[dict[str, Any]] | None = None,
) -> EncodedView:
    """Encode a job's view as it is stored, giving the event loop back every ``BATCH_BYTES``; ``pending``: its
    ``pending_calls`` (only a parked job's are stored: ``service.jobs.parking``; else none).

    The records' summaries are made as they are encoded when all are dicts (else ``summaries``, the same
    records' summaries when the caller has them, or None).
    """
    parts: list[bytes | memoryview] = []
    spans: list[tuple[int, int]] = []
    made: list[bytes] | None = [] if summaries is None else None
    offset = since_yield = 0

    def summarized() -> Iterator[dict[str, Any] | bytes | memoryview]:
        nonlocal made
        for record in records:
            if made is not None:
                if isinstance(record, dict):
                    made.append(summary_record(record))
                else:
                    made = None
            yield record

    for i, part in enumerate(_parts(head, pending or [], summarized())):
        if i >= 1 and part != b"," and part != b"]}":
            spans.append((offset, offset + len(part)))
        parts.append(part)
        offset += len(part)
        since_yield += len(part)
        if since_yield >= BATCH_BYTES:
            since_yield = 0
            await asyncio.sleep(0)
    body = b"".join(parts)
    return EncodedView(exactjson.loads(head), body, spans, summaries if made is None else made, len(head) - 1)


def scan(body: bytes, summaries: list[bytes] | None = None) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The head and the record spans of a stored view (any key order), decoding one record at a time.

    For views read back from the store. Each record is decoded to find where it ends (stdlib ``json``, whose
    ``raw_decode`` reports the end), so memory holds one record's tree at a time, not the view's; with
    ``summaries`` (a list), each record's ``summary_record`` is appended to it on the way. Run it on a
    worker thread: the GIL is let go between records.

    Raises:
        ValueError: ``body`` is not a JSON object.
    """
    text = body.decode()
    decoder = json.JSONDecoder()
    head: dict[str, Any] = {}
    marks: list[int] = []  # start, end of each record, in characters of text
    i = _skip(text, 0)
    if text[i] != "{":
        raise ValueError("a view is a JSON object")
    i = _skip(text, i + 1)
    while text[i] != "}":
        key, i = decoder.raw_decode(text, i)
        i = _skip(text, i)
        if text[i] != ":":
            raise ValueError("expected ':'")
        i = _skip(text, i + 1)
        if key == "calls":
            i = _skip(text, i + 1)  # past '['
            while text[i] != "]":
                record, end = decoder.raw_decode(text, i)
                if summaries is not None:
                    summaries.append(summary_record(record))
                marks += (i, end)
                i = _skip(text, end)
                if text[i] == ",":
                    i = _skip(text, i + 1)
            i += 1
        else:
            head[key], i = decoder.raw_decode(text, i)
        i = _skip(text, i)
        if text[i] == ",":
            i = _skip(text, i + 1)
    if not head.get("pending_calls"):  # kept only for a parked job's (``JobViews`` serves them from the head)
        head.pop("pending_calls", None)
    if len(text) == len(body):  # ASCII: characters are bytes
        offsets = marks
    else:
        offsets, chars, at = [], 0, 0
        for mark in marks:
            at += len(text[chars:mark].encode())
            chars = mark
            offsets.append(at)
    return head, list(zip(offsets[::2], offsets[1::2], strict=True))


def _skip(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i


class ViewCache:
    """The encoded views of recently ended jobs, least recently used dropped first past ``max_bytes``.

    Args:
        max_bytes: bytes of bodies kept (a view larger than this is not kept).
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._size = 0
        self._views: OrderedDict[str, tuple[EncodedView, int]] = OrderedDict()  # the view, its size when put

    def get(self, job_id: str) -> EncodedView | None:
        kept = self._views.get(job_id)
        if kept is None:
            return None
        self._views.move_to_end(job_id)
        return kept[0]

    def put(self, job_id: str, view: EncodedView) -> None:
        self.drop(job_id)
        size = view.size
        if size > self._max:
            return
        self._views[job_id] = (view, size)
        self._size += size
        while self._size > self._max:
            _, (_, old) = self._views.popitem(last=False)
            self._size -= old

    def drop(self, job_id: str) -> None:
        old = self._views.pop(job_id, None)
        if old is not None:
            self._size -= old[1]


Body = bytes | AsyncIterator[bytes]
"""A view to send: whole bytes (an ended job's, shared), or pieces rendered as they are sent (``stream``)."""
