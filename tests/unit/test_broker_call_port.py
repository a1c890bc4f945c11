"""The broker's in-process call port (``Broker.call``) meets the bounds of its socket (issue 25 review).

A call made through the port was read and answered at once: the socket's line cap (``max_line_bytes``: a longer
line closes its connection) and the job's bound on request bytes in flight (``max_in_flight_bytes``: past it the
broker reads no more) never applied to it. Both ports now share ``Connections``' intake. The socket's side is the
sandbox's own client (``ptc_runtime.client``), in a thread, so the two are compared as a script sees them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from service.broker import Broker, BrokerConfig, BrokerShared, CallMemory
from service.broker.config import UNBOUNDED
from service.broker.connection import CONNECTION_CLOSED
from service.toolkit.cache import ManifestCache
from service.toolkit.endpoints import EndpointClients
from tests.unit.test_load import until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sandbox_image"))  # the runtime, as in the image

from ptc_runtime.client import Client, ToolError

ANY_ARGS = {"type": "object", "additionalProperties": True}
TOOLS = [
    {"name": "echo", "parameters": ANY_ARGS, "endpoint": {"kind": "echo"}},
    {"name": "ask", "parameters": ANY_ARGS, "endpoint": {"kind": "client"}},
]
BIG = {"x": "y" * 100_000}  # a line of ~100 kB


@asynccontextmanager
async def broker(max_line_bytes: int = 1 << 20, max_in_flight_bytes: int = UNBOUNDED) -> AsyncIterator[Broker]:
    """A broker with an echo tool and a client-executed tool, within these bounds; not listening."""
    manifest = await ManifestCache(b"k" * 32).compile(TOOLS, "pytest")
    endpoints = EndpointClients(5.0, 1 << 20)
    config = BrokerConfig(10, max_line_bytes, 1 << 20, max_in_flight_bytes=max_in_flight_bytes)
    b = Broker(manifest.tools, BrokerShared(endpoints, memory=CallMemory(UNBOUNDED, UNBOUNDED)), config)
    try:
        yield b
    finally:
        await b.close()
        await endpoints.aclose()


def over_the_socket(path: Path, calls: list[dict[str, Any]]) -> list[Any]:
    """Make ``calls`` one after another with the sandbox's client; each one's result, or its ToolError's
    (type, message). Blocking: run it in a thread."""
    client = Client(str(path))
    outcomes: list[Any] = []
    try:
        for args in calls:
            try:
                outcomes.append(client.request({"tool": "echo", "args": args}))
            except ToolError as exc:
                outcomes.append((exc.type, exc.message))
    finally:
        if "live" in client._made:
            client._made["live"].sock.close()
    return outcomes


async def test_a_call_over_the_line_cap_is_refused_through_the_port_as_over_the_socket(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The call over ``max_line_bytes`` is not read nor recorded, the port is closed as its connection would be:
    it and the next call get what the sandbox's client gives a script once the broker closed its connection."""
    caplog.set_level(logging.INFO, logger="service.broker.connection")
    calls = [BIG, {"x": "small"}]
    async with broker(max_line_bytes=1024) as by_socket:
        await by_socket.start(tmp_path / "tools.sock")
        socket_outcomes = await asyncio.to_thread(over_the_socket, tmp_path / "tools.sock", calls)
        socket_records = list(by_socket.records.calls)
    socket_logged = caplog.messages
    caplog.clear()
    async with broker(max_line_bytes=1024) as in_process:
        replies = [await in_process.call("echo", args) for args in calls]
        port_records = list(in_process.records.calls)

    assert [reply["ok"] for reply in replies] == [False, False], "a call over max_line_bytes went through the port"
    port_outcomes = [(reply["error"]["type"], reply["error"]["message"]) for reply in replies]
    assert port_outcomes == [("broker_unavailable", CONNECTION_CLOSED)] * 2
    # Over the socket the client reads the broker's close as an end of file (or, when the kernel still held unread
    # bytes of the line, as a reset: "lost the connection to the broker: ..."): broker_unavailable either way.
    assert [kind for kind, _ in socket_outcomes] == ["broker_unavailable"] * 2, socket_outcomes
    assert all(m == CONNECTION_CLOSED or m.startswith("lost the connection to the broker") for _, m in socket_outcomes)
    assert socket_records == port_records == []  # no record: the line was never read
    assert socket_logged == ["broker: request line over 1024 bytes; closing the connection"]
    assert caplog.messages == ["broker: request line over 1024 bytes; closing the in-process call port"]


async def test_a_call_within_the_line_cap_still_goes_through_the_port() -> None:
    async with broker(max_line_bytes=1024) as b:
        reply = await b.call("echo", {"x": "y" * 900})  # a line of ~940 bytes
    assert reply == {"ok": True, "result": {"tool": "echo", "args": {"x": "y" * 900}}}
    assert [record["status"] for record in b.records.calls] == ["ok"]


async def test_calls_through_the_port_past_the_jobs_bytes_in_flight_wait_for_room() -> None:
    """As ``test_load.test_a_job_past_its_bytes_in_flight_is_not_read_until_calls_end`` over the socket: two calls
    of ~940 bytes fit in 2,000 bytes in flight, the third is not read until one of them ends."""
    async with broker(max_in_flight_bytes=2000) as b:
        calls = [asyncio.ensure_future(b.call("ask", {"q": "x" * 900, "i": i})) for i in range(3)]
        await until(lambda: len(b.paused.pending_calls) >= 2)
        await asyncio.sleep(0.2)
        assert len(b.records.calls) == 2 and not any(call.done() for call in calls)  # the third is not read
        b.paused.answer_client_call(b.paused.pending_calls[0]["call_id"], True, "first")
        await until(lambda: len(b.records.calls) == 3)
        for pending in list(b.paused.pending_calls):
            b.paused.answer_client_call(pending["call_id"], True, "later")
        replies = await asyncio.gather(*calls)
    assert [reply["ok"] for reply in replies] == [True] * 3


async def test_a_cancelled_call_through_the_port_gives_its_bytes_in_flight_back() -> None:
    """A script's call cancelled while it waits (the in-process engine's run stopped) leaves no bytes counted in
    flight: the call that waited for them is read."""
    async with broker(max_in_flight_bytes=2000) as b:
        first, second = (asyncio.ensure_future(b.call("ask", {"q": "x" * 900, "i": i})) for i in range(2))
        await until(lambda: len(b.paused.pending_calls) == 2)
        third = asyncio.ensure_future(b.call("ask", {"q": "x" * 900, "i": 2}))
        await asyncio.sleep(0.2)
        assert len(b.records.calls) == 2
        first.cancel()
        await until(lambda: len(b.records.calls) == 3)  # its room freed: the third is read
        for pending in list(b.paused.pending_calls):
            b.paused.answer_client_call(pending["call_id"], True, None)
        assert [(await call)["ok"] for call in (second, third)] == [True, True]
        assert first.cancelled()
