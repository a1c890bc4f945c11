"""A tool call that its script abandons never wedges the later ones (issue 24, item 3).

A call can end early: a ``signal.alarm`` handler raises, ``KeyboardInterrupt`` arrives, an ``asyncio`` task is
cancelled, the thread making it dies of an injected exception. Before, such a call stayed the reader of the
broker's socket: the next call never returned (its record said ``ok``) and the job ended ``timed_out``. Each
script here abandons a call to a tool that answers late (``/hang``, cut by its 1.5 s timeout: the late answer
comes while the script still runs, and must be dropped), then makes calls that must return their own values.
Both runtimes, the real service and a real HTTP tool server.
"""

from __future__ import annotations

import textwrap
from typing import Any

import httpx
import pytest

from tests.conftest import execute
from tests.toolserver import ToolServer

LATE_S = 1.5  # the abandoned call's timeout: its late answer comes this long after it was made


def manifest(tool_server: ToolServer) -> list[dict[str, Any]]:
    return [
        {"name": "hang", "endpoint": {"kind": "http", "url": tool_server.url("hang"), "timeout_s": LATE_S}},
        {
            "name": "echo",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        },
    ]


SCRIPTS = {
    "signal_alarm_handler_raises": """
        import signal, time, tools

        class Deadline(Exception):
            pass

        def on_alarm(signum, frame):
            raise Deadline()

        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(1)
        try:
            tools.hang()
        except Deadline:
            print("abandoned")
        print(tools.echo(n=1))
        time.sleep(LATE_S + 1)  # the abandoned call's late answer comes meanwhile, and is dropped
        print(tools.echo(n=2))
        """,
    "keyboard_interrupt_from_sigint": """
        import os, signal, threading, time, tools

        threading.Timer(1, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            tools.hang()
        except KeyboardInterrupt:
            print("abandoned")
        print(tools.echo(n=1))
        time.sleep(LATE_S + 1)
        print(tools.echo(n=2))
        """,
    "raise_signal_in_a_handler_chain": """
        import signal, threading, time, tools

        def on_usr1(signum, frame):
            signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt, raised by the default SIGINT handler

        signal.signal(signal.SIGUSR1, on_usr1)
        threading.Timer(1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1)).start()
        try:
            tools.hang()
        except KeyboardInterrupt:
            print("abandoned")
        print(tools.echo(n=1))
        time.sleep(LATE_S + 1)
        print(tools.echo(n=2))
        """,
    "asyncio_task_cancelled": """
        import asyncio, tools

        async def main():
            try:
                await asyncio.wait_for(tools.aio.hang(), 1)
            except asyncio.TimeoutError:
                print("abandoned")
            print(await tools.aio.echo(n=1))
            await asyncio.sleep(LATE_S + 1)
            print(await tools.aio.echo(n=2))

        asyncio.run(main())
        """,
    "thread_dies_mid_call": """
        import ctypes, threading, time, tools

        class Stop(Exception):
            pass

        calling = threading.Event()
        died = []

        def worker():
            try:
                calling.set()
                tools.hang()
            except Stop:
                died.append("abandoned")

        thread = threading.Thread(target=worker)
        thread.start()
        calling.wait()
        time.sleep(0.3)  # the worker's call is sent and waits
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Stop))
        print(tools.echo(n=1))
        thread.join()  # it dies of Stop once its call's late answer wakes it
        print(*died)
        print(tools.echo(n=2))
        """,
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_an_abandoned_call_leaves_later_calls_working(
    runtime_api: httpx.Client, tool_server: ToolServer, name: str
) -> None:
    script = textwrap.dedent(SCRIPTS[name]).lstrip().replace("LATE_S", repr(LATE_S))
    view = execute(runtime_api, script, manifest(tool_server), timeout_s=10)
    assert view["status"] == "succeeded", view  # before: timed_out, the first echo never returned
    lines = view["stdout"].splitlines()
    assert lines.count("abandoned") == 1, view
    assert [line for line in lines if line != "abandoned"] == ["{'args': {'n': 1}}", "{'args': {'n': 2}}"], view
    echoes = [call for call in view["calls"] if call["tool"] == "echo"]
    assert [call["status"] for call in echoes] == ["ok", "ok"], view["calls"]


def test_a_signal_handler_may_call_a_tool_while_a_call_waits(
    runtime_api: httpx.Client, tool_server: ToolServer
) -> None:
    script = textwrap.dedent(
        """
        import signal, tools

        def on_alarm(signum, frame):
            print("in the handler:", tools.echo(n=1))

        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(1)
        try:
            tools.hang()
        except tools.ToolError as exc:
            print(exc.type)
        print(tools.echo(n=2))
        """
    ).lstrip()
    view = execute(runtime_api, script, manifest(tool_server), timeout_s=10)
    assert view["status"] == "succeeded", view  # before: timed_out, the handler's call waited for its own thread
    assert view["stdout"].splitlines() == ["in the handler: {'args': {'n': 1}}", "timeout", "{'args': {'n': 2}}"]


def test_a_signal_handler_may_call_a_tool_while_a_big_call_is_being_sent(
    runtime_api: httpx.Client, tool_server: ToolServer
) -> None:
    """Review of issue 24 item 3: a handler that calls a tool, run over and over while 1 MB calls are being sent.
    Before, the handler's line was written into the middle of the big one (the broker answered neither, the job
    timed out), and a handler's call during the first connect opened a second connection (two reader threads)."""
    script = textwrap.dedent(
        """
        import signal, threading, time, tools

        busy = [False]
        got = []

        def on_usr1(signum, frame):
            if busy[0]:
                return
            busy[0] = True
            try:
                got.append(tools.fetch(url="h"))
            finally:
                busy[0] = False

        signal.signal(signal.SIGUSR1, on_usr1)
        main = threading.get_ident()

        def poke():
            while True:
                time.sleep(0.0005)
                signal.pthread_kill(main, signal.SIGUSR1)

        threading.Thread(target=poke, daemon=True).start()
        sizes = [len(tools.fetch(url="x" * 1000000)["args"]["url"]) for _ in range(10)]
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        print(sizes)
        print(len(got), all(answer == {"args": {"url": "h"}} for answer in got))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # a discarded second connection's reader ends at once
            readers = [t for t in threading.enumerate() if t.name == "ptc-broker-reader"]
            if len(readers) == 1:
                break
            time.sleep(0.05)
        print("readers", len(readers))
        """
    ).lstrip()
    tools = [
        {
            "name": "fetch",
            "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        }
    ]
    view = execute(runtime_api, script, tools, timeout_s=20)
    assert view["status"] == "succeeded", view  # before: timed_out
    sizes, handled, readers = view["stdout"].splitlines()
    assert sizes == repr([1000000] * 10), view["stdout"]
    count, right = handled.split()
    assert right == "True" and readers == "readers 1", view["stdout"]
    calls = view["calls"]
    assert len(calls) == 10 + int(count) and all(call["status"] == "ok" for call in calls), calls
