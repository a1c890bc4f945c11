"""Job views as JSON bytes: rendered without a Python tree of the call records, and the ended jobs' kept.

A job view (``schemas.JobView``) is rendered as three parts, always in this order::

    {<head: every other field, validated by JobView>,"pending_calls":[...],"calls":[<record>,<record>,...]}

Call records hold their ``args`` and ``result`` as ``orjson.Fragment`` (raw JSON, ``service.broker``), so a
record is encoded by copying bytes, and a view of a running job is rendered a batch of records at a time
(``stream``), giving the event loop back between batches: no request holds more than about
``BATCH_BYTES`` of it at once, whatever the job's size.

An ended job's view is encoded once (``encode``) into an ``EncodedView``: the bytes served and stored, the
head as a dict, and where each record lies in the bytes. ``ViewCache`` keeps the latest ones up to a byte cap;
a view read back from the store is indexed by ``scan``, one record at a time (never the whole tree at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from service import exactjson
from service.schemas import JobView

BATCH_BYTES = 1024 * 1024
"""Bytes rendered between two returns to the event loop, and the size of the slices a body is sent in."""
OPTIONS = orjson.OPT_UTC_Z  # datetimes as pydantic writes them: ...Z
_TAIL_FIELDS = ("pending_calls", "calls")
_VALUE_FIELDS = ("args", "result")  # a record's fields that hold what a script, tool or client sent


def render_head(view: dict[str, Any]) -> bytes:
    """The view without ``pending_calls`` and ``calls``, as a JSON object (validated by ``JobView``).

    Raises:
        ValueError: a field does not fit the ``JobView`` schema (pydantic's ValidationError).
    """
    fields = {name: value for name, value in view.items() if name not in _TAIL_FIELDS}
    model = JobView.model_validate({**fields, "calls": []})
    return model.model_dump_json(exclude=set(_TAIL_FIELDS)).encode()


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
    head: bytes, pending: list[dict[str, Any]], records: Iterable[dict[str, Any] | bytes | memoryview]
) -> Iterator[bytes | memoryview]:
    yield head[:-1] + b',"pending_calls":' + orjson.dumps(pending, option=OPTIONS) + b',"calls":['
    first = True
    for record in records:
        if not first:
            yield b","
        first = False
        yield record if isinstance(record, bytes | memoryview) else encode_record(record)
    yield b"]}"


async def stream(
    head: bytes, pending: list[dict[str, Any]], records: Iterable[dict[str, Any] | bytes | memoryview]
) -> AsyncIterator[bytes]:
    """The view's bytes in pieces of about ``BATCH_BYTES``, yielding to the event loop between them.

    ``records`` must not change while this runs (``snapshot``, or an ``EncodedView``'s).
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


@dataclass(frozen=True)
class EncodedView:
    """An ended job's view, encoded once.

    Attributes:
        head: the view's fields but ``pending_calls`` and ``calls``, as JSON values.
        body: the whole view as JSON bytes (what is served and stored).
        spans: (start, end) of each call record in ``body``, in order.
    """

    head: dict[str, Any]
    body: bytes
    spans: list[tuple[int, int]]

    def records(self) -> Iterator[memoryview]:
        """Each call record's JSON, in order (views into ``body``)."""
        view = memoryview(self.body)
        return (view[start:end] for start, end in self.spans)


async def encode(head: bytes, records: Iterable[dict[str, Any] | bytes | memoryview]) -> EncodedView:
    """Encode an ended job's view (no pending calls), giving the event loop back every ``BATCH_BYTES``."""
    parts: list[bytes | memoryview] = []
    spans: list[tuple[int, int]] = []
    offset = since_yield = 0
    for i, part in enumerate(_parts(head, [], records)):
        if i >= 1 and part != b"," and part != b"]}":
            spans.append((offset, offset + len(part)))
        parts.append(part)
        offset += len(part)
        since_yield += len(part)
        if since_yield >= BATCH_BYTES:
            since_yield = 0
            await asyncio.sleep(0)
    body = b"".join(parts)
    return EncodedView(exactjson.loads(head), body, spans)


def scan(body: bytes) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The head and the record spans of a stored view (any key order), decoding one record at a time.

    For views read back from the store. Each record is decoded to find where it ends (stdlib ``json``, whose
    ``raw_decode`` reports the end), so memory holds one record's tree at a time, not the view's. Run it on a
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
                _, end = decoder.raw_decode(text, i)
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
        self._views: OrderedDict[str, EncodedView] = OrderedDict()

    def get(self, job_id: str) -> EncodedView | None:
        view = self._views.get(job_id)
        if view is not None:
            self._views.move_to_end(job_id)
        return view

    def put(self, job_id: str, view: EncodedView) -> None:
        self.drop(job_id)
        if len(view.body) > self._max:
            return
        self._views[job_id] = view
        self._size += len(view.body)
        while self._size > self._max:
            _, old = self._views.popitem(last=False)
            self._size -= len(old.body)

    def drop(self, job_id: str) -> None:
        old = self._views.pop(job_id, None)
        if old is not None:
            self._size -= len(old.body)


class ByteBudget:
    """At most ``max_bytes`` held at once by the holders of ``hold`` (one holder alone may hold more).

    Bounds the memory of view bodies that must be copied whole to be sent (an events stream's ``end``).
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._held = 0
        self._freed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        """Wait until ``size`` bytes fit (or nothing is held), hold them for the block."""
        while self._held and self._held + size > self._max:
            self._freed.clear()
            await self._freed.wait()
        self._held += size
        try:
            yield
        finally:
            self._held -= size
            self._freed.set()


Body = bytes | AsyncIterator[bytes]
"""A view to send: whole bytes (an ended job's, shared), or pieces rendered as they are sent (``stream``)."""
