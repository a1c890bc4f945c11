"""Validation cannot be monopolised: jobs hammering an expensive schema do not delay another job's calls.

The attack of issue 11 (item 11): a tool whose array items use a large enum, called with 20,000 items over and
over by several jobs at once. Before, every check of the service shared two threads and jsonschema compared
each item with every enum member (seconds per call): another job's trivial echo call waited behind them.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.conftest import execute, wait_until

ENUM = [f"v{i}" for i in range(10_000)]
PICK = {
    "name": "pick",
    "parameters": {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "string", "enum": ENUM}}},
    },
    "endpoint": {"kind": "echo"},
}
ECHO = {
    "name": "echo",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    "endpoint": {"kind": "echo"},
}
HAMMER = f"import tools\nxs = [{ENUM[-1]!r}] * 20_000\nwhile True:\n    tools.pick(xs=xs)\n"
HOSTILE_JOBS = 3


def test_an_echo_call_is_not_delayed_by_jobs_hammering_an_expensive_schema(api: httpx.Client) -> None:
    hostile: list[str] = []
    try:
        for _ in range(HOSTILE_JOBS):
            answer = api.post("/execute", json={"script": HAMMER, "tools": [PICK], "wait_s": 0, "timeout_s": 60})
            assert answer.status_code == 202, answer.text
            hostile.append(answer.json()["job_id"])

        def hammering() -> bool:
            views = [api.get(f"/jobs/{job_id}").json() for job_id in hostile]
            return all(len(v["calls"]) >= 1 for v in views)

        wait_until(hammering, 30)
        started = time.monotonic()
        view = execute(api, "import tools\nfor i in range(3):\n    tools.echo(x=i)\nprint('done')\n", [ECHO])
        elapsed = time.monotonic() - started
        assert view["stdout"] == "done\n", view
        durations = [c["duration_ms"] for c in view["calls"]]
        print(f"echo calls: {durations} ms; the job took {elapsed:.2f} s")
        assert sum(durations) < 2000, durations  # before: seconds each, behind the hostile jobs' checks
        views: list[dict[str, Any]] = [api.get(f"/jobs/{job_id}").json() for job_id in hostile]
        assert all(v["status"] == "running" for v in views)  # they were hammering all along
    finally:
        for job_id in hostile:
            api.post(f"/jobs/{job_id}/stop")
