"""Bad input of every kind: a clear result, no leaked sandbox, and a healthy service afterwards.

Hostile scripts (the isolation tests) take ``runtime_api`` and run under each
runtime of ``tests.conftest.RUNTIMES``: runc and gVisor (runsc).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, execute, labelled_containers, script_uids, wait_until
from tests.toolserver import ToolServer

ECHO = {"kind": "echo"}
AREA_TOOL = {
    "name": "calculate_triangle_area",
    "parameters": {
        "type": "dict",
        "properties": {"base": {"type": "integer"}, "height": {"type": "integer"}},
        "required": ["base", "height"],
    },
    "endpoint": ECHO,
}


@pytest.fixture(autouse=True)
def healthy_afterwards(request: pytest.FixtureRequest, engine: docker.DockerClient) -> Iterator[None]:
    """After each test: the service it used still runs scripts, and none of its sandboxes is left."""
    on_runtime = "runtime_api" in request.fixturenames
    api: httpx.Client = request.getfixturevalue("runtime_api" if on_runtime else "api")
    service: Service = request.getfixturevalue("runtime_service" if on_runtime else "service")
    yield
    view = execute(api, "print('still here')")
    assert (view["status"], view["stdout"]) == ("succeeded", "still here\n")
    wait_until(lambda: labelled_containers(engine, service.instance_id) == [], 10)  # removed after the answer


def test_syntax_error_is_a_failed_job_with_its_line(api: httpx.Client) -> None:
    view = execute(api, "x = 1\ndef f(:\n    pass\n")
    assert view["status"] == "failed"
    assert view["exit_code"] == 1
    assert view["error"]["type"] == "SyntaxError"
    assert view["error"]["line"] == 2
    assert view["error"]["text"] == "def f(:"
    assert "SyntaxError" in view["stderr"]


def test_uncaught_exception_reports_type_and_line(api: httpx.Client) -> None:
    view = execute(api, "a = 1\nb = 0\nprint(a / b)\n")
    assert view["status"] == "failed"
    assert view["error"]["type"] == "nonzero_exit"  # the service's observation; the traceback's summary beside it
    assert view["error"]["script_report"]["type"] == "ZeroDivisionError"
    assert view["error"]["script_report"]["line"] == 3


@pytest.mark.parametrize(
    ("call", "kind", "expected"),
    [
        ("tools.no_such_tool(x=1)", "unknown_tool", "no_such_tool"),
        ("tools.calculate_triangle_area(base=10)", "invalid_arguments", "'height'"),
        ("tools.calculate_triangle_area(base='ten', height=5)", "invalid_arguments", "'base'"),
        ("tools.calculate_triangle_area(base=1, height=2, colour='red')", "invalid_arguments", "'colour'"),
    ],
)
def test_rejected_calls_raise_catchable_tool_error(api: httpx.Client, call: str, kind: str, expected: str) -> None:
    if call.startswith("tools.no_such_tool"):  # not in the stubs: reach the broker the way a raw client would
        call = "from ptc_runtime.client import client\nclient().request({'tool': 'no_such_tool', 'args': {'x': 1}})"
    script = f"import tools\ntry:\n    {call.replace(chr(10), chr(10) + '    ')}\nexcept tools.ToolError as e:\n"
    script += "    print(e.type, '|', e.message)\n"
    view = execute(api, script, [AREA_TOOL])
    assert view["status"] == "succeeded", view
    assert view["stdout"].startswith(f"{kind} |")
    assert expected in view["stdout"]
    [record] = view["calls"]
    assert record["status"] == "rejected"
    assert record["error"]["type"] == kind


def test_missing_argument_passed_positionally_is_rejected_not_a_type_error(api: httpx.Client) -> None:
    view = execute(
        api,
        "import tools\ntry:\n    tools.calculate_triangle_area(3)\nexcept tools.ToolError as e:\n"
        "    print(e.message)\n",
        [AREA_TOOL],
    )
    assert "missing required argument 'height'" in view["stdout"]
    assert view["calls"][0]["args"] == {"base": 3}


def test_endless_loop_times_out_near_the_limit(runtime_api: httpx.Client) -> None:
    started = time.monotonic()
    view = execute(runtime_api, "while True:\n    pass\n", timeout_s=2)
    elapsed = time.monotonic() - started
    assert view["status"] == "timed_out"
    assert view["error"]["type"] == "timeout"
    assert elapsed < 2 + 2, elapsed


def test_ten_megabytes_of_output_are_capped_and_counted(runtime_api: httpx.Client) -> None:
    script = (
        "import sys\nfor i in range(100_000):\n    sys.stdout.write('%099d\\n' % i)\nsys.stderr.write('e' * 1000)\n"
    )
    view = execute(runtime_api, script)
    assert view["status"] == "succeeded"
    assert view["stdout_bytes"] == 10_000_000
    assert view["stdout_truncated"] is True
    assert len(view["stdout"].encode()) < 64 * 1024 + 100
    assert view["stdout"].startswith("0" * 99 + "\n")
    assert view["stdout"].endswith(f"{99_999:099d}\n")
    assert "bytes elided" in view["stdout"]
    assert (view["stderr"], view["stderr_bytes"], view["stderr_truncated"]) == ("e" * 1000, 1000, False)


def test_output_cap_is_settable_per_request(api: httpx.Client) -> None:
    view = execute(api, "print('a' * 5000)", limits={"output_bytes": 1024})
    assert view["stdout_truncated"] is True
    assert view["stdout_bytes"] == 5001
    assert view["stdout"].startswith("a" * 512) and view["stdout"].endswith("a" * 511 + "\n")


def test_final_line_without_newline_is_kept_exactly(api: httpx.Client) -> None:
    view = execute(api, 'print("done", end="")')
    assert view["stdout"] == "done"


def test_bytes_that_are_not_utf8_are_replaced_and_flagged(api: httpx.Client) -> None:
    view = execute(api, "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')\nprint('é', file=sys.stderr)")
    assert view["stdout"] == "ok \ufffd\ufffd end"
    assert view["stdout_bytes"] == 9
    assert view["stdout_invalid_utf8"] is True
    assert (view["stderr"], view["stderr_invalid_utf8"]) == ("é\n", False)


def test_input_gets_end_of_file(runtime_api: httpx.Client) -> None:
    started = time.monotonic()
    view = execute(runtime_api, "input()", timeout_s=20)
    assert time.monotonic() - started < 10
    assert view["status"] == "failed"
    assert view["error"]["script_report"]["type"] == "EOFError"


def test_memory_past_the_limit_is_oom_killed(runtime_api: httpx.Client) -> None:
    view = execute(
        runtime_api, "x = bytearray(b'1') * (300 * 1024 * 1024)\nprint('survived')", limits={"memory_mb": 128}
    )
    assert view["status"] == "oom_killed", view
    assert "survived" not in view["stdout"]


def test_fork_bomb_is_contained(runtime_api: httpx.Client) -> None:
    script = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    view = execute(runtime_api, script, timeout_s=3)
    # Under gVisor, forked interpreters copy more of their memory: the bomb may fill memory_mb before the process
    # limit (the engine then reports the sandbox OOM-killed); either way it ends within the job, as the job's.
    assert view["status"] in ("timed_out", "failed", "oom_killed"), view
    assert view["error"] is None or view["error"]["type"] != "sandbox_error", view


def test_sandbox_has_no_network_root_or_writable_root_fs(
    runtime_api: httpx.Client, engine: docker.DockerClient
) -> None:
    script = """
import os, socket
print("uid", os.getuid())
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    print("network: yes")
except OSError:
    print("network: no")
try:
    open("/etc/x", "w")
    print("rootfs: writable")
except OSError:
    print("rootfs: read-only")
open("/tmp/ok", "w").write("x")
print("tmp: writable")
print("caps", open("/proc/self/status").read().split("CapEff:")[1].split()[0])
"""
    view = execute(runtime_api, script)
    uid = int(view["stdout"].split("\n")[0].removeprefix("uid "))
    assert uid in script_uids(engine), view  # the sandbox's own uid (one of the image's range), never root
    assert view["stdout"].split("\n")[1:-1] == [
        "network: no",
        "rootfs: read-only",
        "tmp: writable",
        "caps 0000000000000000",
    ]


def test_tmp_is_size_capped(runtime_api: httpx.Client) -> None:
    script = "try:\n    open('/tmp/big', 'wb').write(b'x' * (20 * 1024 * 1024))\n    print('wrote')\n"
    script += "except OSError as e:\n    print('refused', e.errno)\n"
    view = execute(runtime_api, script, limits={"tmp_mb": 8})
    assert view["stdout"].startswith("refused")


def test_endpoint_that_hangs_becomes_a_timeout_tool_error(api: httpx.Client, tool_server: ToolServer) -> None:
    tools = [{"name": "slow", "endpoint": {"kind": "http", "url": tool_server.url("hang"), "timeout_s": 1}}]
    script = "import tools\ntry:\n    tools.slow()\nexcept tools.ToolError as e:\n    print(e.type)\n"
    started = time.monotonic()
    view = execute(api, script, tools, timeout_s=20)
    assert time.monotonic() - started < 10
    assert (view["status"], view["stdout"]) == ("succeeded", "timeout\n")
    assert view["calls"][0]["status"] == "timeout"


@pytest.mark.parametrize(
    ("route", "kind", "text"), [("fail", "http_error", "HTTP 500"), ("not_json", "bad_response", "not JSON")]
)
def test_endpoint_that_fails_becomes_a_tool_error(
    api: httpx.Client, tool_server: ToolServer, route: str, kind: str, text: str
) -> None:
    tools = [{"name": "broken", "endpoint": {"kind": "http", "url": tool_server.url(route)}}]
    script = "import tools\ntry:\n    tools.broken()\nexcept tools.ToolError as e:\n    print(e.type, e.message)\n"
    view = execute(api, script, tools)
    assert view["stdout"].startswith(kind) and text in view["stdout"]
    assert view["calls"][0]["status"] == "error"
    assert view["calls"][0]["error"]["type"] == kind


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"script": "print(1)"', "body"),
        (b'{"tools": []}', "script"),
        (b'{"script": 5}', "script"),
        (b'{"script": "x", "timeout_s": -1}', "timeout_s"),
        (b'{"script": "x", "limits": {"memory_mb": 1000000}}', "limits.memory_mb"),
        (b'{"script": "x", "tools": [{"name": "t"}]}', "tools.0.endpoint"),
        (b'{"script": "x", "tools": [{"name": "t", "endpoint": {"kind": "ftp"}}]}', "tools.0.endpoint.kind"),
        (b'{"script": "x", "env": {"PYTHONPATH": "/x"}}', "env"),
        (b'{"script": "x", "surprise": 1}', "surprise"),
    ],
)
def test_malformed_requests_get_422_naming_the_field(api: httpx.Client, body: bytes, field: str) -> None:
    response = api.post("/execute", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    assert problem["status"] == 422
    assert problem["detail"].startswith(field), problem


def test_huge_body_is_refused_with_413(api: httpx.Client) -> None:
    response = api.post(
        "/execute",
        content=b'{"script": "' + b"x" * (9 * 1024 * 1024) + b'"}',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    assert response.json()["title"] == "Request body too large"


def test_unknown_job_is_404(api: httpx.Client) -> None:
    response = api.get("/jobs/job_nope")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"


def test_broker_flood_blocks_only_the_flooding_script(runtime_api: httpx.Client) -> None:
    script = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect('/run/ptc/tools.sock')\n"
        's.sendall(b\'{"id": 1, "op": "report", "error": {"type": "Forged", "message": "x"}}\\n\')\n'
        's.sendall(b\'not json\\n[1]\\n{"id": [1], "tool": 5}\\n\')\n'
        "s.settimeout(3)\n"
        "try:\n"
        "    while True:\n"
        '        s.sendall(b\'{"id": 2, "tool": "t", "args": {}}\\n\' * 1000)  # never reads a reply\n'
        "except OSError:\n"
        "    print('blocked')\n"
    )
    tools = [{"name": "t", "endpoint": ECHO}]
    started = time.monotonic()
    view = execute(runtime_api, script, tools, timeout_s=20)
    assert time.monotonic() - started < 20
    assert view["stdout"] == "blocked\n"
    assert 0 < len(view["calls"]) <= 10_000
    assert all(c["tool"] == "t" for c in view["calls"])


def test_oversized_request_line_closes_the_connection(runtime_api: httpx.Client) -> None:
    script = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect('/run/ptc/tools.sock')\n"
        "try:\n"
        "    s.sendall(b'x' * (17 * 1024 * 1024))\n"
        "    print('closed' if s.recv(10) == b'' else 'open')\n"
        "except OSError:\n"
        "    print('closed')\n"
        "import tools\n"
        "print(tools.t()['tool'])\n"
    )
    view = execute(runtime_api, script, [{"name": "t", "endpoint": ECHO}], timeout_s=30)
    assert view["stdout"] == "closed\nt\n", view
