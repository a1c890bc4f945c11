"""Client for the broker's unix socket: newline-delimited JSON with request ids.

Wire format: one request per line,
``{"id": n, "tool": name, "args": {...}}``; the broker answers each with
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false,
"error": {"type": ..., "message": ...}}``, in any order. Besides tool calls,
the runtime sends one control request, ``{"id": n, "op": "report", "error":
{...}}``, to describe a script that ended with an uncaught exception.

One connection per process is shared by every thread and every event loop:
one writer thread sends the requests, whole lines in the order they were
queued, and one reader thread hands each reply to the caller waiting on its
id, so many calls can be in flight at once.

Whatever ends a call early leaves the client usable (docs/tools-and-manifests.md, the stubs' rules): an
exception raised by a signal handler (``signal.alarm``, ``KeyboardInterrupt``), any other ``BaseException``, a
cancelled task, a thread that dies. Only the reader and writer threads touch the socket, and Python runs signal
handlers only in the main thread, so no caller's exception can cut a read or a write short, and a signal handler
may call tools whatever the main thread was doing (its line is queued whole, after the one being sent); a caller
that leaves forgets its id, so its late reply is dropped (replies are matched by id, and ids are never reused).
A caller only queues its line (``queue.SimpleQueue.put``, safe to call again from a signal handler that
interrupted it) and waits on its own lock: no caller ever waits for a lock another caller may hold.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import socket
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

SOCKET_PATH = os.environ.get("PTC_TOOLS_SOCKET", "/run/ptc/tools.sock")


class ToolError(Exception):
    """A tool call that did not return a result.

    Attributes:
        type: short machine-readable kind, e.g. ``rejected``, ``unknown_tool``,
            ``timeout``, ``http_error``, ``endpoint_error``, ``broker_unavailable``,
            ``interrupted`` (an awaited call whose queuing an exception cut short).
        message: human-readable explanation (names the parameter when an
            argument was wrong).
        tool: the tool's original name, when known.
    """

    def __init__(self, type: str, message: str, tool: Optional[str] = None) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message
        self.tool = tool


class _SyncWaiter:
    """A blocking caller: ``done`` is held until its reply is in (a bare lock: released by the reader thread)."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()
        self.reply: Optional[Dict[str, Any]] = None

    def resolve(self, reply: Dict[str, Any]) -> None:
        self.reply = reply
        self.done.release()


class _AsyncWaiter:
    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[Dict[str, Any]] = loop.create_future()

    def resolve(self, reply: Dict[str, Any]) -> None:
        _settle_all(self.loop, [(self, reply)])

    def set(self, reply: Dict[str, Any]) -> None:
        if not self.future.done():  # a cancelled call's future is done: its late reply is dropped
            self.future.set_result(reply)


def _settle_all(loop: asyncio.AbstractEventLoop, settled: List[Tuple[_AsyncWaiter, Dict[str, Any]]]) -> None:
    """Resolve, in ``loop``'s thread, the futures of the replies read together (one wake-up of the loop)."""
    try:
        loop.call_soon_threadsafe(_set_all, settled)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def _set_all(settled: List[Tuple[_AsyncWaiter, Dict[str, Any]]]) -> None:
    for waiter, reply in settled:
        waiter.set(reply)


_Waiter = Union[_SyncWaiter, _AsyncWaiter]


class _Connection:
    """One socket to the broker, with its reader and writer threads (started before the connection is used).

    ``outbox`` holds whole request lines (or batches of lines) for the writer thread; ``None`` stops it."""

    __slots__ = ("discarded", "outbox", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.outbox: queue.SimpleQueue[Optional[bytes]] = queue.SimpleQueue()
        self.discarded = False  # a connection made twice at once (a signal handler's call during the first one)

    def discard(self) -> None:
        """Stop the threads of a connection that lost the race to be the client's (nothing was sent on it)."""
        self.discarded = True
        self.outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # its reader sees the end, closes the socket and stops
        except OSError:
            pass


class Client:
    """The process-wide connection to the broker (lazy, thread-safe, usable whatever ended an earlier call).

    The writer thread (``ptc-broker-writer``) is the only one to write the socket: it sends the queued lines, each
    whole, in the order they were queued. The reader thread (``ptc-broker-reader``) is the only one to read it: it
    hands each reply to the waiter of its id, a blocking caller's lock or an awaited call's future (one wake-up of
    the caller's loop per read). Both start with the connection, before anyone can use it. A caller only registers
    its id, queues its line and waits, so an exception that ends it anywhere (a signal handler's, a cancellation, a
    ``BaseException``) leaves the others as they were, and its line, once queued, is still sent whole; it forgets
    its id on the way out, and the late reply is dropped. Awaited calls made in one turn of their loop are sent in
    one write.

    ``_pending`` is only changed by single dict operations and the connection is made known by one (atomic under
    the GIL), so that neither the reader and writer threads nor a signal handler's own tool call ever wait for a
    lock that an interrupted caller holds.
    """

    def __init__(self, path: str = SOCKET_PATH) -> None:
        self._path = path
        self._connect_lock = threading.RLock()  # threads connect one at a time; re-entrant: a signal handler may
        self._made: Dict[str, _Connection] = {}  # "live": the connection (set once, by setdefault: see _connect)
        self._closed_reason: Optional[str] = None
        self._ids = itertools.count(1)  # next() is atomic: ids are unique even across a signal handler's calls
        self._pending: Dict[int, _Waiter] = {}
        self._outgoing: Dict[asyncio.AbstractEventLoop, List[Tuple[int, bytes]]] = {}  # awaited calls to send

    def _line(self, body: Dict[str, Any]) -> Tuple[int, bytes]:
        """A fresh id and the request's line; raises ToolError for arguments JSON cannot carry, or when the broker
        cannot be reached."""
        try:
            payload = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            encoded = payload[1:].encode("utf-8")  # lone surrogates cannot travel as JSON
        except (TypeError, ValueError) as exc:
            raise ToolError(
                "invalid_arguments", f"arguments are not JSON-serializable: {exc}", body.get("tool")
            ) from None
        if "live" not in self._made:
            self._connect()
        if self._closed_reason is not None:
            raise ToolError("broker_unavailable", self._closed_reason, body.get("tool"))
        request_id = next(self._ids)
        return request_id, b'{"id":%d,%s\n' % (request_id, encoded)

    def _register(self, request_id: int, waiter: _Waiter) -> None:
        """Make ``waiter`` the one the reply of ``request_id`` goes to; when the connection was lost meanwhile (its
        waiters already failed), it fails at once."""
        self._pending[request_id] = waiter
        reason = self._closed_reason
        if reason is not None and self._pending.pop(request_id, None) is not None:
            waiter.resolve({"ok": False, "error": {"type": "broker_unavailable", "message": reason}})

    def _connect(self) -> None:
        """Make the connection and start its threads. A signal handler's call made meanwhile (same thread, so past
        the re-entrant lock) makes its own; the first one made known (``setdefault``, atomic) is kept, the other
        discarded, so there is only ever one connection and one reader."""
        with self._connect_lock:
            if "live" in self._made or self._closed_reason is not None:
                return
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._path)
            except OSError as exc:
                sock.close()
                raise ToolError("broker_unavailable", f"cannot reach the broker at {self._path}: {exc}") from None
            conn = _Connection(sock)
            try:
                threading.Thread(target=self._read, args=(conn,), name="ptc-broker-reader", daemon=True).start()
                threading.Thread(target=self._send, args=(conn,), name="ptc-broker-writer", daemon=True).start()
                self._made.setdefault("live", conn)
            finally:
                if self._made.get("live") is not conn:  # another one won, or an exception came before the choice
                    conn.discard()

    def _write(self, data: bytes) -> None:
        """Queue ``data`` (whole lines) for the writer thread. One C call: an exception (a signal handler's) comes
        before it or after it, never in the middle, and a signal handler may call it again meanwhile."""
        self._made["live"].outbox.put(data)

    def _send(self, conn: _Connection) -> None:
        """The writer thread: send the queued lines in order, each whole; when the socket fails, fail every waiting
        call and every later one."""
        outbox, sock = conn.outbox, conn.sock
        try:
            while True:
                data = outbox.get()
                if data is None:
                    return
                sock.sendall(data)
        except OSError as exc:
            if not conn.discarded:
                self._lost(f"cannot send to the broker: {exc}")

    def _read(self, conn: _Connection) -> None:
        """The reader thread: read every reply and hand it to its waiter (a reply nobody waits for any more is
        dropped); on a lost connection, or anything unexpected, fail every waiting call and every later one."""
        sock = conn.sock
        unread = b""
        try:
            while True:
                data = sock.recv(1 << 18)
                if not data:
                    raise EOFError("the broker closed the connection")
                lines = (unread + data).split(b"\n")
                unread = lines.pop()
                if not lines:
                    continue
                pending = self._pending
                by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[_AsyncWaiter, Dict[str, Any]]]] = {}
                for reply in json.loads(b"[" + b",".join(lines) + b"]"):
                    request_id = reply.get("id")
                    waiter = pending.pop(request_id, None) if type(request_id) is int else None
                    if isinstance(waiter, _AsyncWaiter):
                        by_loop.setdefault(waiter.loop, []).append((waiter, reply))
                    elif waiter is not None:
                        waiter.resolve(reply)
                for loop, settled in by_loop.items():
                    _settle_all(loop, settled)
        except EOFError as exc:
            reason = str(exc)
        except OSError as exc:
            reason = f"lost the connection to the broker: {exc}"
        except Exception as exc:  # a reply that is not JSON, or not an object: nothing more can be trusted
            reason = f"unreadable reply from the broker: {type(exc).__name__}: {exc}"
        if conn.discarded:  # the other connection is the client's: this one just ends
            sock.close()
        else:
            self._lost(reason)

    def _lost(self, reason: str) -> None:
        """Fail every waiting call (and, through ``_closed_reason``, every later one)."""
        if self._closed_reason is None:
            self._closed_reason = reason
        pending = self._pending
        error = {"ok": False, "error": {"type": "broker_unavailable", "message": reason}}
        while pending:
            try:
                _, waiter = pending.popitem()
            except KeyError:  # emptied meanwhile by callers that left
                break
            waiter.resolve(error)

    def request(self, body: Dict[str, Any], timeout: Optional[float] = None) -> Any:
        """Send one request and block until its reply; returns ``result`` or raises ToolError.

        ``timeout`` (seconds; None: no limit) bounds the wait: past it, ToolError ``timeout``. Whatever ends the
        wait early (the timeout, an exception from a signal handler, ``KeyboardInterrupt``) abandons the call: its
        reply, if it comes, is dropped, and the client stays usable.
        """
        tool = body.get("tool")
        request_id, line = self._line(body)
        waiter = _SyncWaiter()
        try:
            self._register(request_id, waiter)
            self._write(line)
            if not waiter.done.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise ToolError("timeout", "no reply from the broker in time", tool)
        except BaseException:
            self._pending.pop(request_id, None)  # abandoned: a late reply is dropped
            raise
        assert waiter.reply is not None
        return _unwrap(waiter.reply, tool)

    async def arequest(self, body: Dict[str, Any]) -> Any:
        """Awaitable ``request``: many may be in flight at once on one loop (those of one turn sent together).

        A cancelled call (``asyncio.wait_for``'s timeout, ``Task.cancel``) is abandoned: sent or not, its reply is
        dropped, and the client stays usable."""
        loop = asyncio.get_running_loop()
        request_id, line = self._line(body)
        waiter = _AsyncWaiter(loop)
        try:
            self._register(request_id, waiter)
            if loop not in self._outgoing:
                loop.call_soon(self._flush, loop)  # before the list: cut short here, the next call still gets sent
            self._outgoing.setdefault(loop, []).append((request_id, line))
            reply = await waiter.future
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return _unwrap(reply, body.get("tool"))

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Queue the awaited calls ``loop`` made in this turn, as one write. When an exception (a signal handler's)
        ends this before they are queued, or just after, those calls fail (``interrupted``)."""
        outgoing = self._outgoing.pop(loop, [])
        try:
            self._write(b"".join(line for _, line in outgoing))
        except BaseException as exc:
            problem = f"queuing the call was interrupted ({type(exc).__name__}); it may not have been sent"
            for request_id, _ in outgoing:
                waiter = self._pending.pop(request_id, None)
                if waiter is not None:
                    waiter.resolve({"ok": False, "error": {"type": "interrupted", "message": problem}})
            raise


def _unwrap(reply: Dict[str, Any], tool: Optional[str]) -> Any:
    if reply.get("ok"):
        return reply.get("result")
    error = reply.get("error") or {}
    raise ToolError(str(error.get("type", "error")), str(error.get("message", "")), tool)


_client = Client()


def _reset_after_fork() -> None:
    global _client
    _client = Client()


os.register_at_fork(after_in_child=_reset_after_fork)


def client() -> Client:
    """The current process's client (a fresh one after ``os.fork``)."""
    return _client
