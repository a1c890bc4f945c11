"""Where a follower of a job's event stream is: the ``id`` of each server-sent event, and resuming after it.

A ``Position`` holds what the stream has sent so far: the offset after the last ``stdout`` and ``stderr`` piece
(output is resumed by offset), which call records have been sent as ``call`` events (by ``seq``: calls end out of
order, so a prefix ``low`` of seqs all sent and the set of later ones sent), the last ``status`` sent, and whether
``end`` was sent. Each event's ``id`` is the position after it, as an opaque token; a follower that reconnects
with it (``Last-Event-ID``) gets exactly the events it has not had: no output byte twice or never, each call once,
a status only if it changed since. A resumed durable job's replay may make concurrent calls in another order than
its first run: a stream that follows the job through the resume knows each record by its ``call_id``
(``record_call_id``) and sends it once; a follower that reconnects after such a resume with an earlier token may
miss a record that changed places.

The token (URL-safe base64, no padding) is opaque to clients; inside, version 1::

    0x01, tag (4 bytes: SHA-256 of the job id), flags (bit 0: end sent), status (1 byte of length, then ASCII),
    stdout offset, stderr offset, low (LEB128 varints), bitmap of seqs low+1, low+2, ... sent (bit i of byte k:
    seq low + 1 + 8k + i)

It is not secret nor signed: it says only how far the caller's own stream of the caller's own job went, which
the caller could choose anyway. ``parse`` refuses anything malformed, a token of another job (its tag), and
``Position.check`` one that claims more than the job has (an offset past the retained bytes, a seq past the
records): 422 each, never another job's data.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, field
from typing import Any

from service import exactjson
from service.jobs.model import JobStatus

VERSION = 1
MAX_TOKEN_CHARS = 16 * 1024  # longer than any token of a job within PTC_MAX_TOOL_CALLS' bound (10,000: ~1.7 KiB)
_STATUSES = frozenset(status.value for status in JobStatus)
_MAX_VARINT_BYTES = 10


CALL_ID_WITHIN = 128  # bytes of a stored record that hold its seq and call_id (a call id is 21 characters)


class InvalidPosition(ValueError):
    """An event id that is not one of this job's stream (malformed, forged, or another job's)."""


def _tag(job_id: str) -> bytes:
    return hashlib.sha256(job_id.encode()).digest()[:4]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@dataclass
class Position:
    """How far a job's event stream has gone (see the module docstring).

    Attributes:
        stdout, stderr: byte offset after the last piece of that stream sent.
        status: the last status sent (None: none yet).
        low: seqs 1..low have all been sent as ``call`` events.
        after: seqs past ``low`` sent too (calls that ended before an earlier one).
        ended: ``end`` was sent.

    ``after`` is also kept as an integer bitmap (bit i: seq ``low + 1 + i``), so that the id of each event costs
    a copy of that bitmap, not a pass over ``after`` in Python: a stream of calls that end out of order (up to
    ``PTC_MAX_TOOL_CALLS`` of them after one that stays pending) makes one id per call.
    """

    stdout: int = 0
    stderr: int = 0
    status: str | None = None
    low: int = 0
    after: set[int] = field(default_factory=set)
    ended: bool = False
    _bits: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        for seq in list(self.after):
            self.after.discard(seq)
            self.mark(seq)

    def sent(self, seq: int) -> bool:
        """Whether the call with this seq (1-based) was sent."""
        return seq <= self.low or seq in self.after

    def mark(self, seq: int) -> None:
        """Count the call with this seq as sent (each seq leaves ``after`` at most once: amortized O(1))."""
        if self.sent(seq):
            return
        self.after.add(seq)
        self._bits |= 1 << (seq - self.low - 1)
        if seq == self.low + 1:
            self._advance()

    def _advance(self) -> None:
        """Move ``low`` past the seqs right after it that were sent (the bitmap's trailing ones)."""
        run = (~self._bits & (self._bits + 1)).bit_length() - 1
        self.after.difference_update(range(self.low + 1, self.low + run + 1))
        self.low += run
        self._bits >>= run

    def token(self, job_id: str) -> str:
        """This position as an event id of ``job_id``'s stream."""
        status = (self.status or "").encode()
        bitmap = self._bits.to_bytes((self._bits.bit_length() + 7) // 8, "little")
        raw = b"".join(
            [
                bytes([VERSION]),
                _tag(job_id),
                bytes([1 if self.ended else 0, len(status)]),
                status,
                _varint(self.stdout),
                _varint(self.stderr),
                _varint(self.low),
                bitmap,
            ]
        )
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    def check(self, records: int, retained: dict[str, int], clamp: bool = False) -> None:
        """Refuse a position past what the job has: ``records`` call records, ``retained`` bytes per stream; with
        ``clamp`` (a ``lost`` job, kept as of its last progress save: a follower may have seen more of it while it
        ran) move such a position back to what the job has instead.

        Raises:
            InvalidPosition: an offset past the stream's retained bytes, or a seq past the records (not ``clamp``).
        """
        if clamp:
            self.stdout, self.stderr = min(self.stdout, retained["stdout"]), min(self.stderr, retained["stderr"])
            self._clamp(records)
            return
        for stream, offset in (("stdout", self.stdout), ("stderr", self.stderr)):
            if offset > retained[stream]:
                raise InvalidPosition(f"its {stream} offset is past the job's output")
        if self.low + self._bits.bit_length() > records:
            raise InvalidPosition("it counts more tool calls than the job has")

    def _clamp(self, records: int) -> None:
        """Forget the seqs past ``records``."""
        self.low = min(self.low, records)
        self._bits &= (1 << (records - self.low)) - 1
        self.after = {seq for seq in self.after if self.low < seq <= records}


def parse(text: str, job_id: str, records: int | None = None, clamp: bool = False) -> Position:
    """The position an event id of ``job_id``'s stream stands for.

    Args:
        records: the job's call records: an id whose bitmap counts more is refused before it is expanded (a
            forged id of ``MAX_TOKEN_CHARS`` would otherwise mark ~96,000 seqs one by one).
        clamp: with ``records``, forget the seqs past them instead of refusing (a ``lost`` job: ``Position.check``).

    Raises:
        InvalidPosition: not a token of this service's format, or of another job's stream, or (with ``records``)
            one that counts more calls than that.
    """
    if len(text) > MAX_TOKEN_CHARS:
        raise InvalidPosition("too long")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InvalidPosition("not an event id of this service") from None
    reader = _Reader(raw)
    if reader.byte() != VERSION:
        raise InvalidPosition("not an event id of this service")
    if reader.take(4) != _tag(job_id):
        raise InvalidPosition("it is an event id of another job's stream")
    flags = reader.byte()
    if flags not in (0, 1):
        raise InvalidPosition("not an event id of this service")
    status_bytes = reader.take(reader.byte())
    try:
        status = status_bytes.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidPosition("not an event id of this service") from None
    if status and status not in _STATUSES:
        raise InvalidPosition("not an event id of this service")
    position = Position(reader.varint(), reader.varint(), status or None, ended=flags == 1)
    low = reader.varint()
    bits = int.from_bytes(reader.rest(), "little")
    if records is not None and low + bits.bit_length() > records:
        if not clamp:
            raise InvalidPosition("it counts more tool calls than the job has")
        low = min(low, records)
        bits &= (1 << (records - low)) - 1
    position.low, position._bits = low, bits
    for k, byte in enumerate(bits.to_bytes((bits.bit_length() + 7) // 8, "little")):
        if byte:
            position.after.update(low + 1 + 8 * k + i for i in range(8) if byte >> i & 1)
    position._advance()
    return position


class _Reader:
    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._at = 0

    def take(self, n: int) -> bytes:
        if self._at + n > len(self._raw):
            raise InvalidPosition("not an event id of this service")
        chunk = self._raw[self._at : self._at + n]
        self._at += n
        return chunk

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value = shift = 0
        for _ in range(_MAX_VARINT_BYTES):
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        raise InvalidPosition("not an event id of this service")

    def rest(self) -> bytes:
        chunk = self._raw[self._at :]
        self._at = len(self._raw)
        return chunk


def record_status(record: dict[str, Any] | bytes | memoryview) -> str | None:
    """A call record's ``status`` (a stored view's record is its JSON bytes)."""
    if isinstance(record, dict):
        return str(record["status"])
    return str(exactjson.loads(bytes(record)).get("status"))


def record_call_id(record: dict[str, Any] | bytes | memoryview) -> str:
    """A call record's ``call_id`` (a stored view's record is its JSON bytes: ``seq``, then ``call_id``, first)."""
    if isinstance(record, dict):
        return str(record["call_id"])
    head = bytes(record[:CALL_ID_WITHIN])
    found = head.find(b'"call_id":"')
    if found < 0:  # another key order: parsed whole
        return str(exactjson.loads(bytes(record))["call_id"])
    start = found + len(b'"call_id":"')
    return head[start : head.index(b'"', start)].decode()
