"""Client for the broker's unix socket: newline-delimited JSON with request ids.

Wire format: one request per line,
``{"id": n, "tool": name, "args": {...}}``; the broker answers each with
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false,
"error": {"type": ..., "message": ...}}``, in any order. Besides tool calls,
the runtime sends one control request, ``{"id": n, "op": "report", "error":
{...}}``, to describe a script that ended with an uncaught exception.

One connection per process is shared by every thread and every event loop:
requests are written under a lock, and a reader thread hands each reply to
the caller waiting on its id, so many calls can be in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from typing import Any, Dict, Optional, Union

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
    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: Optional[Dict[str, Any]] = None

    def resolve(self, reply: Dict[str, Any]) -> None:
        self.reply = reply
        self.event.set()


class _AsyncWaiter:
    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[Dict[str, Any]] = loop.create_future()

    def resolve(self, reply: Dict[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self._set, reply)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _set(self, reply: Dict[str, Any]) -> None:
        if not self.future.done():
            self.future.set_result(reply)


_Waiter = Union[_SyncWaiter, _AsyncWaiter]


class Client:
    """The process-wide connection to the broker (lazy, thread-safe)."""

    def __init__(self, path: str = SOCKET_PATH) -> None:
        self._path = path
        self._lock = threading.Lock()  # guards the state below; never held while blocking on I/O
        self._send_lock = threading.Lock()  # one writer at a time, so lines never interleave
        self._sock: Optional[socket.socket] = None
        self._closed_reason: Optional[str] = None
        self._next_id = 0
        self._pending: Dict[int, _Waiter] = {}

    def _send(self, body: Dict[str, Any], waiter: _Waiter) -> None:
        try:
            payload = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            payload.encode("utf-8")  # lone surrogates cannot travel as JSON
        except (TypeError, ValueError) as exc:
            raise ToolError(
                "invalid_arguments", f"arguments are not JSON-serializable: {exc}", body.get("tool")
            ) from None
        tool = body.get("tool")
        with self._lock:
            if self._closed_reason is not None:
                raise ToolError("broker_unavailable", self._closed_reason, tool)
            if self._sock is None:
                self._connect()
            self._next_id += 1
            request_id = self._next_id
            self._pending[request_id] = waiter
            sock = self._sock
        assert sock is not None
        line = ('{"id":%d,%s\n' % (request_id, payload[1:])).encode("utf-8")
        try:
            with self._send_lock:
                sock.sendall(line)
        except OSError as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            raise ToolError("broker_unavailable", f"cannot send to the broker: {exc}", tool) from None

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
        except OSError as exc:
            sock.close()
            raise ToolError("broker_unavailable", f"cannot reach the broker at {self._path}: {exc}") from None
        self._sock = sock
        threading.Thread(target=self._read_replies, args=(sock,), name="ptc-broker-reader", daemon=True).start()

    def _read_replies(self, sock: socket.socket) -> None:
        reason = "the broker closed the connection"
        try:
            with sock.makefile("rb") as stream:
                for line in stream:
                    reply = json.loads(line)
                    with self._lock:
                        waiter = self._pending.pop(reply.get("id"), None)
                    if waiter is not None:
                        waiter.resolve(reply)
        except (OSError, ValueError) as exc:
            reason = f"lost the connection to the broker: {exc}"
        with self._lock:
            self._closed_reason = reason
            pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.resolve({"ok": False, "error": {"type": "broker_unavailable", "message": reason}})

    def request(self, body: Dict[str, Any], timeout: Optional[float] = None) -> Any:
        """Send one request and block until its reply; returns ``result`` or raises ToolError."""
        waiter = _SyncWaiter()
        self._send(body, waiter)
        if not waiter.event.wait(timeout):
            raise ToolError("timeout", "no reply from the broker in time", body.get("tool"))
        assert waiter.reply is not None
        return _unwrap(waiter.reply, body.get("tool"))

    async def arequest(self, body: Dict[str, Any]) -> Any:
        """Awaitable ``request``: many may be in flight at once on one loop."""
        waiter = _AsyncWaiter(asyncio.get_running_loop())
        self._send(body, waiter)
        return _unwrap(await waiter.future, body.get("tool"))


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
