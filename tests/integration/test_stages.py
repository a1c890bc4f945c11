"""Per-stage timing (``observability.stages``): an admin's ``X-PTC-Stages: 1`` gets ``Server-Timing``, with the
sandbox's own moments placed on the service's time line; nobody else gets it; the sandbox's stamps are not trusted."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest

from bench.__main__ import server_timing
from service.observability.stages import Stages
from service.tenancy import hash_token
from tests.conftest import Service, start_service, stop_clean

OTHER_TOKEN = secrets.token_urlsafe(32)
ECHO = [
    {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"i": {"type": "integer"}}},
        "endpoint": {"kind": "echo"},
    }
]
STAGED = {"x-ptc-stages": "1"}


@pytest.fixture(scope="module")
def staged_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service whose ``pytest`` key is an admin, with a second key ``other`` (token ``OTHER_TOKEN``) that is not."""
    keys = scratch / "stages.keys"
    keys.write_text(f"other:{hash_token(OTHER_TOKEN)}\n")
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / "stages",
        PTC_ADMIN_KEYS="pytest",
        PTC_API_KEYS_FILE=str(keys),
        PTC_WARM_POOL_SIZE="1",
    )
    yield svc
    stop_clean(engine, svc)


def test_an_admins_timed_session_job_answers_every_stage_in_order(staged_service: Service) -> None:
    with staged_service.client(timeout=60) as api:
        sid = api.post("/sessions", json={"tools": ECHO}).json()["session_id"]
        try:
            script = "import tools\nfor i in range(3):\n    tools.echo(i=i)\nprint(1)"
            response = api.post("/execute", json={"script": script, "session_id": sid}, headers=STAGED)
        finally:
            api.delete(f"/sessions/{sid}")
    assert response.status_code == 200 and response.json()["stdout"] == "1\n", response.json()
    timing = server_timing(response.headers["server-timing"])
    names = [name for name in timing if name not in ("total", "origin") and not name.startswith("call-")]
    sent = names.index("run-sent")  # sending the run frame may return after the sandbox has begun it
    assert names.index("broker-listening") < sent < names.index("sandbox-exit-read")
    admitted = names.index("admitted-and-saved")  # the route goes on once the first save is done
    assert names.index("sandbox-found") < admitted < names.index("end-seen")
    running = names.index("saved-running")  # saved while the run is laid out, before the script is released
    assert names.index("sandbox-found") < running < names.index("sandbox-run_received")
    assert [name for name in names if name not in ("run-sent", "admitted-and-saved", "saved-running")] == [
        "body-parsed",
        "admitted",  # no "saved-queued" next: its sandbox was at hand, its first save is "running"
        "sandbox-found",
        "sandbox-ready",
        "run-files-written",
        "broker-listening",
        "sandbox-run_received",
        "sandbox-go_sent",
        "sandbox-script_ended",
        "sandbox-reaped",
        "sandbox-drained",
        "sandbox-exit-read",
        "exit-seen",
        "broker-closed",
        "saved-final",  # the final view is saved before anyone is told the job ended
        "end-told",
        "end-seen",
        "view-rendered",
        "answer-encoded",
    ]
    assert all(ms >= 0 for ms in timing.values())
    stages_sum = sum(ms for name, ms in timing.items() if name in names)
    assert stages_sum == pytest.approx(timing["total"], abs=0.05)  # each stage is the time since the one before
    calls = response.headers["server-timing"]
    assert "call-parse;dur=" in calls and "call-answer;dur=" in calls and 'desc="3"' in calls


def test_a_pooled_job_is_timed_too(staged_service: Service) -> None:
    with staged_service.client(timeout=60) as api:
        time.sleep(1)  # the pool of one has its sandbox
        response = api.post("/execute", json={"script": "print(1)"}, headers=STAGED)
    assert response.json()["stdout"] == "1\n"
    timing = server_timing(response.headers["server-timing"])
    assert {"sandbox-go_sent", "sandbox-script_ended", "saved-final", "answer-encoded"} <= set(timing)


def test_nobody_else_is_timed(staged_service: Service) -> None:
    with staged_service.client(timeout=60) as api:
        unasked = api.post("/execute", json={"script": "print(1)"})
    with httpx.Client(
        base_url=staged_service.url, headers={"Authorization": f"Bearer {OTHER_TOKEN}"}, timeout=60
    ) as other:
        not_admin = other.post("/execute", json={"script": "print(1)"}, headers=STAGED)
    for response in (unasked, not_admin):
        assert response.status_code == 200 and response.json()["stdout"] == "1\n"
        assert "server-timing" not in response.headers


def test_the_sandbox_stamps_are_kept_only_in_order_inside_the_run() -> None:
    stages = Stages()
    window = (1_000, 2_000)
    stages.sandbox({"run_received": 1_100, "go_sent": 900, "script_ended": "1500", "reaped": 1_600}, window)
    stages.sandbox({"run_received": 1_100, "go_sent": 1_050, "drained": 10**30}, window)  # out of order, past the end
    stages.sandbox(["run_received", 1_100], window)
    stages.sandbox(None, window)
    assert [name for name, _ in stages.marks[1:]] == ["sandbox-run_received", "sandbox-reaped", "sandbox-run_received"]


def test_call_stages_are_bounded() -> None:
    stages = Stages()
    for i in range(100):
        stages.call({f"stage{i}": 1_000, "parse": 2_000})
    assert len(stages.calls) == 16 and stages.calls["parse"] == [200_000, 100]


def test_a_job_that_waits_for_its_turn_is_saved_queued_first(staged_service: Service) -> None:
    with staged_service.client(timeout=60) as api:
        sid = api.post("/sessions", json={}).json()["session_id"]
        try:
            first = api.post("/execute", json={"script": "import time; time.sleep(2)", "session_id": sid, "wait_s": 0})
            second = api.post("/execute", json={"script": "print(2)", "session_id": sid, "wait_s": 0}, headers=STAGED)
            assert first.status_code == second.status_code == 202
            queued = api.get("/jobs", params={"status": "queued"}).json()["jobs"]  # the store's listing
            assert second.json()["job_id"] in [job["job_id"] for job in queued]
            assert "saved-queued" in server_timing(second.headers["server-timing"])
            ended = api.post(f"/jobs/{second.json()['job_id']}/wait", params={"timeout_s": 30}).json()
            assert ended["status"] == "succeeded" and ended["stdout"] == "2\n"
        finally:
            api.delete(f"/sessions/{sid}")
