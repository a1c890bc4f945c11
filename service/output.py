"""Capped capture of one output stream: head and tail kept, the middle elided and counted."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

log = logging.getLogger(__name__)

ELISION_MARK = "\n[... {n} bytes elided by ptc-sandbox ...]\n"


@dataclass(frozen=True)
class RenderedOutput:
    """One stream as the job view shows it.

    Attributes:
        text: the kept bytes decoded as UTF-8; invalid bytes become U+FFFD.
        truncated: whether bytes were elided (then ``text`` holds the marker
            ``ELISION_MARK`` between head and tail).
        total_bytes: every byte the script wrote to the stream.
        invalid_utf8: whether decoding replaced bytes that were not UTF-8.
    """

    text: str
    truncated: bool
    total_bytes: int
    invalid_utf8: bool


class CappedStream:
    """Accumulates a byte stream into at most ``cap`` bytes (thread-safe).

    The first ``cap // 2`` bytes are kept as the head; the last ``cap - cap // 2``
    bytes as the tail; everything in between is counted but dropped, so memory
    stays bounded whatever the script prints.
    """

    def __init__(self, cap: int) -> None:
        if cap < 2:
            raise ValueError("cap must be at least 2 bytes")
        self._head_cap = cap // 2
        self._tail_cap = cap - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        """Bytes written so far."""
        return self._total

    def write(self, data: bytes) -> None:
        """Append ``data`` (any size)."""
        with self._lock:
            self._total += len(data)
            room = self._head_cap - len(self._head)
            if room > 0:
                self._head += data[:room]
                data = data[room:]
            if not data:
                return
            if len(data) >= self._tail_cap:
                self._tail = bytearray(data[-self._tail_cap :])
            else:
                self._tail += data
                excess = len(self._tail) - self._tail_cap
                if excess > 0:
                    del self._tail[:excess]

    def render(self) -> RenderedOutput:
        """Decode what is kept; a multi-byte character cut at either edge of the gap is dropped, not flagged."""
        with self._lock:
            head, tail, total = bytes(self._head), bytes(self._tail), self._total
        elided = total - len(head) - len(tail)
        if elided == 0:
            text, invalid = _decode(head + tail)
            return RenderedOutput(text, False, total, invalid)
        head_cut = _incomplete_suffix(head)
        tail_cut = _continuation_prefix(tail)
        head_text, head_invalid = _decode(head[: len(head) - head_cut])
        tail_text, tail_invalid = _decode(tail[tail_cut:])
        mark = ELISION_MARK.format(n=elided + head_cut + tail_cut)
        return RenderedOutput(head_text + mark + tail_text, True, total, head_invalid or tail_invalid)


def _decode(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def _incomplete_suffix(data: bytes) -> int:
    """Length of a UTF-8 sequence cut short at the end of ``data`` (0..3)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte or ASCII
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return back if need > back else 0
    return 0


def _continuation_prefix(data: bytes) -> int:
    """Number of UTF-8 continuation bytes at the start of ``data`` (0..3)."""
    n = 0
    while n < min(3, len(data)) and data[n] & 0xC0 == 0x80:
        n += 1
    return n


class Budget(Protocol):
    """Bytes that may still be retained (``service.quotas.OutputBudget``)."""

    def take(self, wanted: int) -> int:
        """Of ``wanted`` bytes, how many may be retained."""
        ...


RESUME_SLICE_BYTES = 1024 * 1024  # the most bytes of a stream read at once to take it up again (``OutputLog.resume``)


class OutputLog:
    """One stream of a job: the inline ``CappedStream`` plus the retained bytes on disk.

    The first ``retain_bytes`` bytes go to ``path`` (unbuffered, so readers see
    them at once), as far as ``budget`` (the owner's, shared by all its jobs)
    grants them; later bytes are counted but not kept. The inline view gets
    every byte either way. Written by one writer (the job's output sink, on the
    event loop: ``ResidentSandbox`` hands it each output frame), read by any.
    The file is created at the first byte kept: a stream with none has no file,
    which every reader takes as nothing retained (a new file costs the file
    system far more than a write to an open one: docs/performance.md).
    A file that cannot be created is logged and the stream keeps no more bytes.

    Args:
        path: the file of retained bytes (created at the first byte kept).
        inline_bytes: cap of the inline view (head and tail).
        retain_bytes: how many bytes to keep on disk.
        budget: what the job's owner may still retain (``take(n)`` grants at most ``n``); None: no owner cap.
    """

    def __init__(self, path: Path, inline_bytes: int, retain_bytes: int, budget: Budget | None = None) -> None:
        self.path = path
        self.inline = CappedStream(inline_bytes)
        self._retain = retain_bytes
        self._budget = budget
        self.retained_bytes = 0
        self._file: BinaryIO | None = None
        self._closed = False
        self._skip = 0  # bytes still to drop: a resumed job's replay writing what its file holds already

    def resume(self) -> None:
        """Take up the stream an earlier run of the job began (a resumed durable job; blocking: call it on a worker
        thread): the bytes its file keeps are the stream so far (the inline view is made from them again), and as
        many of the next bytes written are dropped, being the same again (the replay's). Its bytes were counted
        against the owner's budget already (at start-up)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        with open(self.path, "rb") as kept:
            while chunk := kept.read(RESUME_SLICE_BYTES):
                self.inline.write(chunk)
        self._file = open(self.path, "ab", buffering=0)
        self.retained_bytes = self._skip = size

    def write(self, data: bytes) -> None:
        """Append one chunk."""
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = data[dropped:]
            if not data:
                return
        self.inline.write(data)
        room = self._retain - self.retained_bytes
        if room > 0 and not self._closed:
            if self._file is None and not self._create():
                return
            kept = data[:room]
            if self._budget is not None:
                kept = kept[: self._budget.take(len(kept))]
            if kept:
                assert self._file is not None
                self._file.write(kept)
                self.retained_bytes += len(kept)

    def _create(self) -> bool:
        """Create the file of retained bytes; False (logged, no more bytes kept) when the file system refuses."""
        try:
            self._file = open(self.path, "wb", buffering=0)
        except OSError as exc:
            log.warning("cannot keep the output in %s: %s", self.path, exc)
            self._closed = True
            return False
        return True

    def close(self) -> None:
        """No more writes (idempotent)."""
        self._closed = True
        if self._file is not None:
            self._file.close()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (no more bytes are kept)."""
        return self._closed


class OutputRange:
    """Retained bytes of a stream from one offset, read from one open file a slice at a time.

    ``open`` fixes ``length``, the exact count of bytes it will give: those retained at that moment
    from ``offset`` (at most the length asked). Retained files only grow (appended until the job ends,
    then left alone until purged), and the file stays open, so a purge meanwhile changes nothing: a
    reader gets the same bytes one ``read_range`` would have given at ``open``, without holding them
    all in memory. ``read`` and ``close`` block (run them in a thread); ``close`` waits for a ``read``
    under way in another thread.

    Attributes:
        offset: where the range starts (bytes).
        length: bytes the range holds (0 past the end, or without a file).
    """

    def __init__(self, fd: int | None, offset: int, length: int) -> None:
        self._fd = fd
        self.offset = offset
        self.length = length
        self._position = offset
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path, offset: int, length: int) -> OutputRange:
        """The range of up to ``length`` bytes from ``offset`` of the file at ``path`` (blocking)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no file (never retained, or purged)
            return cls(None, offset, 0)
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            return cls(None, offset, 0)
        return cls(fd, offset, max(0, min(length, size - offset)))

    @property
    def remaining(self) -> int:
        """Bytes of the range not read yet."""
        return self.offset + self.length - self._position

    def read(self, most: int) -> bytes:
        """The next at most ``most`` bytes of the range (b"" once all are read, or after ``close``).

        Raises:
            OSError: the file shrank under the range (retained files never do) or could not be read.
        """
        with self._lock:
            wanted = min(most, self.remaining)
            if self._fd is None or wanted <= 0:
                return b""
            data = os.pread(self._fd, wanted, self._position)
            if not data:
                raise OSError(f"retained output ended {self.remaining} bytes before its range")
            self._position += len(data)
            return data

    def close(self) -> None:
        """Release the file (idempotent; waits for a ``read`` under way)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class StoredRange(OutputRange):
    """An ``OutputRange`` over a blob of a shared job store (an ended job another replica ran): read a slice at a
    time with ``aread`` as the client takes it (``service.api.responses.output_slices``), never held whole, as the
    file of an ``OutputRange`` is never read whole.

    Args:
        reader: ``(offset, length) -> bytes`` of the blob (``JobBlobs.read`` of one job and name).
        offset / length: the range (``length`` already within the blob's size).
    """

    def __init__(self, reader: Callable[[int, int], Awaitable[bytes | None]], offset: int, length: int) -> None:
        super().__init__(None, offset, length)
        self._reader = reader

    async def aread(self, most: int) -> bytes:
        """The next at most ``most`` bytes of the range (b"" once all are read).

        Raises:
            OSError: the blob ended before the range (it was purged meanwhile).
            StoreUnavailable: the store did not answer.
        """
        wanted = min(most, self.remaining)
        if wanted <= 0:
            return b""
        data = await self._reader(self._position, wanted)
        if not data:
            raise OSError(f"stored output ended {self.remaining} bytes before its range")
        self._position += len(data)
        return data

    def read(self, most: int) -> bytes:
        """Not for a stored range: ``aread``."""
        raise NotImplementedError("a StoredRange is read with aread")


def read_range(path: Path, offset: int, length: int) -> bytes:
    """Up to ``length`` retained bytes of a stream from byte ``offset`` (b"" past the end or without a file)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    except (OSError, OverflowError, ValueError):  # no file, or an offset no file can have (past 2**63: ValueError)
        return b""


def decode_slice(data: bytes, final: bool) -> tuple[str, int, bool]:
    """Decode a slice of a stream read from some offset.

    Returns:
        (text, consumed, invalid_utf8): ``consumed`` excludes a multi-byte
        character cut short at the end, so the next read starts with it,
        unless ``final`` (nothing more will come), when it is decoded as U+FFFD.
    """
    cut = 0 if final else _incomplete_suffix(data)
    text, invalid = _decode(data[: len(data) - cut])
    return text, len(data) - cut, invalid
