"""Issue 14's review against the real service and engine: hostile or buggy clients and a script that floods
short approval waits. Bodies the stdlib reads and orjson cannot write and the ``Idempotency-Key`` sent twice get
problems; a client that leaves mid-body and pipelined requests never reach the error log; a script whose gated
calls each time out after 1 ms does not log (nor save) a status change per call. One service of this module's
own, one sandbox (a one-shot job of 200 echo calls)."""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from tests.conftest import Service, start_service

PROBLEMS = "tag:ptc-sandbox.dev,2026:problems/"


@pytest.fixture(scope="module")
def svc(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    service = start_service(f"pytest-hostile-{secrets.token_hex(4)}", scratch / "hostile", PTC_WARM_POOL_SIZE="0")
    yield service
    service.stop()


def raw(svc: Service, data: bytes, read_s: float = 10.0) -> bytes:
    """Send ``data`` on a new connection; everything read until the service closes it (or ``read_s``)."""
    host, port = svc.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=read_s) as conn:
        conn.sendall(data)
        out = b""
        try:
            while chunk := conn.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def log_lines(svc: Service) -> list[dict[str, object]]:
    return [json.loads(line) for line in svc.log().splitlines() if line.startswith("{")]


def test_hostile_bodies_and_headers_get_problems_and_log_no_error(svc: Service) -> None:
    with svc.client() as api:
        body = '{"script":"print(1)","tools":[{"name":"t","x":NaN,"y":100000000000000000000000000}]}'
        headers = {"content-type": "application/json", "Idempotency-Key": "nan-big"}
        answer = api.post("/execute", content=body, headers=headers)
        assert answer.status_code == 422, answer.text
        assert answer.json()["type"] == PROBLEMS + "invalid-manifest"
        twice = api.post(
            "/execute", json={"script": "print(1)"}, headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
        )
        assert twice.status_code == 422 and twice.json()["errors"][0]["loc"] == ["header", "Idempotency-Key"]
    token = svc.token.encode()
    head = b"POST /execute HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\r\n"
    for _ in range(3):  # leaves after half its body
        host, port = svc.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(head + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"scr')
            time.sleep(0.2)
    pipelined = raw(
        svc,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2 + b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    assert [pipelined[i + 9 : i + 12] for i in range(len(pipelined)) if pipelined.startswith(b"HTTP/1.1 ", i)] == [
        b"200",
        b"200",
        b"401",
    ]
    with svc.client() as api:
        assert api.get("/healthz").status_code == 200
    errors = [line for line in log_lines(svc) if line.get("level") == "error"]
    assert errors == [], errors
    statuses = [
        line.get("status")
        for line in log_lines(svc)
        if line.get("event") == "request" and line.get("path") == "/execute"
    ]
    assert 500 not in statuses and statuses.count(400) == 3, statuses


def test_a_script_flooding_short_approval_waits_logs_few_status_changes(svc: Service) -> None:
    calls = 200
    tools = [{"name": "w", "approval": "always", "approval_timeout_s": 0.001, "endpoint": {"kind": "echo"}}]
    script = (
        f"import tools\nfor i in range({calls}):\n    try:\n        tools.w()\n"
        "    except tools.ToolError as e:\n        assert e.type == 'approval_timeout', e.type\nprint('done')\n"
    )
    with svc.client() as api:
        job = api.post("/execute", json={"script": script, "tools": tools, "wait_s": 0}).json()
        deadline = time.monotonic() + 120
        while job["status"] in ("queued", "running", "waiting") and time.monotonic() < deadline:
            time.sleep(0.2)
            job = api.get(f"/jobs/{job['job_id']}").json()
        assert (job["status"], job["stdout"], len(job["calls"])) == ("succeeded", "done\n", calls), job
        listed = api.get("/jobs", params={"status": "succeeded"}).json()["jobs"]
        assert job["job_id"] in [j["job_id"] for j in listed]
    changes = [line for line in log_lines(svc) if line.get("event") == "job" and line.get("job_id") == job["job_id"]]
    assert len(changes) < calls // 2, len(changes)  # a running/waiting flip per call and a save each, before
