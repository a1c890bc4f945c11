"""Issue 14 against the real engine and a real HTTP tool server: the event stream is cut mid-job and resumed with
``Last-Event-ID`` (the stdout received concatenates to the job's stdout byte for byte, every call arrives once,
though they end out of order), and ``calls=summary`` / ``calls=none`` carry no argument or result bytes while
the full view is unchanged."""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import wait_until
from tests.toolserver import ToolServer

Event = tuple[str, str, str]  # event, data, id


def tools(tool_server: ToolServer) -> list[dict[str, Any]]:
    return [
        {
            "name": "lookup",
            "parameters": {"properties": {"text": {"type": "string"}}},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        },
        {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}},
    ]


def script(marker: str) -> str:
    # stdout before, between and after the calls; three client calls in flight at once (answered out of order)
    return f"""
import asyncio, sys, tools
for i in range(200):
    print("before", i, "\\u00e9" * (i % 7))
for i in range(3):
    tools.lookup(text="{marker}-arg-" + str(i))
answers = await asyncio.gather(*(tools.aio.ask(q="{marker}-ask-" + str(i)) for i in range(3)))
for i in range(300):
    print("after", i, "\\u2603" * (i % 5))
    if i % 50 == 0:
        await asyncio.sleep(0.05)
print(len(answers), file=sys.stderr)
"""


def follow(api: httpx.Client, job_id: str, last_id: str | None, stop: Callable[[list[Event]], bool]) -> list[Event]:
    """Read the job's event stream (resuming after ``last_id``) until ``stop`` says so or it ends; disconnect."""
    headers = {"Last-Event-ID": last_id} if last_id else {}
    received: list[Event] = []
    fields: dict[str, str] = {}
    with api.stream("GET", f"/jobs/{job_id}/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line:
                if "data" in fields:
                    received.append((fields.get("event", "message"), fields["data"], fields.get("id", "")))
                    if received[-1][0] == "end" or stop(received):
                        break
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value[1:] if value.startswith(" ") else value
    return received


def test_a_dropped_event_stream_resumes_with_last_event_id(api: httpx.Client, tool_server: ToolServer) -> None:
    marker = secrets.token_hex(6)
    job = api.post("/execute", json={"script": script(marker), "tools": tools(tool_server), "wait_s": 0}).json()
    job_id = job["job_id"]
    received = follow(api, job_id, None, lambda got: sum(e == "stdout" for e, _, _ in got) >= 1)  # cut mid-output
    wait_until(lambda: len(api.get(f"/jobs/{job_id}").json()["pending_calls"]) == 3, 60)
    calls_so_far = sum(e == "call" for e, _, _ in received)  # the lookups that had ended before the cut
    if calls_so_far < 3:
        received += follow(
            api, job_id, received[-1][2], lambda got: sum(e == "call" for e, _, _ in got) == 3 - calls_so_far
        )
    pending = {c["args"]["q"]: c["call_id"] for c in api.get(f"/jobs/{job_id}").json()["pending_calls"]}
    for i in (2, 0, 1):  # they end out of order
        answer = api.post(f"/jobs/{job_id}/calls/{pending[f'{marker}-ask-{i}']}", json={"result": f"{marker}-res-{i}"})
        assert answer.status_code == 200, answer.text
        time.sleep(0.1)
        received += follow(api, job_id, received[-1][2], lambda got: any(e == "call" for e, _, _ in got))
    while received[-1][0] != "end":  # reconnect after every piece of output until the end
        received += follow(api, job_id, received[-1][2], lambda got: got[-1][0] in ("stdout", "stderr"))
    final = api.get(f"/jobs/{job_id}").json()
    assert final["status"] == "succeeded", final
    raw = api.get(f"/jobs/{job_id}/output/stdout", params={"length": 1 << 20}).content
    stdout = b"".join(json.loads(d)["text"].encode() for e, d, _ in received if e == "stdout")
    assert stdout == raw and len(raw) == final["stdout_bytes"]
    seqs = [json.loads(d)["seq"] for e, d, _ in received if e == "call"]
    assert sorted(seqs) == [1, 2, 3, 4, 5, 6] and seqs[:3] == [1, 2, 3], seqs
    assert seqs[3:] == [6, 4, 5]  # the order they ended in
    statuses = [json.loads(d)["status"] for e, d, _ in received if e == "status"]
    assert all(a != b for a, b in itertools.pairwise(statuses)), statuses
    assert [e for e, _, _ in received].count("end") == 1
    assert json.loads(received[-1][1]) == final
    # a reconnect after the end: nothing follows (an EventSource stops on 204)
    assert api.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": received[-1][2]}).status_code == 204
    # the views a harness hands to a model: no argument or result bytes
    full = api.get(f"/jobs/{job_id}").content
    assert marker.encode() + b"-arg-" in full and marker.encode() + b"-res-" in full
    assert api.get(f"/jobs/{job_id}", params={"calls": "full"}).content == full
    for mode in ("summary", "none"):
        for answer in (
            api.get(f"/jobs/{job_id}", params={"calls": mode}),
            api.post(f"/jobs/{job_id}/wait", params={"calls": mode}),
            api.get(f"/jobs/{job_id}/events", params={"calls": mode}),
        ):
            assert answer.status_code == 200 and marker.encode() not in answer.content, mode
        view = api.get(f"/jobs/{job_id}", params={"calls": mode}).json()
        assert view["calls_total"] == 6 and view["stdout"] == final["stdout"]
