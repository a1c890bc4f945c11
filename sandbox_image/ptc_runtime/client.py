"""Client for the broker's unix socket: newline-delimited JSON with request ids.

Wire format: one request per line,
``{"id": n, "tool": name, "args": {...}}``; the broker answers each with
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false,
"error": {"type": ..., "message": ...}}``, in any order. Besides tool calls,
the runtime sends one control request, ``{"id": n, "op": "report", "error":
{...}}``, to describe a script that ended with an uncaught exception.

One connection per process is shared by every thread and every event loop:
requests are written under a lock, and one reader at a time (a blocking
caller waiting for its own reply, or the reader thread for awaited calls)
hands each reply to the caller waiting on its id, so many calls can be in
flight at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

SOCKET_PATH = os.environ.get("PTC_TOOLS_SOCKET", "/run/ptc/tools.sock")


class ToolError(Exception):
    """A tool call that did not return a result.

    Attributes:
        type: short machine-readable kind, e.g. ``rejected``, ``unknown_tool``,
            ``timeout``, ``http_error``, ``endpoint_error``, ``broker_unavailable``.
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
    __slots__ = ("can_read", "event", "promoted", "reply")

    def __init__(self, can_read: bool) -> None:
        self.event = threading.Event()
        self.reply: Optional[Dict[str, Any]] = None
        self.can_read = can_read  # it may read the socket (a call with a timeout never blocks reading)
        self.promoted = False  # it was handed the socket's reading (its reply is not in yet)

    def resolve(self, reply: Dict[str, Any]) -> None:
        self.reply = reply
        self.event.set()


class _AsyncWaiter:
    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[Dict[str, Any]] = loop.create_future()

    def resolve(self, reply: Dict[str, Any]) -> None:
        _settle_all(self.loop, [(self, reply)])

    def set(self, reply: Dict[str, Any]) -> None:
        if not self.future.done():
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
_HELPER = "helper"  # the reader thread reads for the awaiting callers


class Client:
    """The process-wide connection to the broker (lazy, thread-safe).

    One caller at a time reads the socket, and hands every reply it reads to its waiter: a blocking call reads
    its own reply when nobody else is reading (no thread hand-off), and once its reply is in hands the reading
    to a blocking caller still waiting, or to the reader thread; the reader thread reads while awaited calls
    (``arequest``) are in flight, and their futures are resolved one wake-up of their loop per read. Awaited
    calls made in one turn of their loop are sent in one write.
    """

    def __init__(self, path: str = SOCKET_PATH) -> None:
        self._path = path
        self._lock = threading.Condition()  # guards the state below; never held while blocking on I/O
        self._send_lock = threading.Lock()  # one writer at a time, so lines never interleave
        self._sock: Optional[socket.socket] = None
        self._closed_reason: Optional[str] = None
        self._next_id = 0
        self._pending: Dict[int, _Waiter] = {}
        self._reader: Union[str, _SyncWaiter, None] = None  # who reads the socket now
        self._helper: Optional[threading.Thread] = None
        self._unread = b""  # a reply's first part, read before its end (readers only, one at a time)
        self._outgoing: Dict[asyncio.AbstractEventLoop, List[Tuple[int, bytes]]] = {}  # awaited calls to send

    def _register(self, body: Dict[str, Any], waiter: _Waiter) -> Tuple[int, bytes]:
        """Give the request an id and its waiter; a blocking caller that may read (``can_read``) reads the socket
        itself if nobody does, else the reader thread is asked to. Returns the id and the request's line."""
        try:
            payload = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            payload.encode("utf-8")  # lone surrogates cannot travel as JSON
        except (TypeError, ValueError) as exc:
            raise ToolError(
                "invalid_arguments", f"arguments are not JSON-serializable: {exc}", body.get("tool")
            ) from None
        with self._lock:
            if self._closed_reason is not None:
                raise ToolError("broker_unavailable", self._closed_reason, body.get("tool"))
            if self._sock is None:
                self._connect()
            self._next_id += 1
            request_id = self._next_id
            self._pending[request_id] = waiter
            if self._reader is None:
                if isinstance(waiter, _SyncWaiter) and waiter.can_read:
                    self._reader = waiter
                    waiter.promoted = True
                else:
                    self._call_helper()
        return request_id, ('{"id":%d,%s\n' % (request_id, payload[1:])).encode("utf-8")

    def _call_helper(self) -> None:
        """Make the reader thread the reader (under the lock)."""
        self._reader = _HELPER
        if self._helper is None:
            self._helper = threading.Thread(target=self._help, name="ptc-broker-reader", daemon=True)
            self._helper.start()
        self._lock.notify_all()

    def _write(self, data: bytes, ids: List[int], tool: Optional[str]) -> Optional[str]:
        """Send ``data`` (the lines of ``ids``); on failure, forget them and return why."""
        sock = self._sock
        assert sock is not None
        try:
            with self._send_lock:
                sock.sendall(data)
        except OSError as exc:
            with self._lock:
                for request_id in ids:
                    self._pending.pop(request_id, None)
            return f"cannot send to the broker: {exc}"
        return None

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
        except OSError as exc:
            sock.close()
            raise ToolError("broker_unavailable", f"cannot reach the broker at {self._path}: {exc}") from None
        self._sock = sock

    def _read_once(self) -> None:
        """Read what the broker sent (the reader only) and hand each complete reply to its waiter; on a lost
        connection, fail every waiting call."""
        sock = self._sock
        assert sock is not None
        try:
            data = sock.recv(1 << 18)
            if not data:
                raise EOFError("the broker closed the connection")
            lines = (self._unread + data).split(b"\n")
            self._unread = lines.pop()
            replies = json.loads(b"[" + b",".join(lines) + b"]") if lines else []
        except (OSError, ValueError, EOFError) as exc:
            self._lost(str(exc) if isinstance(exc, EOFError) else f"lost the connection to the broker: {exc}")
            return
        by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[_AsyncWaiter, Dict[str, Any]]]] = {}
        with self._lock:
            waiters = [(self._pending.pop(reply.get("id"), None), reply) for reply in replies]
        for waiter, reply in waiters:
            if isinstance(waiter, _AsyncWaiter):
                by_loop.setdefault(waiter.loop, []).append((waiter, reply))
            elif waiter is not None:
                waiter.resolve(reply)
        for loop, settled in by_loop.items():
            _settle_all(loop, settled)

    def _lost(self, reason: str) -> None:
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason
            pending, self._pending = self._pending, {}
            self._reader = None
        for waiter in pending.values():
            waiter.resolve({"ok": False, "error": {"type": "broker_unavailable", "message": reason}})

    def _hand_over(self) -> None:
        """The reader is done (under the lock): a blocking caller still waiting reads next, else the reader thread
        if awaited calls are in flight, else nobody."""
        self._reader = None
        if self._closed_reason is not None or not self._pending:
            return
        for waiter in self._pending.values():
            if isinstance(waiter, _SyncWaiter) and waiter.can_read and not waiter.event.is_set():
                self._reader = waiter
                waiter.promoted = True
                waiter.event.set()
                return
        self._call_helper()

    def _read_for(self, waiter: _SyncWaiter) -> None:
        """Read (as the reader) until ``waiter`` has its reply, then hand the reading over."""
        try:
            while waiter.reply is None:
                self._read_once()
        finally:
            with self._lock:
                if self._reader is waiter:
                    self._hand_over()

    def _help(self) -> None:
        """The reader thread: reads while it is the reader and calls are in flight."""
        while True:
            with self._lock:
                while self._reader != _HELPER:
                    self._lock.wait()
            while True:
                self._read_once()
                with self._lock:
                    if self._reader != _HELPER:  # the connection was lost
                        break
                    if not self._pending:
                        self._hand_over()
                        break

    def request(self, body: Dict[str, Any], timeout: Optional[float] = None) -> Any:
        """Send one request and block until its reply; returns ``result`` or raises ToolError."""
        waiter = _SyncWaiter(can_read=timeout is None)
        tool = body.get("tool")
        request_id, line = self._register(body, waiter)
        problem = self._write(line, [request_id], tool)
        if problem is not None:
            if waiter.promoted:
                with self._lock:
                    if self._reader is waiter:
                        self._hand_over()
            raise ToolError("broker_unavailable", problem, tool)
        while True:
            if waiter.promoted and waiter.reply is None:
                self._read_for(waiter)
            if waiter.reply is not None:
                break
            if not waiter.event.wait(timeout):
                raise ToolError("timeout", "no reply from the broker in time", tool)
            if waiter.reply is None:  # promoted: it reads now
                waiter.event.clear()
        return _unwrap(waiter.reply, tool)

    async def arequest(self, body: Dict[str, Any]) -> Any:
        """Awaitable ``request``: many may be in flight at once on one loop (those of one turn sent together)."""
        loop = asyncio.get_running_loop()
        waiter = _AsyncWaiter(loop)
        request_id, line = self._register(body, waiter)
        outgoing = self._outgoing.get(loop)
        if outgoing is None:
            outgoing = self._outgoing[loop] = []
            loop.call_soon(self._flush, loop)
        outgoing.append((request_id, line))
        return _unwrap(await waiter.future, body.get("tool"))

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send the awaited calls ``loop`` made in this turn, in one write."""
        outgoing = self._outgoing.pop(loop, [])
        ids = [request_id for request_id, _ in outgoing]
        with self._lock:
            waiters = [self._pending.get(request_id) for request_id in ids]
        problem = self._write(b"".join(line for _, line in outgoing), ids, None)
        if problem is not None:
            for waiter in waiters:
                if waiter is not None:
                    waiter.resolve({"ok": False, "error": {"type": "broker_unavailable", "message": problem}})


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
