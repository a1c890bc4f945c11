"""Structured logs: the formatter and events alone, then the events a real job produces (and what they leave out)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from service.observability import logs
from tests.conftest import ROOT


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
        "import logging\nfrom service.observability import logs\n"
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
