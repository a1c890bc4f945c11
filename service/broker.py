"""The broker: one unix-socket server per job, the only authority on which tool calls happened.

Protocol (DESIGN.md, "Stub <-> broker wire protocol"): newline-delimited JSON.
A request ``{"id": n, "tool": name, "args": {...}}`` is answered, in any
order, by ``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false,
"error": {"type", "message"}}``. Each request is handled in its own task, so
many calls are in flight at once on one connection. One control request
exists: ``{"id": n, "op": "report", "error": {...}}``, by which the runtime
describes the script's uncaught exception; it is kept as the job's ``error``.

Every request naming a tool gets a call record, appended when it arrives
(``seq`` in arrival order, status ``pending``) and completed when it ends:

- ``rejected``: unknown tool, or arguments that fail the tool's schema;
- ``ok`` / ``error`` / ``timeout``: the endpoint's outcome;
- ``error`` with type ``cancelled``: the job ended while the call was in flight.

Past ``max_calls`` a request is refused without a record (counted in
``calls_over_limit``). Nothing from the sandbox is trusted: malformed lines
get an error reply, oversized lines close the connection, and at most
``MAX_IN_FLIGHT`` requests per job are handled at once: past that the broker
stops reading, so a flooding script blocks on its own socket instead of
growing the service's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import os
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from service.toolkit.endpoints import EndpointClients, ToolCallFailed
from service.toolkit.manifest import ToolSpec

log = logging.getLogger(__name__)

REPORT_FIELD_CAP = 2000
MAX_IN_FLIGHT = 1024


def _now() -> datetime:
    return datetime.now(UTC)


class Broker:
    """Serves one job's socket.

    Args:
        tools: the job's tools by original name.
        endpoints: the shared endpoint clients.
        max_calls: tool calls accepted for this job.
        max_line_bytes: the longest request line accepted.
        on_call_end: called with each completed record (metrics hook).
    """

    def __init__(
        self,
        tools: dict[str, ToolSpec],
        endpoints: EndpointClients,
        max_calls: int,
        max_line_bytes: int,
        on_call_end: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._tools = tools
        self._endpoints = endpoints
        self._max_calls = max_calls
        self._max_line = max_line_bytes
        self._on_call_end = on_call_end
        self.records: list[dict[str, Any]] = []
        self.calls_over_limit = 0
        self.reported_error: dict[str, Any] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[asyncio.StreamWriter] = set()
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def start(self, path: Path) -> None:
        """Listen on ``path`` (a unix socket, mode 0666 so the sandbox user can connect)."""
        self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=self._max_line)
        os.chmod(path, 0o666)

    async def close(self) -> None:
        """Stop listening, cancel calls in flight (their records end ``cancelled``), close connections."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in list(self._connections):
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        lock = asyncio.Lock()
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    log.info("broker: request line over %d bytes; closing the connection", self._max_line)
                    return
                except ConnectionError:
                    return
                if not line:
                    return
                if line.strip():
                    await self._in_flight.acquire()
                    task = asyncio.create_task(self._handle(line, writer, lock))
                    self._tasks.add(task)
                    task.add_done_callback(self._task_done)
        finally:
            self._connections.discard(writer)
            writer.close()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight.release()

    async def _reply(self, writer: asyncio.StreamWriter, lock: asyncio.Lock, reply: dict[str, Any]) -> None:
        data = orjson.dumps(reply) + b"\n"
        async with lock:
            if writer.is_closing():
                return
            writer.write(data)
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    async def _handle(self, line: bytes, writer: asyncio.StreamWriter, lock: asyncio.Lock) -> None:
        try:
            request = orjson.loads(line)
        except orjson.JSONDecodeError:
            await self._reply(writer, lock, _error(None, "bad_request", "the request is not valid JSON"))
            return
        if not isinstance(request, dict):
            await self._reply(writer, lock, _error(None, "bad_request", "the request must be a JSON object"))
            return
        request_id = request.get("id")
        if not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
            request_id = None
        if request.get("op") == "report":
            self._keep_report(request.get("error"))
            await self._reply(writer, lock, {"id": request_id, "ok": True, "result": None})
            return
        tool_name = request.get("tool")
        if not isinstance(tool_name, str):
            await self._reply(writer, lock, _error(request_id, "bad_request", "the request names no tool"))
            return
        if len(self.records) >= self._max_calls:
            self.calls_over_limit += 1
            await self._reply(
                writer,
                lock,
                _error(request_id, "limit_exceeded", f"this job may make at most {self._max_calls} tool calls"),
            )
            return
        reply = await self._call(tool_name, request.get("args"))
        reply["id"] = request_id
        await self._reply(writer, lock, reply)

    async def _call(self, tool_name: str, args: Any) -> dict[str, Any]:
        """Validate, dispatch and record one call; returns the reply without its id."""
        record: dict[str, Any] = {
            "seq": len(self.records) + 1,
            "call_id": "call_" + secrets.token_hex(8),
            "tool": tool_name,
            "args": args,
            "status": "pending",
            "started_at": _now(),
            "duration_ms": None,
        }
        self.records.append(record)
        started = time.perf_counter()
        try:
            reply = await self._dispatch(tool_name, args, record)
        except asyncio.CancelledError:
            record.update(
                status="error", error={"type": "cancelled", "message": "the job ended before the tool answered"}
            )
            raise
        finally:
            record["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
            if self._on_call_end is not None:
                self._on_call_end(record)
        return reply

    async def _dispatch(self, tool_name: str, args: Any, record: dict[str, Any]) -> dict[str, Any]:
        tool = self._tools.get(tool_name)
        if tool is None:
            close = difflib.get_close_matches(tool_name, list(self._tools), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            return self._fail(record, "rejected", "unknown_tool", f"no tool named {tool_name!r}{hint}")
        problem = tool.check_arguments(args)
        if problem is not None:
            return self._fail(record, "rejected", "invalid_arguments", f"{tool_name}: {problem}")
        try:
            result = await self._endpoints.call(tool, args)
        except ToolCallFailed as exc:
            return self._fail(record, "timeout" if exc.type == "timeout" else "error", exc.type, exc.message)
        except Exception:
            log.exception("broker: endpoint of tool %s failed unexpectedly", tool_name)
            return self._fail(record, "error", "endpoint_error", "the tool's endpoint failed; see the service log")
        record.update(status="ok", result=result)
        return {"ok": True, "result": result}

    @staticmethod
    def _fail(record: dict[str, Any], status: str, type_: str, message: str) -> dict[str, Any]:
        error = {"type": type_, "message": message}
        record.update(status=status, error=error)
        return {"ok": False, "error": error}

    def _keep_report(self, error: Any) -> None:
        if self.reported_error is not None or not isinstance(error, dict):
            return
        kept: dict[str, Any] = {}
        for key in ("type", "message", "text"):
            if isinstance(error.get(key), str):
                kept[key] = error[key][:REPORT_FIELD_CAP]
        for key in ("line", "column"):
            if isinstance(error.get(key), int) and not isinstance(error.get(key), bool):
                kept[key] = error[key]
        if "type" in kept:
            self.reported_error = kept


def _error(request_id: Any, type_: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"type": type_, "message": message}}
