"""Validation cannot be monopolised: jobs hammering an expensive schema do not delay another key's calls.

The attack of issue 11 (item 11): a tool whose array items use a large enum, called with 20,000 items over and
over by several jobs of one key at once, while another key's job makes trivial echo calls. Before, every check
of the service shared two threads and jsonschema compared each item with every enum member (seconds per call):
the echo calls waited behind them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import Service, execute, start_service, wait_until

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
MALLORY_TOKEN = secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def shared_by_two_keys(scratch: Path) -> Iterator[Service]:
    """A service with a second key, ``mallory``, for the attacker (and the default check threads: more than the
    attacker's jobs, so the echo calls never wait for a thread; the round-robin when they must is unit-tested)."""
    keys = scratch / f"fairness-keys-{secrets.token_hex(4)}"
    keys.write_text(f"mallory:{hash_token(MALLORY_TOKEN)}\n")
    service = start_service(
        f"pytest-fair-{secrets.token_hex(4)}",
        scratch / f"fair-{secrets.token_hex(4)}",
        PTC_API_KEYS_FILE=str(keys),
        PTC_QUOTA_RUNNING_JOBS="4",  # the attacker's three jobs all run (the default quota is half the concurrency)
        PTC_WARM_POOL_SIZE="1",
    )
    yield service
    service.stop()


def test_an_echo_call_is_not_delayed_by_another_keys_jobs_hammering_an_expensive_schema(
    shared_by_two_keys: Service,
) -> None:
    hostile: list[str] = []
    with (
        shared_by_two_keys.client() as api,
        httpx.Client(
            base_url=shared_by_two_keys.url, timeout=60, headers={"Authorization": f"Bearer {MALLORY_TOKEN}"}
        ) as mallory,
    ):
        try:
            for _ in range(HOSTILE_JOBS):
                body = {"script": HAMMER, "tools": [PICK], "wait_s": 0, "timeout_s": 60}
                answer = mallory.post("/execute", json=body)
                assert answer.status_code == 202, answer.text
                hostile.append(answer.json()["job_id"])

            def hammering() -> bool:
                views = [mallory.get(f"/jobs/{job_id}").json() for job_id in hostile]
                return all(len(v["calls"]) >= 1 for v in views)

            wait_until(hammering, 30)
            started = time.monotonic()
            view = execute(api, "import tools\nfor i in range(3):\n    tools.echo(x=i)\nprint('done')\n", [ECHO])
            elapsed = time.monotonic() - started
            assert view["stdout"] == "done\n", view
            durations = [c["duration_ms"] for c in view["calls"]]
            print(f"echo calls: {durations} ms; the job took {elapsed:.2f} s")
            assert sum(durations) < 2000, durations  # before: seconds each, behind the hostile jobs' checks
            views: list[dict[str, Any]] = [mallory.get(f"/jobs/{job_id}").json() for job_id in hostile]
            assert all(v["status"] == "running" for v in views)  # they were hammering all along
            assert all(c["status"] in ("ok", "pending") for v in views for c in v["calls"])  # and were served
        finally:
            for job_id in hostile:
                mallory.post(f"/jobs/{job_id}/stop")
