"""Quotas per API key, host capacity and the script slots (``service/quotas.py``).

Unit tests of the ledgers need no engine. The integration tests share one service with several keys,
each with one tight quota (``KEY_QUOTAS``): a key that reaches its quota gets 429 problem+json with
``Retry-After`` and ``ptc_rejections_total{reason}`` counts it, while another key is still served.
The service runs no warm pool and at most ``CONCURRENCY`` scripts at once, so that sandbox starts stay
few and the concurrency of session scripts can be measured from inside them.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.jobs.marks import read_marks
from service.tenancy import hash_token
from tests.conftest import Service, labelled_containers, start_service, wait_until

CONCURRENCY = 2


KEYS = ("k_jobs", "k_rate", "k_out", "k_ses", "big")


KEY_QUOTAS = {
    "pytest": {"running_jobs": CONCURRENCY, "sessions": 3},  # the key that is still served
    "k_jobs": {"running_jobs": 1, "queued_jobs": 1},
    "k_rate": {"jobs_per_minute": 1},
    "k_out": {"output_bytes": 100_000},
    "k_ses": {"sessions": 2, "session_memory_mb": 400, "session_cpus": 1.5},
    "big": {"session_memory_mb": 100_000, "session_cpus": 100},
}


HOST_MEMORY_MB = 4096


SLEEP = "import time\ntime.sleep(60)"


@pytest.fixture(scope="module")
def quota_service(engine: docker.DockerClient, scratch: Path) -> Iterator[tuple[Service, dict[str, str]]]:
    """A service with ``KEY_QUOTAS``, ``HOST_MEMORY_MB`` of host memory, no warm pool; and each key's token."""
    tokens = {name: secrets.token_urlsafe(32) for name in KEYS}
    keys_file = scratch / "quota.keys"
    keys_file.write_text("".join(f"{name}:{hash_token(token)}\n" for name, token in tokens.items()))
    instance = f"pytest-quota-{secrets.token_hex(4)}"
    svc = start_service(
        instance,
        scratch / "quota",
        PTC_WARM_POOL_SIZE="0",
        PTC_MAX_CONCURRENT_SANDBOXES=str(CONCURRENCY),
        PTC_HOST_MEMORY_MB=str(HOST_MEMORY_MB),
        PTC_API_KEYS_FILE=str(keys_file),
        PTC_KEY_QUOTAS=json.dumps(KEY_QUOTAS),
    )
    yield svc, tokens
    svc.stop()
    assert labelled_containers(engine, instance, include_pool=True) == []


@pytest.fixture
def clients(quota_service: tuple[Service, dict[str, str]]) -> Iterator[dict[str, httpx.Client]]:
    """A client per key (``pytest`` = the service's own key)."""
    svc, tokens = quota_service
    made = {"pytest": svc.client()} | {
        name: httpx.Client(base_url=svc.url, timeout=120, headers={"Authorization": f"Bearer {token}"})
        for name, token in tokens.items()
    }
    yield made
    for client in made.values():
        client.close()


def rejections(api: httpx.Client, reason: str) -> float:
    text = api.get("/metrics").text
    match = re.search(rf'^ptc_rejections_total{{reason="{reason}"}} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def assert_refused(response: httpx.Response, reason: str) -> dict[str, Any]:
    """A 429 problem+json naming ``reason``, with a Retry-After."""
    assert response.status_code == 429, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["Retry-After"]) >= 1
    problem: dict[str, Any] = response.json()
    assert problem["status"] == 429 and problem["reason"] == reason, problem
    return problem


def served(api: httpx.Client) -> None:
    """The other key still gets a job run."""
    view = api.post("/execute", json={"script": "print('served')"}).json()
    assert (view["status"], view["stdout"]) == ("succeeded", "served\n"), view


def test_running_and_queued_jobs_per_key(clients: dict[str, httpx.Client]) -> None:
    api, other = clients["k_jobs"], clients["pytest"]
    first = api.post("/execute", json={"script": SLEEP, "wait_s": 0}).json()
    second = api.post("/execute", json={"script": SLEEP, "wait_s": 0}).json()
    try:
        wait_until(lambda: api.get(f"/jobs/{first['job_id']}").json()["status"] == "running", 30)
        assert_refused(api.post("/execute", json={"script": "print(1)", "wait_s": 0}), "queued_jobs")
        served(other)  # a global slot is free: the other key runs ...
        assert api.get(f"/jobs/{second['job_id']}").json()["status"] == "queued"  # ... this key's second waits
        assert rejections(other, "queued_jobs") >= 1
    finally:
        for job in (second, first):
            api.post(f"/jobs/{job['job_id']}/stop")
    assert api.get(f"/jobs/{second['job_id']}").json()["error"]["message"] == "stopped before it started"


def test_jobs_per_minute_per_key(clients: dict[str, httpx.Client]) -> None:
    api, other = clients["k_rate"], clients["pytest"]
    assert api.post("/execute", json={"script": "print(1)"}).json()["status"] == "succeeded"
    problem = assert_refused(api.post("/execute", json={"script": "print(2)"}), "jobs_per_minute")
    assert problem["limit"] == 1
    assert int(api.post("/execute", json={"script": "print(2)"}).headers["Retry-After"]) <= 60
    served(other)


def test_retained_output_per_key_is_capped_on_disk_and_then_refused(
    clients: dict[str, httpx.Client], quota_service: tuple[Service, dict[str, str]]
) -> None:
    api, other = clients["k_out"], clients["pytest"]
    view = api.post("/execute", json={"script": "import sys\nsys.stdout.write('x' * 300_000 + 'END')"}).json()
    assert view["status"] == "succeeded"
    assert view["stdout_bytes"] == 300_003 and view["stdout_retained_bytes"] == 100_000
    assert view["stdout_truncated"] and view["stdout"].startswith("x" * 1000) and view["stdout"].endswith("xEND")
    raw = api.get(f"/jobs/{view['job_id']}/output/stdout", params={"length": 1_000_000}).content
    assert raw == b"x" * 100_000
    on_disk = quota_service[0].work_dir / "output" / view["job_id"] / "stdout"
    assert on_disk.stat().st_size == 100_000
    assert_refused(api.post("/execute", json={"script": "print(1)"}), "output_bytes")
    served(other)


def test_sessions_per_key_by_count_memory_and_cpus(clients: dict[str, httpx.Client]) -> None:
    api, other = clients["k_ses"], clients["pytest"]
    opened = []
    try:
        first = api.post("/sessions", json={})
        assert first.status_code == 201, first.text
        opened.append(first.json()["session_id"])
        assert_refused(api.post("/sessions", json={"limits": {"memory_mb": 128, "cpus": 1}}), "session_cpus")
        assert_refused(api.post("/sessions", json={"limits": {"memory_mb": 200, "cpus": 0.5}}), "session_memory_mb")
        second = api.post("/sessions", json={"limits": {"memory_mb": 64, "cpus": 0.5}})
        assert second.status_code == 201, second.text
        opened.append(second.json()["session_id"])
        assert_refused(api.post("/sessions", json={"limits": {"memory_mb": 32, "cpus": 0.1}}), "sessions")
        assert rejections(other, "sessions") >= 1
        assert api.delete(f"/sessions/{opened.pop(0)}").status_code == 200
        third = api.post("/sessions", json={})  # what the deleted session held is given back
        assert third.status_code == 201, third.text
        opened.append(third.json()["session_id"])
    finally:
        for sid in opened:
            api.delete(f"/sessions/{sid}")


def test_sessions_are_admitted_against_host_memory(clients: dict[str, httpx.Client]) -> None:
    api, other = clients["big"], clients["pytest"]
    opened: list[tuple[httpx.Client, str]] = []
    big = {"limits": {"memory_mb": HOST_MEMORY_MB * 5 // 8}}
    try:
        first = api.post("/sessions", json=big)
        assert first.status_code == 201, first.text
        opened.append((api, first.json()["session_id"]))
        problem = assert_refused(api.post("/sessions", json=big), "host_memory_mb")
        assert problem["title"] == "Host capacity exceeded" and problem["limit"] == HOST_MEMORY_MB
        small = other.post("/sessions", json={})  # what still fits is admitted
        assert small.status_code == 201, small.text
        opened.append((other, small.json()["session_id"]))
        assert rejections(other, "host_memory_mb") >= 1
        # A one-shot job that does not fit waits in the queue until the room is given back.
        job = other.post("/execute", json={"script": "print('fits')", "limits": big["limits"], "wait_s": 1}).json()
        assert job["status"] == "queued", job
        api.delete(f"/sessions/{opened.pop(0)[1]}")
        final = other.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 60}).json()
        assert (final["status"], final["stdout"]) == ("succeeded", "fits\n"), final
    finally:
        for client, sid in opened:
            client.delete(f"/sessions/{sid}")


def test_session_scripts_and_one_shot_jobs_share_the_concurrency_limit(clients: dict[str, httpx.Client]) -> None:
    """Two session scripts and a one-shot job, each 2 s long, with 2 script slots: never 3 at once."""
    api = clients["pytest"]
    script = "import time\nprint(time.time(), flush=True)\ntime.sleep(2)\nprint(time.time())"
    sessions = []
    try:
        for _ in range(2):
            answer = api.post("/sessions", json={})
            assert answer.status_code == 201, answer.text
            sessions.append(answer.json()["session_id"])
        bodies: list[dict[str, Any]] = [{"script": script, "wait_s": 0, "session_id": sid} for sid in sessions]
        bodies.append({"script": script, "wait_s": 0})
        jobs = [api.post("/execute", json=body).json() for body in bodies]
        finals = [api.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 60}).json() for job in jobs]
    finally:
        for sid in sessions:
            api.delete(f"/sessions/{sid}")
    assert [f["status"] for f in finals] == ["succeeded"] * 3, finals
    spans = [tuple(float(t) for t in f["stdout"].split()) for f in finals]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most <= CONCURRENCY, spans


HOST_CPUS, CPU_OVERCOMMIT = 2, 2  # the host CPU capacity: 4 CPUs, whatever the machine
CPU_CAPACITY = HOST_CPUS * CPU_OVERCOMMIT


@pytest.mark.parametrize("tenants", ["auth disabled", "one key", "two keys"])
def test_one_tenant_has_the_whole_host_and_several_keys_a_share(
    engine: docker.DockerClient, scratch: Path, tenants: str
) -> None:
    """Sessions of 1 CPU: one tenant opens them up to the host's CPU capacity, its ``session_cpus`` quota, not
    up to a quarter of it; with two keys, each key still gets its quarter."""
    instance = f"pytest-tenants-{secrets.token_hex(4)}"
    env = {
        "PTC_WARM_POOL_SIZE": "0",
        "PTC_HOST_CPUS": str(HOST_CPUS),
        "PTC_CPU_OVERCOMMIT": str(CPU_OVERCOMMIT),
    }
    other_token = secrets.token_urlsafe(32)
    if tenants == "auth disabled":
        env |= {"PTC_AUTH": "disabled", "PTC_API_KEYS": "", "PTC_METRICS_KEYS": ""}
    elif tenants == "two keys":
        env["PTC_API_KEYS_FILE"] = str(scratch / f"{instance}.keys")
        (scratch / f"{instance}.keys").write_text(f"other:{hash_token(other_token)}\n")
    svc = start_service(instance, scratch / instance, **env)
    api = svc.client() if tenants != "auth disabled" else httpx.Client(base_url=svc.url, timeout=120)
    other = httpx.Client(base_url=svc.url, timeout=120, headers={"Authorization": f"Bearer {other_token}"})
    opened: list[tuple[httpx.Client, str]] = []

    def open_session(client: httpx.Client) -> httpx.Response:
        answer = client.post("/sessions", json={"limits": {"cpus": 1, "memory_mb": 64}})
        if answer.status_code == 201:
            opened.append((client, answer.json()["session_id"]))
        return answer

    try:
        if tenants == "two keys":
            share = CPU_CAPACITY // 4
            for client in (api, other):  # each key its quarter, the other's use notwithstanding
                for _ in range(share):
                    assert open_session(client).status_code == 201, opened
                assert assert_refused(open_session(client), "session_cpus")["limit"] == share
        else:
            for _ in range(CPU_CAPACITY):
                answer = open_session(api)
                assert answer.status_code == 201, answer.text
            assert assert_refused(open_session(api), "session_cpus")["limit"] == CPU_CAPACITY  # the whole host
    finally:
        for client, sid in opened:
            client.delete(f"/sessions/{sid}")
        api.close()
        other.close()
        svc.stop()
    assert labelled_containers(engine, instance, include_pool=True) == []


RECORDS_QUOTA = 200_000
ECHO = [{"name": "echo", "parameters": {"properties": {"data": {"type": "string"}}}, "endpoint": {"kind": "echo"}}]
BIG_CALLS = "import tools\nfor i in range(6):\n    tools.echo(data=str(i) * 50_000)\nprint('called')"


def stored_bytes(folder: Path) -> int:
    """What an ended job's output folder says it keeps in the store (``service.jobs.marks``)."""
    _, stored = read_marks(folder)
    assert stored is not None, f"{folder} is not marked with its stored bytes"
    return stored


def kept_record_bytes(view: dict[str, Any]) -> int:
    """Bytes of arguments and results the view's call records keep (compact JSON, as the service counts them)."""
    return sum(
        len(json.dumps(call[field], separators=(",", ":")))
        for call in view["calls"]
        for field in ("args", "result")
        if call[field] is not None
    )


def test_call_records_count_against_the_output_quota_until_purged(
    engine: docker.DockerClient, scratch: Path, runtime: str
) -> None:
    """Six calls of 100 KB of records each (args and echoed result) under a 200 KB ``output_bytes`` quota: the
    records keep what the quota allows, the rest is dropped as past the record cap (``*_dropped_bytes``), the next
    job is refused; once the job is purged its bytes are given back."""
    instance = f"pytest-records-{secrets.token_hex(4)}"
    svc = start_service(
        instance,
        scratch / instance,
        PTC_WARM_POOL_SIZE="0",
        PTC_KEY_QUOTAS=json.dumps({"pytest": {"output_bytes": RECORDS_QUOTA}}),
        PTC_JOB_RETENTION_S="3",
        PTC_PURGE_INTERVAL_S="0.5",
        PTC_RUNTIME=runtime,
    )
    try:
        with svc.client() as api:
            view = api.post("/execute", json={"script": BIG_CALLS, "tools": ECHO}).json()
            assert (view["status"], view["stdout"], len(view["calls"])) == ("succeeded", "called\n", 6), view
            assert all(call["status"] == "ok" for call in view["calls"])  # every call still ran
            assert 0 < kept_record_bytes(view) <= RECORDS_QUOTA
            dropped = [call for call in view["calls"] if call["result"] is None]
            assert dropped and all(call["result_dropped_bytes"] > 50_000 for call in dropped), view["calls"]
            stored = stored_bytes(svc.work_dir / "output" / view["job_id"])
            body = api.get(f"/jobs/{view['job_id']}").content  # the stored view, records included
            assert kept_record_bytes(view) < len(body) <= stored <= len(body) + 4096  # and its summary
            assert_refused(api.post("/execute", json={"script": "print(1)"}), "output_bytes")
            wait_until(lambda: api.get(f"/jobs/{view['job_id']}").status_code == 404, 30)  # purged
            # the row goes first (the store's transaction), the bytes come back once the purge has removed the
            # job's output folder, a moment later: wait for that, then the next job is admitted
            wait_until(lambda: not (svc.work_dir / "output" / view["job_id"]).exists(), 10)
            wait_until(lambda: api.post("/execute", json={"script": "print(1)"}).status_code != 429, 5)
            again = api.post("/execute", json={"script": "print(1)"})
            assert again.status_code == 200 and again.json()["status"] == "succeeded", again.text
    finally:
        svc.stop()
    assert labelled_containers(engine, instance, include_pool=True) == []


def gone(api: httpx.Client, job_id: str) -> bool:
    """Whether the job was purged."""
    return api.get(f"/jobs/{job_id}").status_code == 404


def test_what_an_ended_job_keeps_in_the_store_counts_against_the_output_quota(
    engine: docker.DockerClient, scratch: Path
) -> None:
    """No output and no calls, but a script and metadata of about 60 KB each (the script repaired, so kept as
    sent and as run): each job keeps about 240 KB in the store; under a 300 KB ``output_bytes`` quota the third
    job is refused, and the quota is given back at the purge."""
    instance = f"pytest-rows-{secrets.token_hex(4)}"
    svc = start_service(
        instance,
        scratch / instance,
        PTC_WARM_POOL_SIZE="0",
        PTC_KEY_QUOTAS=json.dumps({"pytest": {"output_bytes": 300_000}}),
        PTC_JOB_RETENTION_S="3",
        PTC_PURGE_INTERVAL_S="0.5",
    )
    request = {"script": "```python\n#" + "p" * 60_000 + "\npass\n```", "metadata": {"m": "q" * 60_000}}
    try:
        with svc.client() as api:
            first = api.post("/execute", json=request).json()
            assert first["status"] == "succeeded" and first["normalization"], first["error"]
            stored = stored_bytes(svc.work_dir / "output" / first["job_id"])
            assert stored >= 240_000
            second = api.post("/execute", json=request)
            assert second.status_code == 200 and second.json()["status"] == "succeeded", second.text
            assert_refused(api.post("/execute", json=request), "output_bytes")
            for job_id in (first["job_id"], second.json()["job_id"]):  # purged: their bytes are given back
                wait_until(partial(gone, api, job_id), 30)
            again = api.post("/execute", json=request)
            assert again.status_code == 200 and again.json()["status"] == "succeeded", again.text
    finally:
        svc.stop()
    assert labelled_containers(engine, instance, include_pool=True) == []
