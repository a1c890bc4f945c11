"""One job's socket: connections, reading request lines at a pace, bounding the work in flight, writing replies.

Protocol: newline-delimited JSON, one request a line, answered in any order (``service.broker.dispatch``). Each
request is handled in its own task, so many calls are in flight at once on one connection.

Nothing from the sandbox is trusted, and one job cannot starve the others:

- at most ``MAX_CONNECTIONS`` connections per job; a line over ``BrokerConfig.max_line_bytes`` closes its
  connection;
- at most ``MAX_IN_FLIGHT`` requests and ``BrokerConfig.max_in_flight_bytes`` of request lines per job are handled
  at once (past that the broker stops reading, so a flooding script blocks on its own socket);
- a job begins its request lines in batches of about ``PACE_TURN_S`` of the event loop each (``Pacer``);
- the lines of an engine in this process (``Connections.call``, the in-process call port) meet the same bounds:
  a line over ``max_line_bytes`` closes that port as it would a connection, and every line takes its place among
  the requests and bytes in flight and its turn of the pace before it is read;
- the replies that one connection's calls produce in one turn of the loop are written together, and a call
  stays in flight while its connection's write buffer is full;
- any fault of the service while handling a request becomes an ``internal_error`` reply (logged with its
  traceback): never a request left unanswered;
- once ``stop`` begins, nothing new is read or dispatched, and the calls in flight are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

import orjson

from service.broker.checks import Request
from service.broker.config import BrokerConfig
from service.observability import stages
from service.unix_sockets import bind_unix

log = logging.getLogger(__name__)

CONNECTION_CLOSED = "the broker closed the connection"  # what the sandbox's client (``ptc_runtime.client``) answers
# every call with once the broker closed its connection: the in-process port's calls get it too once it is closed
MAX_CONNECTIONS = 32
MAX_IN_FLIGHT = 1024
PACE_TURN_S = 0.004  # how long a turn of the event loop may take while a job begins request lines: past it, the job
# begins half as many lines per turn; under it, with its last batch full, twice as many (``Pacer.pace``)
PACE_LINES = (8, 1024)  # the fewest and most lines a job begins per turn; it starts at 16. (At 2,000 lines in one turn,
# one job held the loop for 0.64 s; at a fixed 16 a turn, a 1,000-call echo fan-out took 40% longer.)


class Requests(Protocol):
    """What answers a job's request lines (``Dispatcher``)."""

    async def read(self, line: bytes) -> Request:
        """The request one line carries."""
        ...

    async def answer(self, request: Request, size: int) -> dict[str, Any]:
        """The reply, without its id, to a request whose line was ``size`` bytes."""
        ...


class Pacer:
    """How many request lines one job (all its connections) begins per turn of the event loop.

    The lines begun in one turn are handled in the next, back to back (their inline parts: parse, cheap checks,
    reply); how long that turn took sets the next batch's size (``PACE_TURN_S``, ``PACE_LINES``), so a turn stays
    near 4 ms whether a line costs 20 us or 300 us. Event-loop thread only.
    """

    def __init__(self) -> None:
        self._begun = 0  # request lines begun in this turn of the event loop
        self._per_turn = 16  # how many it may begin per turn (``_turn_took``)
        self._batch_began = 0.0  # time.perf_counter() when the first of them was begun
        self._turn_ended = asyncio.Event()

    async def pace(self) -> None:
        """Wait for a turn of the event loop in which this job has begun fewer than its lines per turn, and count
        one more."""
        # A batch also ends after PACE_TURN_S of the reader's own work: blank lines are read, not handled (a flood
        # of b"\n" came from the buffer in one turn: 0.6 s).
        while self._begun and (self._begun >= self._per_turn or time.perf_counter() - self._batch_began > PACE_TURN_S):
            await self._turn_ended.wait()
        if self._begun == 0:
            self._batch_began = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._next_turn)
        self._begun += 1

    def _next_turn(self) -> None:
        """At the start of the turn that handles the lines begun in the last one: time it, let the readers on."""
        asyncio.get_running_loop().call_soon(self._turn_took, time.perf_counter(), self._begun >= self._per_turn)
        self._begun = 0
        self._turn_ended.set()
        self._turn_ended = asyncio.Event()

    def _turn_took(self, began: float, full: bool) -> None:
        low, high = PACE_LINES
        if time.perf_counter() - began > PACE_TURN_S:
            self._per_turn = max(low, self._per_turn // 2)
        elif full:
            self._per_turn = min(high, self._per_turn * 2)


class _Outbox:
    """The replies of one connection not yet written: those queued in one turn of the event loop go out in one
    write, at the end of the turn (one system call for a fan-out's replies, instead of one each); the reply of a
    connection's only request in flight goes out at once. ``handling``: its requests being handled."""

    __slots__ = ("handling", "lines", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.lines: list[bytes] = []
        self.handling = 0

    def put(self, line: bytes, alone: bool) -> None:
        """Queue ``line``; ``alone``: no other request of the connection is being handled (write it now)."""
        if alone and not self.lines:
            self.writer.write(line)
            return
        if not self.lines:
            asyncio.get_running_loop().call_soon(self.flush)
        self.lines.append(line)

    def flush(self) -> None:
        lines, self.lines = self.lines, []
        if lines and not self.writer.is_closing():
            self.writer.write(b"".join(lines))


def _error(request_id: Any, type_: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"type": type_, "message": message}}


class Connections:
    """One job's unix-socket server: its connections, the lines read from them, the requests in flight; and the
    in-process call port (``call``), whose lines meet the same bounds.

    Args:
        config: the job's ``max_line_bytes`` and ``max_in_flight_bytes``.
        requests: what reads and answers each line (the job's ``Dispatcher``).

    The submitting request's stage timer (``stages.current()`` when this is made), if any, gets each request's
    parse, answer and reply times.
    """

    def __init__(self, config: BrokerConfig, requests: Requests) -> None:
        self._requests = requests
        self._max_line = config.max_line_bytes
        self._flight_cap = config.max_in_flight_bytes
        self._flight_bytes = 0
        self._flight_freed = asyncio.Event()
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._pacer = Pacer()
        self._closing = False
        self._port_closed = False  # the in-process port met a line over ``max_line_bytes`` (``call``)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._stages = stages.current()  # the submitting request's, when timed (its calls' stages are summed there)

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (a unix socket, mode 0666 so the sandbox user can connect)."""
        sock = bind_unix(path)  # an address without the work dir's path (a sandbox's /proc/net/unix shows it)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=self._max_line)
        os.chmod(path, 0o666)

    async def call(self, line: bytes) -> dict[str, Any]:
        """Answer one request line (JSON, no newline) made in this process (``Broker.call``) within the bounds of a
        line read from the socket; returns the reply with the line's id (None when the line is unreadable).

        A line over ``max_line_bytes`` is refused as the socket refuses it: unread, unrecorded, logged, and the
        port closed as the line's connection would be; this call and every later one are answered
        ``broker_unavailable`` (``CONNECTION_CLOSED``), as the sandbox's client answers its calls once its
        connection is closed. Calls already in flight through the port are still answered. A line within the cap
        waits, as a socket's does, for a place among the requests and bytes in flight and for its turn (``_enter``);
        once ``stop`` has begun it is answered ``cancelled``. Raises only CancelledError (nothing then stays
        counted in flight).
        """
        if self._closing:
            return _error(None, "cancelled", "the job's broker is closed")
        if not self._port_closed and len(line) > self._max_line:
            self._line_too_long("the in-process call port")
            self._port_closed = True
        if self._port_closed:
            return _error(None, "broker_unavailable", CONNECTION_CLOSED)
        size = await self._enter(len(line))
        if size is None:
            return _error(None, "cancelled", "the job's broker is closed")
        try:
            reply, parse_ns, answer_ns = await self._answer(line)
        finally:
            self._leave(size)
        if self._stages is not None:
            self._stages.call({"parse": parse_ns, "answer": answer_ns})
        return reply

    def _line_too_long(self, closing: str) -> None:
        log.info("broker: request line over %d bytes; closing %s", self._max_line, closing)

    async def stop(self) -> None:
        """Stop listening and reading, close the connections, cancel the requests in flight and wait for them."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        while self._tasks:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_closed(self) -> None:
        """Wait (at most 1 s) for the server to close; its failures are ignored."""
        server, self._server = self._server, None  # let go of it: it refers back here (no cycle for the collector)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or len(self._writers) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        outbox = _Outbox(writer)
        try:
            while not self._closing:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    self._line_too_long("the connection")
                    return
                except ConnectionError:
                    return
                if not line:
                    return
                if not line.strip():  # a blank line is no request, but reading it is work: paced like one
                    await self._pacer.pace()
                    continue
                size = await self._enter(len(line))
                if size is None:  # no call begins once ``stop`` has begun
                    return
                outbox.handling += 1
                task = asyncio.create_task(self._handle(line, outbox))
                self._tasks.add(task)
                task.add_done_callback(functools.partial(self._task_done, size=size))
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _enter(self, size: int) -> int | None:
        """Wait for a request line of ``size`` bytes (the socket's or the in-process port's) to be handled: a place
        among the job's ``MAX_IN_FLIGHT`` requests, room among its request bytes in flight (``_flight_room``), its
        turn of the pace (``Pacer``). Returns the bytes counted (give them back with ``_leave``), or None (nothing
        held) when ``stop`` has begun meanwhile; cancelled, it holds nothing."""
        await self._in_flight.acquire()
        counted = 0
        try:
            counted = await self._flight_room(size)
            await self._pacer.pace()
        except BaseException:
            self._leave(counted)
            raise
        if self._closing:  # checked after the last wait: no call begins once ``stop`` has begun
            self._leave(counted)
            return None
        return counted

    def _leave(self, counted: int) -> None:
        """A request line ``_enter`` let in (``counted`` bytes) has been answered."""
        self._in_flight.release()
        self._flight_bytes -= counted
        self._flight_freed.set()

    async def _flight_room(self, size: int) -> int:
        """Wait until this job's requests in flight leave room for ``size`` bytes (one fits alone); returns the
        bytes counted (``size``, at most the cap)."""
        size = min(size, self._flight_cap)
        while self._flight_bytes and self._flight_bytes + size > self._flight_cap:
            self._flight_freed.clear()
            await self._flight_freed.wait()
        self._flight_bytes += size
        return size

    def _task_done(self, task: asyncio.Task[None], size: int) -> None:
        self._tasks.discard(task)
        self._leave(size)

    async def _handle(self, line: bytes, outbox: _Outbox) -> None:
        """Answer one request line read from a connection, on that connection."""
        try:
            reply, parse_ns, answer_ns = await self._answer(line)
            answered = time.perf_counter_ns()
            await self._reply(outbox, reply)
        finally:
            outbox.handling -= 1
        if self._stages is not None:
            self._stages.call({"parse": parse_ns, "answer": answer_ns, "reply": time.perf_counter_ns() - answered})

    async def _answer(self, line: bytes) -> tuple[dict[str, Any], int, int]:
        """The reply to one request line, with the request's id (None when the line is unreadable), and how long
        reading it and answering it took (ns). Whatever goes wrong, there is a reply (``internal_error`` for a
        fault of the service, logged with its traceback). Raises only CancelledError."""
        request_id: int | str | None = None
        began = parsed = time.perf_counter_ns()
        try:
            request = await self._requests.read(line)
            parsed = time.perf_counter_ns()
            request_id = request.id
            reply = await self._requests.answer(request, len(line))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("broker: handling a request failed unexpectedly")
            reply = _error(None, "internal_error", "the service failed to handle this request; see the service log")
        reply["id"] = request_id
        return reply, parsed - began, time.perf_counter_ns() - parsed

    async def _reply(self, outbox: _Outbox, reply: dict[str, Any]) -> None:
        """Queue ``reply`` on its connection (written with the others of this turn of the loop), then wait while
        the connection's write buffer is full: a script that does not read its replies holds its calls in flight,
        and the broker stops reading its requests."""
        try:
            data = orjson.dumps(reply) + b"\n"
        except orjson.JSONEncodeError:  # cannot happen for depth-checked values; never leave a caller hanging
            data = orjson.dumps(_error(reply.get("id"), "bad_response", "the reply could not be encoded")) + b"\n"
        writer = outbox.writer
        if writer.is_closing():
            return
        outbox.put(data, alone=outbox.handling == 1)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
