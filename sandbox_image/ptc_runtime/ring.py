"""A script's ``sys.stdout`` and ``sys.stderr`` in a session's child: a ring in memory shared with the runtime.

Why: a printed line must survive any end of the script (a kill, the OOM killer, ``os._exit``) and show in the
job view within a fraction of a second, which a private buffer in the script's process cannot give; writing
each line to the pipe at once (``ptc_runtime.stdio.live``) gives both but costs one ``write`` system call per
line (~1 us under runc, ~20 us under gVisor, whose system calls are that slow). Here each write is a copy
into memory that the resident interpreter (``ptc_runtime.session``, the script's parent, which outlives it)
maps too: it survives the script's process whatever ends it, without a system call per line.

The text streams are line-buffered over the ring (``io.TextIOWrapper(line_buffering=True)``, with the
encoding and error handler Python gave them): each complete line, and whatever a ``flush()`` finds, is one write
into the ring, so a kill never leaves half of a ``print`` (its text without its newline) and a print costs one
copy. A line without its newline waits in the stream until the next newline, a flush or the script's exit, as
at a terminal (and as with ``ptc_runtime.stdio.live``): the only bytes of the script's output not yet in shared
memory. What is written to ``sys.stdout.buffer`` goes into the ring at once.

Layout: one ring per stream (``STDOUT_RING_BYTES``, ``STDERR_RING_BYTES``), an anonymous ``MAP_SHARED``
mapping made by the server before the fork: a header of ``HEADER_BYTES`` (unsigned 64-bit words, native
order) followed by the data area of ``size`` bytes (a power of two). Words:

- ``HEAD``: bytes the child has written into the ring since the run started (it only grows); byte ``i`` is
  at data offset ``i % size``. The child copies the bytes first and publishes ``HEAD`` after.
- ``TAIL``: bytes the server has taken (only grows, at most ``HEAD``); published by the server, read by the
  child to know the free space (``size - (HEAD - TAIL)``).
- ``ASLEEP``: set to 1 by the server before it sleeps longer than a rest (``ptc_runtime.session.IDLE_S``); a child
  write that finds it set clears it and nudges the server (one byte on the nudge pipe: the only system call
  of a write, once per sleep).
- ``WAITING``: set to 1 by the child before it waits for the server (a full ring, or ``sync``); the server,
  after each pass over the rings, clears it and writes one byte to the ack pipe.

Two pipes go with the rings: nudge (child -> server, non-blocking, a full pipe already means "wake up") and
ack (server -> child, which waits for it, ``ACK_WAIT_MS`` at most before it nudges again). A full ring makes the
writer wait for the ack (back-pressure, as a full pipe does), never spin.

Wake-ups: the server (``ptc_runtime.session``) watches the nudge pipe always. While output flows it takes
what is in the rings every ``REST_S``; when a pass finds nothing it sets ``ASLEEP``, checks the rings once
more, and sleeps up to ``IDLE_S``. Python has no memory fence, so the child's check of ``ASLEEP`` may miss
the server's setting it in the same instant (x86 may reorder a store before a later load); ``IDLE_S`` bounds
the delay of that rare miss. Waiting for an ack never depends on that: the child sets ``WAITING`` before
its nudge (a system call), and the server reads ``WAITING`` after reading the nudge. Data bytes are
written before ``HEAD`` and read after it, which x86-64's store order (TSO) keeps; aligned 8-byte words are
read and written whole. (On a weakly ordered CPU, aarch64, bytes taken while the script runs could be read
before they are visible: the image targets x86-64.)

The child is not trusted: the script may scribble on the mapping at will. The server keeps its own ``TAIL``,
reads ``HEAD`` once per pass and treats a ``HEAD - TAIL`` outside ``[0, size]`` as the end of that ring's
output; every read is inside its own mapping (which the child cannot resize), so the worst a script can do
is garble or drop its own output (or, having ended its ring, wait for room there until its time limit,
nudging the server at each ack). The child trusts nothing the server cannot be made to write either: the
free space it computes is clamped, and every copy is bounded by the data area.

Order with output written to the pipes (fds 1 and 2) by anything else: a subprocess, an ``os.write``, a
program after ``exec``, a forked process. The server reads a stream's pipe before it takes that stream's
ring up to the ``HEAD`` it read before the pipe; the child empties its rings (``sync``: waits until the
server has taken everything) before anything that lets another writer write to its fds: ``os.fork`` (and
what forks: ``multiprocessing``, ``os.spawn*``, ``pty.fork``), ``subprocess`` (``_posixsubprocess.fork_exec``,
``os.posix_spawn``/``posix_spawnp``), ``os.system``, ``os.execv``/``execve`` (every ``os.exec*``),
``os.write``/``os.writev`` to fd 1 or 2 and ``os.dup2`` onto them. So ``print(a); subprocess.run(...); print(b);
os.write(1, c)`` arrives as a, the subprocess's output, b, c. Not ordered: output of processes running at the
same time as the script prints (as with any two writers of one pipe), and writes to fds 1 and 2 that bypass
the ``os`` functions above: a file object on fd 1 or 2 (``open(1, "w")``, ``os.fdopen(1)``, ``io.FileIO(1)``,
``open("/dev/stdout", "w")``: its writes are the C ``write``), a C extension's ``printf``/``write(1, ...)``,
``os.sendfile``, a ``dup`` of fd 1, a ``faulthandler`` traceback; those may come before what the ring held when
they were written (a pass takes the pipe before the ring), and at the end of the run before what it still held.
A line without its newline still waiting in the text stream is not emptied by ``sync`` (as at any pipe: it comes
when done).

A forked process (``os.fork``: multiprocessing's workers) does not share the ring: in it both streams go back
to writing each line to the pipe (line-buffered, as ``ptc_runtime.stdio.live``). While ``os.dup2`` has made
fd 1 (or 2) something else than the run's pipe (a script silencing a library), the stream writes to that fd
directly, as it would without the ring.
"""

from __future__ import annotations

import _thread
import io
import mmap
import os
import select
import sys
from typing import Any, Callable, List, Optional, Tuple

HEADER_BYTES = 64
HEAD, TAIL, ASLEEP, WAITING = 0, 1, 2, 3  # word indexes in the header
STDOUT_RING_BYTES = 1024 * 1024  # 100,000 print(i) (590 KB, bench.output_heavy) fit without a wait
STDERR_RING_BYTES = 256 * 1024
ACK_READ_BYTES = 64
ACK_WAIT_MS = 100  # the longest wait for an ack before the child flags WAITING and nudges again


class Ring:
    """One stream's shared mapping (either side): ``HEADER_BYTES`` of header words, then ``size`` bytes."""

    def __init__(self, size: int) -> None:
        if size <= 0 or size & (size - 1):
            raise ValueError("a ring's size is a power of two")
        self.size = size
        self.map = mmap.mmap(-1, HEADER_BYTES + size)  # anonymous, MAP_SHARED: the forked child writes the same pages
        self.header = memoryview(self.map)[:HEADER_BYTES].cast("Q")

    def close(self) -> None:
        self.header.release()
        self.map.close()


class RingReader:
    """The server's side of a ring: its own ``TAIL``, which it publishes; the child's ``HEAD`` checked."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.tail = 0
        self.ended = False  # the child's header made no sense: nothing more is taken from this ring

    def head(self) -> Optional[int]:
        """The child's ``HEAD`` now, or None when the ring is ended (a ``HEAD - TAIL`` outside [0, size] ends it)."""
        if self.ended:
            return None
        head: int = self.ring.header[HEAD]
        if not 0 <= head - self.tail <= self.ring.size:
            self.ended = True
            return None
        return head

    def take(self, head: int, limit: int) -> bytes:
        """Up to ``limit`` bytes from ``TAIL`` towards ``head`` (a value ``head()`` gave), at most to the end of
        the data area; ``TAIL`` moves past them and is published. Empty when ``TAIL`` is at ``head``."""
        ring = self.ring
        start = self.tail % ring.size
        n = min(head - self.tail, limit, ring.size - start)
        if n <= 0:
            return b""
        data = ring.map[HEADER_BYTES + start : HEADER_BYTES + start + n]
        self.tail += n
        ring.header[TAIL] = self.tail
        return data

    def pending(self) -> bool:
        """Whether the child has written what the server has not taken."""
        head = self.head()
        return head is not None and head != self.tail

    def sleep(self) -> None:
        """Ask the child to nudge on its next write (``ASLEEP``)."""
        self.ring.header[ASLEEP] = 1

    def waited(self) -> bool:
        """Whether the child waits for an ack (``WAITING``, which is cleared)."""
        if self.ring.header[WAITING]:
            self.ring.header[WAITING] = 0
            return True
        return False


class _Guard:
    """One ring writer's lock (writes from several threads, and ``sync``) and ``busy`` flag (a write under way in
    this process: a write from a signal handler that interrupted one of the same stream raises RuntimeError, as
    ``io.BufferedWriter`` does). Per stream, as Python's own streams: a handler may write to ``sys.stderr`` while
    the write it interrupted waits for room in the stdout ring."""

    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()
        self.owner: Optional[int] = None
        self.busy = False

    def enter(self) -> None:
        """Take the lock and mark a write under way (RuntimeError: this thread has one under way already)."""
        me = _thread.get_ident()
        if not self.lock.acquire(False):
            if self.owner == me:
                raise RuntimeError("reentrant call inside a ring writer")
            self.lock.acquire()
        if self.busy:  # the lock was free: the write under way is this thread's, on the fast path
            self.lock.release()
            raise RuntimeError("reentrant call inside a ring writer")
        self.owner = me
        self.busy = True

    def leave(self) -> None:
        self.busy = False
        self.owner = None
        self.lock.release()

    def reset(self) -> None:
        """In a forked process: another thread of the parent may have held the lock, or been in a write."""
        self.lock = _thread.allocate_lock()
        self.owner = None
        self.busy = False


class _Child:
    """The child's side of both rings: the nudge and ack pipes and the writers (each with its ``_Guard``)."""

    def __init__(self, nudge: int, ack: int) -> None:
        self.writers: List[_Writer] = []
        self.nudge_fd = nudge
        self.ack_fd = ack
        self.forked = False  # in a process forked from the script: the rings are not this process's

    def nudge(self) -> None:
        try:
            _os_write(self.nudge_fd, b"\0")
        except OSError:  # full (the server has nudges to read) or closed by the script: nothing to do
            pass

    def wait(self, header: Any, done: Callable[[], bool]) -> None:
        """Block until ``done()``: flag ``WAITING``, nudge, wait for an ack (at most ``ACK_WAIT_MS``, then again);
        a stale ack only makes it look again. The ack pipe is shared by both rings' writers: a thread waiting for
        one ring may read the ack meant for another thread waiting for the other, so no wait for an ack is
        unbounded (the loser flags and nudges again after ``ACK_WAIT_MS``)."""
        while not done():
            header[WAITING] = 1
            if done():
                return
            self.nudge()
            try:
                poller = select.poll()  # one per wait: a poll object refuses a second thread's concurrent poll
                poller.register(self.ack_fd, select.POLLIN)
                if poller.poll(ACK_WAIT_MS):
                    os.read(self.ack_fd, ACK_READ_BYTES)
            except BlockingIOError:  # another thread took the ack first
                pass
            except OSError:  # the ack pipe is gone (closed by the script): the server still acks at its passes
                import time

                time.sleep(0.01)

    def sync(self) -> None:
        """Wait until the server has taken everything of both rings (before another writer may write to the
        fds: the order rule of the module docstring). No system call when they are empty already; no wait from a
        signal handler that interrupted a write of this thread (its output may then come before what that write
        held)."""
        if self.forked:
            return
        for writer in self.writers:
            guard = writer.guard
            try:
                guard.enter()
            except RuntimeError:  # called (os.write, a fork) from a signal handler that interrupted this write
                continue
            try:
                writer.drain()
            finally:
                guard.leave()


class _Writer:
    """The child's writer of one ring. ``write(b)`` is a closure (the fast path: one thread, bytes that fit
    before the end of the data area and in the free space last seen: a copy and three header words, no lock);
    anything else takes ``slow``, under the lock."""

    def __init__(self, ring: Ring, child: _Child) -> None:
        mm = ring.map
        header = ring.header
        size = ring.size
        mask = size - 1
        count = _thread._count  # threads started besides the main one (0: no other thread can be in a write)
        guard = self.guard = _Guard()
        head = 0  # bytes written (HEAD, as this process knows it)
        limit = size  # HEAD may grow to this without looking at TAIL again (TAIL last seen + size)

        def write(b: Any) -> int:
            nonlocal head
            if guard.busy or count() or type(b) is not bytes:
                return slow(b)
            guard.busy = True  # before HEAD is read: a signal handler's write from here on raises (slow)
            try:
                n = len(b)
                start = head & mask
                end = start + n
                if end <= size and head + n <= limit:
                    mm[HEADER_BYTES + start : HEADER_BYTES + end] = b
                    head += n
                    header[HEAD] = head
                    if header[ASLEEP]:
                        header[ASLEEP] = 0
                        child.nudge()
                    return n
            finally:
                guard.busy = False
            return slow(b)

        def slow(b: Any) -> int:
            nonlocal head, limit
            view = b if type(b) is bytes else memoryview(b).cast("B")
            n = len(view)
            guard.enter()
            try:
                done = 0
                while done < n:
                    room = size - (head - header[TAIL])
                    if not 0 < room <= size:  # full, or a scribbled TAIL: wait for the server's
                        child.wait(header, has_room)
                        continue
                    limit = head + room
                    start = head & mask
                    k = min(n - done, room, size - start)
                    mm[HEADER_BYTES + start : HEADER_BYTES + start + k] = view[done : done + k]
                    done += k
                    head += k
                    header[HEAD] = head
                    if header[ASLEEP]:
                        header[ASLEEP] = 0
                        child.nudge()
            finally:
                guard.leave()
            return n

        def has_room() -> bool:
            return 0 < size - (head - header[TAIL]) <= size

        def drain() -> None:
            if header[TAIL] != head:
                child.wait(header, lambda: header[TAIL] == head)

        self.write = write
        self.drain = drain


class RingRaw(io.RawIOBase):
    """The raw stream under ``sys.stdout``/``sys.stderr``: ``write`` copies into the ring (module docstring);
    ``fileno()`` is still 1 or 2, so ``subprocess.run(..., stdout=sys.stdout)`` and ``os.isatty`` work. In
    ``direct`` mode (a forked process, or the fd redirected by ``os.dup2``) it writes to its fd instead."""

    def __init__(self, writer: _Writer, fd: int, name: str) -> None:
        super().__init__()
        self._writer = writer
        self._fd = fd
        self.name = name
        self.direct = False
        self.write = writer.write  # type: ignore[method-assign]

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def set_direct(self, direct: bool) -> None:
        """Write to the fd (True) or to the ring (False)."""
        self.direct = direct
        self.write = self._write_fd if direct else self._writer.write  # type: ignore[method-assign]

    def _write_fd(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            done += _os_write(self._fd, view[done:])
        return done

    def close(self) -> None:
        """Close the stream (not fd 1 or 2, as for Python's own ``sys.stdout``)."""
        super().close()


_child: Optional[_Child] = None
_streams: List[io.TextIOWrapper] = []
_raws: List[RingRaw] = []
_replaced: List[Any] = []  # the streams replaced, kept so that their finalizer never runs
_pipe_ids: List[Tuple[int, int]] = []  # (st_dev, st_ino) of the run's pipes on fds 1 and 2
_os_write = os.write


def _same_pipe(fd: int, index: int) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == _pipe_ids[index]


def _set_direct(raw: RingRaw, stream: Optional[io.TextIOWrapper], direct: bool) -> None:
    """Switch ``raw`` between the ring and its fd (an unfinished line in ``stream`` goes where it was bound)."""
    if raw.direct == direct:
        return
    if stream is not None:
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    raw.set_direct(direct)


def _before_fork() -> None:
    if _child is not None:
        _child.sync()


def _after_fork_in_child() -> None:
    child = _child
    if child is None or child.forked:
        return
    child.forked = True
    for writer in child.writers:
        writer.guard.reset()
    for fd in (child.nudge_fd, child.ack_fd):
        try:
            os.close(fd)
        except OSError:
            pass
    for index, raw in enumerate(_raws):
        _set_direct(raw, _streams[index], True)


def _synced(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if _child is not None:
            _child.sync()
        return function(*args, **kwargs)

    call.__name__ = getattr(function, "__name__", "call")
    call.__doc__ = getattr(function, "__doc__", None)
    return call


def _synced_on_std_fd(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(fd: int, *args: Any, **kwargs: Any) -> Any:
        if (fd == 1 or fd == 2) and _child is not None:
            _child.sync()
        return function(fd, *args, **kwargs)

    call.__name__ = getattr(function, "__name__", "call")
    call.__doc__ = getattr(function, "__doc__", None)
    return call


def _dup2(function: Callable[..., int]) -> Callable[..., int]:
    def dup2(fd: int, fd2: int, inheritable: bool = True) -> int:
        child = _child
        if child is not None:
            child.sync()
        result = function(fd, fd2, inheritable)
        if child is not None and not child.forked and fd2 in (1, 2):
            index = fd2 - 1
            _set_direct(_raws[index], _streams[index], not _same_pipe(fd2, index))
        return result

    dup2.__doc__ = getattr(function, "__doc__", None)
    return dup2


def hook() -> None:
    """Wrap the ``os``/``subprocess`` functions named in the module docstring so that they first empty the rings,
    and register the fork handlers; once per process (a session's interpreter calls it before it forks any
    script's process, which inherits the wrapped functions: made there, they would cost each script's process
    pages copied from the interpreter's). Until ``install`` has run in a process every wrapper and handler does
    nothing but call through."""
    if _hooked:
        return
    _hooked.append(True)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    os.write = _synced_on_std_fd(os.write)
    os.writev = _synced_on_std_fd(os.writev)
    os.dup2 = _dup2(os.dup2)
    for name in ("system", "execv", "execve", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _synced(getattr(os, name)))
    import _posixsubprocess

    _posixsubprocess.fork_exec = _synced(_posixsubprocess.fork_exec)
    subprocess = sys.modules.get("subprocess")
    if subprocess is not None and getattr(subprocess, "_fork_exec", None) is not None:
        subprocess._fork_exec = _posixsubprocess.fork_exec  # type: ignore[attr-defined]


_hooked: List[bool] = []


class Streams:
    """The script's ``sys.stdout`` and ``sys.stderr`` over both rings (``make_streams``), to be put in place in the
    script's process (``install``)."""

    def __init__(self, child: _Child, raws: List[RingRaw], streams: List[io.TextIOWrapper]) -> None:
        self.child = child
        self.raws = raws
        self.streams = streams


def make_streams(rings: List[Ring], nudge: int, ack: int) -> Streams:
    """Text streams over ``rings[0]``/``rings[1]`` for fds 1 and 2, with the encoding and error handler of this
    process's ``sys.stdout``/``sys.stderr``; ``nudge``: the write end of the nudge pipe, ``ack``: the read end of
    the ack pipe (both made non-blocking). Nothing of this process changes: a session's interpreter makes them
    before it forks the script's process (made there, they cost that process no pages of its own)."""
    child = _Child(nudge, ack)
    os.set_blocking(nudge, False)
    os.set_blocking(ack, False)  # waited for with poll (``_Child.wait``)
    raws: List[RingRaw] = []
    streams: List[io.TextIOWrapper] = []
    for index, (fd, name, old) in enumerate(((1, "<stdout>", sys.stdout), (2, "<stderr>", sys.stderr))):
        writer = _Writer(rings[index], child)
        child.writers.append(writer)
        raw = RingRaw(writer, fd, name)
        raws.append(raw)
        stream = io.TextIOWrapper(
            raw,
            encoding=getattr(old, "encoding", None) or "utf-8",
            errors=getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict"),
            newline="\n",
            line_buffering=True,  # print's text and newline reach the ring as one write: a kill never tears a line
            write_through=False,
        )
        stream.mode = "w"  # type: ignore[misc]
        streams.append(stream)
    return Streams(child, raws, streams)


def install(streams: Streams) -> None:
    """In the script's process (fds 1 and 2 are the run's pipes): ``sys.stdout``/``sys.stderr`` (and
    ``sys.__stdout__``/``sys.__stderr__``) become ``streams`` (``make_streams``); the ``os``/``subprocess``
    functions named in the module docstring first empty the rings (``hook``)."""
    global _child
    for fd in (1, 2):
        st = os.fstat(fd)
        _pipe_ids.append((st.st_dev, st.st_ino))
    _raws.extend(streams.raws)
    _streams.extend(streams.streams)
    _replaced.extend((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))
    sys.stdout = sys.__stdout__ = _streams[0]  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = _streams[1]  # type: ignore[misc]
    _child = streams.child
    hook()  # a no-op where the interpreter made them already
