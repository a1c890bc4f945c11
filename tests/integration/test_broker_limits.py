"""One job cannot hurt the service or other jobs through its broker, and its records are final once it ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import execute, start_service
from tests.probe import probed
from tests.toolserver import ToolServer

ECHO = {"kind": "echo"}


def nested(levels: int) -> list[object]:
    value: list[object] = []
    for _ in range(levels):
        value = [value]
    return value


def test_deeply_nested_arguments_are_rejected_not_fatal(api: httpx.Client) -> None:
    script = (
        "import tools\nv = []\nfor _ in range(300):\n    v = [v]\n"
        "try:\n    tools.f(x=v)\nexcept tools.ToolError as e:\n    print(e.type)\n"
    )
    view = execute(api, script, [{"name": "f", "endpoint": ECHO}], timeout_s=20)
    assert (view["status"], view["stdout"]) == ("succeeded", "invalid_arguments\n")
    assert view["calls"][0]["status"] == "rejected"


def test_records_are_final_when_the_job_ends(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [{"name": "slow", "endpoint": {"kind": "http", "url": tool_server.url("hang"), "timeout_s": 20}}]
    script = (
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('/run/ptc/tools.sock')\n"
        's.sendall(b\'\'.join(b\'{"id":%d,"tool":"slow","args":{}}\\n\' % i for i in range(3000)))\n'
    )
    before = len(tool_server.requests)
    started = time.monotonic()
    view = execute(api, script, tools, timeout_s=10)
    assert time.monotonic() - started < 10
    assert view["status"] == "succeeded"
    assert view["calls"], "some calls reached the broker before the script ended"
    assert all(c["status"] == "error" and c["error"]["type"] == "cancelled" for c in view["calls"])
    time.sleep(1.5)
    again = api.get(f"/jobs/{view['job_id']}").json()
    assert again == view
    assert len(tool_server.requests) - before <= 64  # at most MAX_ENDPOINT_CALLS ever reached the endpoint
    settled = len(tool_server.requests)
    time.sleep(1)
    assert len(tool_server.requests) == settled


def test_connections_per_job_are_capped(api: httpx.Client) -> None:
    script = (
        "import socket\nopen_ = []\n"
        "for _ in range(100):\n"
        "    s = socket.socket(socket.AF_UNIX)\n    s.connect('/run/ptc/tools.sock')\n    open_.append(s)\n"
        "import time\ntime.sleep(0.5)\nclosed = 0\n"
        "for s in open_:\n    s.setblocking(False)\n"
        "    try:\n        closed += s.recv(1) == b''\n    except BlockingIOError:\n        pass\n"
        "print(closed)\n"
    )
    view = execute(api, script, timeout_s=20)
    assert view["status"] == "succeeded", view
    assert int(view["stdout"]) >= 100 - 32


def test_endpoint_timeout_bounds_the_whole_call(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [{"name": "trickle", "endpoint": {"kind": "http", "url": tool_server.url("trickle"), "timeout_s": 2}}]
    script = "import tools\ntry:\n    tools.trickle()\nexcept tools.ToolError as e:\n    print(e.type)\n"
    started = time.monotonic()
    view = execute(api, script, tools, timeout_s=20)
    assert time.monotonic() - started < 6
    assert view["stdout"] == "timeout\n"


def test_the_scripts_last_report_wins(api: httpx.Client) -> None:
    script = (
        "from ptc_runtime.client import client\n"
        "client().request({'op': 'report', 'error': {'type': 'timeout', 'message': 'forged'}})\n"
        "raise ValueError('real')\n"
    )
    view = execute(api, script)
    assert view["error"]["type"] == "nonzero_exit" and view["error"]["script_report"]["type"] == "ValueError"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"limits": {"cpus": 1e-9}}, "limits.cpus"),
        ({"limits": {"cpus": 512}}, "limits.cpus"),
        ({"metadata": {"x": "\ud800"}}, "metadata"),
        ({"metadata": {"x": nested(40)}}, "metadata"),
    ],
)
def test_limits_and_metadata_that_cannot_work_get_422(api: httpx.Client, body: dict[str, object], field: str) -> None:
    content = json.dumps({"script": "print(1)", **body}).encode()  # stdlib json writes a lone surrogate as \ud800
    response = api.post("/execute", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(field)


REDOS_TOOL = {
    "name": "slow",
    "parameters": {"type": "object", "patternProperties": {"^(a|a)+$": {}}, "additionalProperties": True},
    "endpoint": {"kind": "echo"},
}


def test_regex_costs_refuse_the_call_and_the_script_goes_on(api: httpx.Client) -> None:
    # Before: the timeout escaped the check (no reply: the script blocked until timeout_s, record "pending"), and
    # 1,500 keys took 52 s of CPU in one check. Now both are refusals within the budget (PTC_VALIDATION_BUDGET_S, 1 s).
    script = (
        "import tools\n"
        "for args in ({'a' * 25 + 'b': 1}, {'a' * 16 + 'b' + str(i): 1 for i in range(1500)}):\n"
        "    try:\n        tools.slow(**args)\n    except tools.ToolError as e:\n        print(e.type)\n"
        "print('went on')\n"
    )
    started = time.monotonic()
    view = execute(api, script, [REDOS_TOOL], timeout_s=60)
    assert time.monotonic() - started < 30  # generous: two checks of at most ~1 s of CPU each
    assert (view["status"], view["stdout"]) == ("succeeded", "limit_exceeded\nlimit_exceeded\nwent on\n"), view
    assert [(c["status"], c["error"]["type"]) for c in view["calls"]] == [("rejected", "limit_exceeded")] * 2


def test_healthz_stays_responsive_while_a_jobs_http_tool_returns_8_mib(
    api: httpx.Client, tool_server: ToolServer
) -> None:
    tool = {"name": "big", "endpoint": {"kind": "http", "url": tool_server.url("nested"), "timeout_s": 60}}
    script = (  # 8 calls at once on the raw socket; the replies are read, not parsed (the sandbox's memory)
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('/run/ptc/tools.sock')\nf = s.makefile('rb')\n"
        's.sendall(b\'\'.join(b\'{"id":%d,"tool":"big","args":{}}\\n\' % i for i in range(8)))\n'
        "lines = [f.readline() for _ in range(8)]\n"
        # A loaded host may take more than the check's CPU budget (1 s) for a result: refused, after the work
        "print(sum(len(line) > 8_000_000 or b'limit_exceeded' in line for line in lines))\n"
    )
    view, probe = probed(str(api.base_url), lambda: execute(api, script, [tool], timeout_s=60), 30)
    samples = probe.latencies
    assert (view["status"], view["stdout"]) == ("succeeded", "8\n"), view
    # Before: one stall of 12.5 s (fixed). Then lone outliers of 2.5-4.7 s on loaded CI machines: the probe, a thread
    # of this process, was timing this test's own parse of the 8 MiB view (tests/probe.py); it has a process of its
    # own now. One cause in the service too: collections walking the parsed results' million objects with the event
    # loop waiting (~150 ms each; tests/unit/test_result_collector.py). The worst here: 0.18-0.30 s.
    # On failure: the probe process's own worst scheduling lateness too (a loaded host delays every process).
    assert len(samples) > 2 and max(samples) < 2.0, (len(samples), sorted(samples)[-5:], sorted(probe.stalls)[-3:])


def test_records_past_the_record_cap_keep_the_call_but_not_its_data(scratch: Path) -> None:
    svc = start_service("pytest-budget", scratch / "budget", PTC_MAX_RECORD_BYTES="100000")
    try:
        with svc.client() as api:
            script = "import tools\nfor i in range(10):\n    print(len(tools.f(x='y' * 20000)['args']['x']))\n"
            view = execute(api, script, [{"name": "f", "parameters": {"properties": {"x": {}}}, "endpoint": ECHO}])
            assert view["status"] == "succeeded"
            assert view["stdout"] == "20000\n" * 10  # every call worked: the cap thins records, not calls
            assert [c["status"] for c in view["calls"]] == ["ok"] * 10
            kept = [c for c in view["calls"] if c["args"] is not None]
            dropped = [c for c in view["calls"] if c["args_dropped_bytes"] is not None]
            assert kept and dropped and len(kept) + len(dropped) == 10
            assert kept[0]["args"] == {"x": "y" * 20000} and kept[0]["result"]["args"] == {"x": "y" * 20000}
            assert all(c["args"] is None and c["args_dropped_bytes"] == len('{"x":""}') + 20000 for c in dropped)
            assert all(c["result"] is None and c["result_dropped_bytes"] > 20000 for c in dropped)
    finally:
        svc.stop()
