"""Structured logs: the formatter and events alone, then the events a real job produces (and what they leave out)."""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service import logs
from tests.conftest import ROOT, Service, execute, start_service, wait_until
from tests.toolserver import ToolServer


def events(service: Service) -> list[dict[str, Any]]:
    """The service's JSON log lines, parsed."""
    return [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(logs.JsonFormatter().format(record)))


@pytest.fixture
def captured() -> Iterator[Capture]:
    capture = Capture()
    logs.EVENTS.addHandler(capture)
    level = logs.EVENTS.level
    logs.EVENTS.setLevel(logging.INFO)
    yield capture
    logs.EVENTS.removeHandler(capture)
    logs.EVENTS.setLevel(level)


# -- alone --------------------------------------------------------------------------------------


def test_plain_records_become_json_lines_with_their_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        record = logging.LogRecord("service.jobs", logging.ERROR, __file__, 1, "job %s failed", ("j1",), None)
        record.exc_info = (type(exc), exc, exc.__traceback__)
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["level"] == "error" and line["logger"] == "service.jobs" and line["event"] == "log"
    assert line["msg"] == "job j1 failed"
    assert "ValueError: boom" in line["exc"]
    assert line["ts"].endswith("+00:00")


def test_events_carry_their_fields_and_render_as_text(captured: Capture) -> None:
    logs.event("sandbox_start", job_id="job_1", mode="cold", start_ms=12.5)
    logs.event("tool_call", logging.DEBUG, args={"q": "hidden"})  # below the level: not emitted
    assert captured.lines == [
        {
            "ts": captured.lines[0]["ts"],
            "level": "info",
            "logger": "service.events",
            "event": "sandbox_start",
            "job_id": "job_1",
            "mode": "cold",
            "start_ms": 12.5,
        }
    ]
    text = logging.Formatter("%(message)s").format(
        logging.LogRecord(
            "e", logging.INFO, "", 0, "%s", (logs._Text("job", {"job_id": "j", "status": "queued"}),), None
        )
    )
    assert text == 'job job_id="j" status="queued"'


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_configure_writes_events_and_uvicorn_lines_to_stderr_in_the_chosen_format(fmt: str) -> None:
    code = (
        "import logging\nfrom service import logs\n"
        f"logs.configure('info', {fmt!r})\n"
        "logs.event('job', job_id='job_1', status='queued')\n"
        "logging.getLogger('uvicorn.error').info('started')\n"
        "logging.getLogger('httpx').info('HTTP Request: POST http://h/?key=k')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    lines = done.stderr.splitlines()
    assert done.stdout == "" and len(lines) == 2, done.stderr
    if fmt == "json":
        assert {k: json.loads(lines[0])[k] for k in ("event", "job_id", "status")} == {
            "event": "job",
            "job_id": "job_1",
            "status": "queued",
        }
        assert json.loads(lines[1])["msg"] == "started"
    else:
        assert lines[0].endswith('INFO service.events: job job_id="job_1" status="queued"')
        assert lines[1].endswith("INFO uvicorn.error: started")


def test_tool_call_summary_names_at_most_twenty_tools(captured: Capture) -> None:
    records = [{"tool": f"t{i}", "status": "ok", "duration_ms": 1.0, "args": {"secret": 1}} for i in range(25)]
    logs.tool_calls("job_1", None, records)
    (line,) = captured.lines
    assert line["calls"] == 25 and line["by_status"] == {"ok": 25}
    assert len(line["by_tool"]) == logs.SUMMARY_TOOLS + 1
    assert line["by_tool"]["other"] == {"ok": 5}
    assert line["call_ms_total"] == 25.0 and line["call_ms_max"] == 1.0
    assert "secret" not in json.dumps(line)


# -- a real service -----------------------------------------------------------------------------


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
    assert [(e["event"], e.get("status")) for e in mine] == [
        ("job", "queued"),
        ("job", "running"),
        ("sandbox_start", None),
        ("job", "failed"),
        ("tool_calls", None),
        ("request", 200),
        ("request", 200),
    ]  # the sandbox is removed after the answer: its sandbox_stop comes once that is done
    queued, running, start, ended, summary, post, get = mine
    assert queued["key"] == "pytest" and running["queue_ms"] >= 0  # the name of the test service's key
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
