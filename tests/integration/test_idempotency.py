"""Idempotency keys (issue 14, point 1) against the real engine: a script with a write tool (the real HTTP tool
server counts its calls) sent twice, then ten times at once, with one key runs once; another body with the key
is refused; the key still maps to its job after a restart; another API key with the same key gets its own job;
the same for ``POST /sessions``. One service of this module's own (keys ``alice`` and ``bob``), restarted once.
Sandboxes started: four one-shot jobs and two sessions (trivial scripts)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, labelled_containers, start_service
from tests.toolserver import ToolServer
from tests.unit.test_tenants import client_of, keys_file

PROBLEMS = "tag:ptc-sandbox.dev,2026:problems/"


@pytest.fixture(scope="module")
def settings(scratch: Path, tool_server: ToolServer) -> dict[str, str]:
    port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    return {
        "PTC_API_KEYS_FILE": str(keys_file(scratch, "alice", "bob")),
        "PTC_WARM_POOL_SIZE": "0",
        "PTC_EGRESS_ALLOW": f"http://127.0.0.1:{port}",
    }


@pytest.fixture(scope="module")
def instance() -> str:
    return f"pytest-idem-{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def first(engine: docker.DockerClient, scratch: Path, instance: str, settings: dict[str, str]) -> Iterator[Service]:
    svc = start_service(instance, scratch / "idem", **settings)
    yield svc
    svc.stop()


def write_request(tool_server: ToolServer, marker: str) -> dict[str, Any]:
    """An /execute body whose script calls a write tool once (the tool server's ``/echo``) with ``marker``."""
    tools = [
        {
            "name": "create_ticket",
            "parameters": {"properties": {"title": {"type": "string"}}, "required": ["title"]},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        }
    ]
    script = f"import tools\nprint(tools.create_ticket(title={marker!r})['args']['title'])\n"
    return {"script": script, "tools": tools, "wait_s": 60}


def calls_with(tool_server: ToolServer, marker: str) -> int:
    return sum(1 for path, args in list(tool_server.requests) if path == "/echo" and args == {"title": marker})


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


def test_a_malformed_key_is_refused_before_anything_runs(first: Service) -> None:
    with httpx.Client(base_url=first.url, timeout=60) as anonymous, client_of(first, "alice") as alice:
        assert anonymous.post("/execute", json={"script": "print(1)"}).status_code == 401
        answer = alice.post("/execute", json={"script": "print(1)"}, headers=key("x" * 256))
        assert answer.status_code == 422
        assert answer.json()["errors"][0]["loc"] == ["header", "Idempotency-Key"]


def test_one_key_runs_once_sequentially_concurrently_and_across_a_restart(
    engine: docker.DockerClient,
    scratch: Path,
    first: Service,
    instance: str,
    settings: dict[str, str],
    tool_server: ToolServer,
) -> None:
    twice, ten = f"twice-{secrets.token_hex(4)}", f"ten-{secrets.token_hex(4)}"
    with client_of(first, "alice") as alice, client_of(first, "bob") as bob:
        one = alice.post("/execute", json=write_request(tool_server, twice), headers=key(twice))
        assert one.status_code == 200, one.text
        assert (one.json()["status"], one.json()["stdout"]) == ("succeeded", twice + "\n"), one.text
        again = alice.post("/execute", json=write_request(tool_server, twice), headers=key(twice))
        assert again.status_code == 200, again.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["job_id"] == one.json()["job_id"]
        assert calls_with(tool_server, twice) == 1

        body = write_request(tool_server, ten)
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: alice.post("/execute", json=body, headers=key(ten)), range(10)))
        assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
        assert len({a.json()["job_id"] for a in answers}) == 1
        assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 9
        assert calls_with(tool_server, ten) == 1

        other = alice.post("/execute", json=write_request(tool_server, "another"), headers=key(twice))
        assert (other.status_code, other.json()["type"]) == (422, PROBLEMS + "idempotency-key-reused")
        assert calls_with(tool_server, "another") == 0

        bobs = bob.post("/execute", json=write_request(tool_server, twice), headers=key(twice))
        assert bobs.status_code == 200, bobs.text
        assert "idempotent-replayed" not in bobs.headers
        assert bobs.json()["job_id"] != one.json()["job_id"] and bobs.json()["owner"] == "bob"
        assert calls_with(tool_server, twice) == 2  # bob's own job ran

        session_body = {"idle_timeout_s": 120, "metadata": {"conversation": twice}}
        session = alice.post("/sessions", json=session_body, headers=key("session-" + twice))
        assert session.status_code == 201, session.text
        same = alice.post("/sessions", json=session_body, headers=key("session-" + twice))
        assert (same.status_code, same.headers["idempotent-replayed"]) == (201, "true")
        assert same.json()["session_id"] == session.json()["session_id"]
        bobs_session = bob.post("/sessions", json=session_body, headers=key("session-" + twice))
        assert bobs_session.status_code == 201 and bobs_session.json()["session_id"] != session.json()["session_id"]
        assert len(alice.get("/sessions").json()["sessions"]) == 1
        for client, made in ((alice, session), (bob, bobs_session)):
            assert client.delete(f"/sessions/{made.json()['session_id']}").status_code == 200
    first.stop()

    second = start_service(instance, scratch / "idem", **settings)
    try:
        with client_of(second, "alice") as alice:
            after = alice.post("/execute", json=write_request(tool_server, twice), headers=key(twice))
            assert after.status_code == 200, after.text
            assert after.headers["idempotent-replayed"] == "true"
            assert after.json()["job_id"] == one.json()["job_id"]
            assert after.json()["stdout"] == twice + "\n"
            refused = alice.post("/execute", json=write_request(tool_server, "another"), headers=key(twice))
            assert refused.json()["type"] == PROBLEMS + "idempotency-key-reused"
            gone = alice.post("/sessions", json=session_body, headers=key("session-" + twice))
            assert (gone.status_code, gone.json()["type"]) == (404, PROBLEMS + "session-not-found")
            assert gone.headers["idempotent-replayed"] == "true"
        assert calls_with(tool_server, twice) == 2
        assert calls_with(tool_server, ten) == 1
    finally:
        second.stop()
    assert not labelled_containers(engine, instance, include_pool=True)
