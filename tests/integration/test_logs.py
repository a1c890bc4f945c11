"""Structured logs: the formatter and events alone, then the events a real job produces (and what they leave out)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, execute, start_service, wait_until
from tests.toolserver import ToolServer


def events(service: Service) -> list[dict[str, Any]]:
    """The service's JSON log lines, parsed."""
    return [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]


def test_a_job_logs_its_events_and_never_its_source_arguments_results_or_output(
    service: Service, api: httpx.Client
) -> None:
    source, argument, printed, raised = (f"{kind}-{secrets.token_hex(6)}" for kind in ("src", "arg", "out", "exc"))
    script = (
        f"import tools  # {source}\ntools.lookup(q={argument!r})\nprint({printed!r})\nraise ValueError({raised!r})\n"
    )
    tools = [{"name": "lookup", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "echo"}}]
    view = execute(api, script, tools)
    job_id = view["job_id"]
    assert view["status"] == "failed" and view["calls"][0]["result"]["args"] == {"q": argument}
    assert api.get(f"/jobs/{job_id}").status_code == 200
    wait_until(
        lambda: any(
            e["event"] == "request" and e["path"] != "/execute" and e.get("job_id") == job_id for e in events(service)
        ),
        10,
    )

    wait_until(lambda: any(e["event"] == "sandbox_stop" and e.get("job_id") == job_id for e in events(service)), 10)
    mine = [e for e in events(service) if e.get("job_id") == job_id and e["event"] != "sandbox_stop"]
    [stop] = [e for e in events(service) if e.get("job_id") == job_id and e["event"] == "sandbox_stop"]
    if (mine[0]["event"], mine[0].get("status")) == ("job", "queued"):  # only when its sandbox took over 5 ms
        assert mine.pop(0)["key"] == "pytest"
    assert [(e["event"], e.get("status")) for e in mine] == [
        ("job", "running"),
        ("sandbox_start", None),
        ("job", "failed"),
        ("tool_calls", None),
        ("request", 200),
        ("request", 200),
    ]  # the sandbox is removed after the answer: its sandbox_stop comes once that is done
    running, start, ended, summary, post, get = mine
    assert running["key"] == "pytest" and running["queue_ms"] >= 0  # the name of the test service's key
    assert (
        start["mode"] == view["sandbox_start"] and start["sandbox_id"] == view["sandbox_id"] and start["start_ms"] > 0
    )
    assert stop["reason"] == "failed" and stop["stop_ms"] > 0
    assert ended["exit_code"] == 1 and ended["error_type"] == "nonzero_exit"
    assert ended["script_error_type"] == "ValueError"  # the script's own claim, labelled as such
    assert ended["duration_ms"] == view["duration_ms"] and ended["calls"] == 1
    assert summary["by_tool"] == {"lookup": {"ok": 1}}
    assert (post["method"], post["route"], get["method"], get["route"]) == ("POST", "/execute", "GET", "/jobs/{job_id}")
    assert post["duration_ms"] >= view["duration_ms"] and post["key"] == "pytest"
    log = service.log()
    for hidden in (source, argument, printed, raised):
        assert hidden not in log


@pytest.fixture(scope="module")
def debug_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / "debuglog",
        PTC_LOG_LEVEL="debug",
        PTC_WARM_POOL_SIZE="0",
        PTC_CALLBACK_SECRET="cbsecret-" + secrets.token_hex(8),
    )
    yield svc
    svc.stop()


def test_debug_logs_add_arguments_and_results_but_never_secrets(
    debug_service: Service, tool_server: ToolServer
) -> None:
    token, argument = f"tok-{secrets.token_hex(8)}", f"arg-{secrets.token_hex(6)}"
    tools = [
        {"name": "lookup", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "echo"}},
        {
            "name": "guarded",
            "endpoint": {
                "kind": "http",
                "url": tool_server.url("auth_echo"),
                "headers": {"Authorization": f"Bearer {token}"},
            },
        },
    ]
    script = (
        f"import tools\ntools.lookup(q={argument!r})\ntry:\n    tools.guarded()\nexcept tools.ToolError:\n    pass\n"
    )
    with debug_service.client() as api:
        view = execute(api, script, tools)
        assert view["status"] == "succeeded"
        assert api.get("/healthz").status_code == 200
    calls = [e for e in events(debug_service) if e["event"] == "tool_call" and e["job_id"] == view["job_id"]]
    assert [(c["tool"], c["status"], c["level"]) for c in calls] == [
        ("lookup", "ok", "debug"),
        ("guarded", "error", "debug"),
    ]
    assert calls[0]["args"] == {"q": argument} and calls[0]["result"] == {"tool": "lookup", "args": {"q": argument}}
    assert "[redacted]" in calls[1]["error"]["message"]
    wait_until(  # the request event is written once the answer has gone out
        lambda: any(
            e["event"] == "request" and e["route"] == "/healthz" and e["level"] == "debug"
            for e in events(debug_service)
        ),
        10,
    )
    log = debug_service.log()
    assert token not in log
    assert "HTTP Request:" not in log  # httpx's own line per request, with the endpoint's full URL
    assert "cbsecret-" not in log
