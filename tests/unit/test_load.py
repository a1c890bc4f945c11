"""One job's load stays its own: call records are capped and compact, views never stall the service (issue 11, 9-10).

Unit tests drive a real ``Broker`` over a real unix socket in-process; integration tests run real jobs on a
service of their own and read its memory from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from service.broker import Broker, BrokerConfig, BrokerShared, CallMemory
from service.broker.config import UNBOUNDED
from service.egress import EgressPolicy
from service.toolkit.cache import ManifestCache
from service.toolkit.endpoints import EndpointClients
from service.views import render

ANY_ARGS = {"type": "object", "additionalProperties": True}


ECHO_TOOL = {"name": "echo", "parameters": ANY_ARGS, "endpoint": {"kind": "echo"}}


CLIENT_TOOL = {"name": "ask", "parameters": ANY_ARGS, "endpoint": {"kind": "client"}}


class Socket:
    """A script's side of the broker socket: send requests, read replies by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, request_id: int, tool: str, args: Any) -> None:
        self.writer.write(orjson.dumps({"id": request_id, "tool": tool, "args": args}) + b"\n")
        await self.writer.drain()

    async def reply(self) -> dict[str, Any]:
        reply: dict[str, Any] = orjson.loads(await asyncio.wait_for(self.reader.readline(), 10))
        return reply


@asynccontextmanager
async def broker(tmp_path: Path, **options: Any) -> AsyncIterator[tuple[Broker, Socket]]:
    """A started broker with an echo tool and a client-executed tool, and a connection to it."""
    manifest = await ManifestCache(b"k" * 32).compile([ECHO_TOOL, CLIENT_TOOL], "pytest")
    endpoints = EndpointClients(30.0, 8 * 1024 * 1024, EgressPolicy([]))
    config = BrokerConfig(
        10_000,
        1024 * 1024,
        options.pop("max_record_bytes", 1 << 30),
        max_in_flight_bytes=options.pop("max_in_flight_bytes", UNBOUNDED),
    )
    memory = options.pop("memory", None) or CallMemory(UNBOUNDED, UNBOUNDED)
    b = Broker(manifest.tools, BrokerShared(endpoints, memory=memory), config, **options)
    await asyncio.to_thread(tmp_path.mkdir, parents=True, exist_ok=True)
    path = tmp_path / "tools.sock"
    await b.start(path)
    reader, writer = await asyncio.open_unix_connection(str(path), limit=16 * 1024 * 1024)
    try:
        yield b, Socket(reader, writer)
    finally:
        writer.close()
        await b.close()
        await endpoints.aclose()


def decoded(record: dict[str, Any]) -> dict[str, Any]:
    """A record as the API shows it (its fragments decoded)."""
    value: dict[str, Any] = orjson.loads(render.encode_record(record))
    return value


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met within 2 s")


async def test_records_past_the_job_cap_keep_the_call_but_not_its_arguments_or_result(tmp_path: Path) -> None:
    args = {"x": "y" * 1000}  # 1,008 bytes of JSON; the echo result {"tool":"echo","args":...} is 1,031
    async with broker(tmp_path, max_record_bytes=3000) as (b, sock):
        for i in range(4):
            await sock.send(i, "echo", args)
            reply = await sock.reply()
            assert reply["ok"] and reply["result"] == {"tool": "echo", "args": args}  # the script gets it all
        records = [decoded(r) for r in b.records.calls]
    assert [r["status"] for r in records] == ["ok"] * 4
    assert records[0]["args"] == args and records[0]["result"] == {"tool": "echo", "args": args}
    assert records[0]["args_dropped_bytes"] is None and records[0]["result_dropped_bytes"] is None
    # the first call keeps 1,008 + 1,031 bytes; 1,008 more would pass 3,000, so from the second call on:
    for record in records[1:]:
        assert record["tool"] == "echo" and record["duration_ms"] is not None
        assert record["args"] is None and record["args_dropped_bytes"] == 1008
        assert record["result"] is None and record["result_dropped_bytes"] == 1031


async def test_records_hold_raw_json_not_python_objects(tmp_path: Path) -> None:
    async with broker(tmp_path) as (b, sock):
        await sock.send(1, "echo", {"items": [{"k": i} for i in range(1000)]})
        await sock.reply()
        record = b.records.calls[0]
    assert isinstance(record["args"], orjson.Fragment) and isinstance(record["result"], orjson.Fragment)
    assert decoded(record)["args"]["items"][999] == {"k": 999}


async def test_the_service_wide_record_cap_spans_jobs_and_is_returned_when_a_job_ends(tmp_path: Path) -> None:
    memory = CallMemory(max_record_bytes=2500, max_in_flight_bytes=1 << 30)
    args = {"x": "y" * 1000}
    async with broker(tmp_path / "a", memory=memory) as (first, sock):
        await sock.send(1, "echo", args)
        await sock.reply()
        assert memory.record_bytes == 1008 + 1031
        async with broker(tmp_path / "b", memory=memory) as (second, other):
            await other.send(1, "echo", args)
            assert (await other.reply())["ok"]
            assert (
                decoded(second.records.calls[0])["args_dropped_bytes"] == 1008
            )  # the first job holds the service's cap
        first.records.release()
        assert memory.record_bytes == 0


async def test_calls_past_the_service_wide_bytes_in_flight_are_refused_as_rejected(tmp_path: Path) -> None:
    memory = CallMemory(max_record_bytes=1 << 30, max_in_flight_bytes=1500)
    async with broker(tmp_path, memory=memory) as (b, sock):
        await sock.send(1, "ask", {"q": "x" * 1000})  # waits for the client: stays in flight
        await until(lambda: bool(b.paused.pending_calls))
        await sock.send(2, "echo", {"q": "x" * 1000})
        refused = await sock.reply()
        assert refused["id"] == 2 and refused["error"]["type"] == "limit_exceeded"
        record = decoded(b.records.calls[1])
        assert record["status"] == "rejected" and record["error"]["type"] == "limit_exceeded"
        assert record["args"] is None and record["args_dropped_bytes"] > 1000
        b.paused.answer_client_call(b.paused.pending_calls[0]["call_id"], True, 42)
        assert (await sock.reply())["result"] == 42
        await sock.send(3, "echo", {"q": "x" * 1000})  # room again
        assert (await sock.reply())["ok"]
    assert memory.in_flight_bytes == 0


async def test_a_job_past_its_bytes_in_flight_is_not_read_until_calls_end(tmp_path: Path) -> None:
    async with broker(tmp_path, max_in_flight_bytes=2000) as (b, sock):
        for i in range(3):
            await sock.send(i, "ask", {"q": "x" * 900})  # ~940 bytes a line: two fit, the third waits
        await until(lambda: len(b.paused.pending_calls) == 2)
        await asyncio.sleep(0.2)
        assert len(b.records.calls) == 2  # the third line is not read
        b.paused.answer_client_call(b.paused.pending_calls[0]["call_id"], True, None)
        await until(lambda: len(b.records.calls) == 3)


async def test_client_calls_show_their_arguments_even_when_the_record_drops_them(tmp_path: Path) -> None:
    async with broker(tmp_path, max_record_bytes=0) as (b, sock):
        await sock.send(1, "ask", {"q": "where?"})
        await until(lambda: bool(b.paused.pending_calls))
        pending = b.paused.pending_calls[0]
        assert orjson.loads(orjson.dumps(pending["args"])) == {"q": "where?"}
        assert b.records.calls[0]["args"] is None and b.records.calls[0]["args_dropped_bytes"] == len(b'{"q":"where?"}')


def job_view(calls: list[dict[str, Any]]) -> dict[str, Any]:
    view = {
        "job_id": "job_1",
        "status": "succeeded",
        "exit_code": 0,
        "stdout": "h\u00e9llo\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "stdout_bytes": 7,
        "stderr_bytes": 0,
        "stdout_invalid_utf8": False,
        "stderr_invalid_utf8": False,
        "calls_over_limit": 0,
        "error": None,
        "metadata": {"calls": [1], "pending_calls": "x"},
        "created_at": "2026-01-01T00:00:00Z",
        "started_at": None,
        "ended_at": None,
        "duration_ms": None,
        "queue_ms": None,
        "calls": calls,
    }
    return view


async def test_an_encoded_view_is_the_job_view_and_scans_back_to_the_same_records() -> None:
    records = [
        {"seq": i, "tool": "t", "args": orjson.Fragment(orjson.dumps({"s": "\u20ac" * i, "calls": [{"seq": 9}]}))}
        for i in range(1, 50)
    ]
    view = job_view(records)
    encoded = await render.encode(render.render_head(view), records)
    parsed = orjson.loads(encoded.body)
    assert parsed["calls"] == [orjson.loads(render.encode_record(r)) for r in records]
    assert parsed["pending_calls"] == [] and parsed["metadata"] == view["metadata"]
    assert [orjson.loads(bytes(r)) for r in encoded.records()] == parsed["calls"]
    head, spans = render.scan(encoded.body)
    assert spans == encoded.spans and head == encoded.head
    streamed = b"".join([piece async for piece in render.stream(render.render_head(view), [], records)])
    assert streamed == encoded.body


def test_a_stored_view_in_the_old_key_order_scans_too() -> None:
    body = orjson.dumps({"job_id": "j", "calls": [{"seq": 1, "args": {"a": "]},"}}, {"seq": 2}], "status": "ok"})
    head, spans = render.scan(body)
    assert head == {"job_id": "j", "status": "ok"}
    assert [orjson.loads(body[a:b]) for a, b in spans] == [{"seq": 1, "args": {"a": "]},"}}, {"seq": 2}]


def test_the_view_cache_keeps_the_latest_views_up_to_its_bytes() -> None:
    cache = render.ViewCache(250)
    for name in "abc":
        cache.put(name, render.EncodedView({}, b"x" * 100, []))
    assert cache.get("a") is None and cache.get("b") is not None and cache.get("c") is not None
    cache.put("big", render.EncodedView({}, b"x" * 300, []))  # larger than the cache: not kept
    assert cache.get("big") is None and cache.get("b") is not None


"""Generous: /healthz answers in milliseconds when the event loop is free; on main it took 5-22 s here."""


"""The default caps: 16 MiB of records kept per job, 8 MiB of requests in flight; main grew by ~560 MiB here."""


"""Generous: each reader that does not read may hold about one 256 KiB slice (plus the transport's 64 KiB);
on main each held the whole range, 16 MiB here (~14.6 MB each measured: ~350 MB for 24 readers)."""
