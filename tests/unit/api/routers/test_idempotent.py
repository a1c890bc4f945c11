"""``Idempotency-Key`` on ``POST /execute`` and ``POST /sessions`` through the whole service on the fake backend
(no engine): one run per key, replays marked, other bodies refused, bindings kept across a restart, keys scoped
to the API key. Each script appends a line to a file of the test's: the number of lines is the number of runs."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.idempotency import Claim, IdempotencyKeys
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.tenancy import hash_token

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef0"}
PROBLEMS = "tag:ptc-sandbox.dev,2026:problems/"


@pytest.fixture
def work_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ptci", dir="/tmp"))  # short: the sandbox folders' socket paths
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Api(dict[str, httpx.AsyncClient]):
    """A client per API key, and the app they reach (``app``)."""

    app: FastAPI


@asynccontextmanager
async def service(work_dir: Path, **overrides: Any) -> AsyncIterator[Api]:
    """The service on ``work_dir`` (a second one on the same dir is a restart): a client per API key."""
    settings = Settings(
        **overrides,
        work_dir=work_dir,
        api_keys=",".join(f"{name}:{hash_token(token)}" for name, token in TOKENS.items()),
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
    )
    backend = FakeBackend()
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        clients = Api(
            (
                name,
                httpx.AsyncClient(
                    transport=transport,
                    base_url="http://fake",
                    timeout=60,
                    headers={"Authorization": f"Bearer {token}"},
                ),
            )
            for name, token in TOKENS.items()
        )
        clients.app = app
        try:
            yield clients
        finally:
            for client in clients.values():
                await client.aclose()
    assert await backend.labelled({}) == []


def counting(work_dir: Path, name: str = "runs") -> tuple[str, Path]:
    """A script that appends a line to a file per run (the fake backend runs scripts on this host), and the file."""
    runs = work_dir / name
    return f"open({str(runs)!r}, 'a').write('run\\n')\nprint('done')\n", runs


def runs_of(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


async def test_the_same_execute_twice_runs_once(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    async with service(work_dir) as api:
        first = await api["alice"].post("/execute", json={"script": script, "wait_s": 30}, headers=key("k-1"))
        assert first.status_code == 200, first.text
        assert "idempotent-replayed" not in first.headers
        # the same request written otherwise (key order, whitespace) is the same request
        text = '{ "wait_s": 30 ,\n "script": ' + httpx.Response(200, json=script).text + "}"
        again = await api["alice"].post(
            "/execute", content=text, headers={**key("k-1"), "content-type": "application/json"}
        )
        assert again.status_code == 200, again.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["job_id"] == first.json()["job_id"]
        assert again.json() == first.json()
        jobs = (await api["alice"].get("/jobs")).json()["jobs"]
    assert runs_of(runs) == 1
    assert [j["job_id"] for j in jobs] == [first.json()["job_id"]]


async def test_ten_concurrent_executes_with_one_key_run_once(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    script = "import time\ntime.sleep(0.5)\n" + script
    async with service(work_dir) as api:
        answers = await asyncio.gather(
            *(api["alice"].post("/execute", json={"script": script}, headers=key("ten")) for _ in range(10))
        )
        assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
        assert len({a.json()["job_id"] for a in answers}) == 1
        assert sorted(a.headers.get("idempotent-replayed", "") for a in answers) == [""] + ["true"] * 9
        assert len((await api["alice"].get("/jobs")).json()["jobs"]) == 1
    assert runs_of(runs) == 1


async def test_a_repeat_of_a_running_job_gets_its_view_so_far(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    slow = {"script": "import time\ntime.sleep(3)\n" + script, "wait_s": 0}
    async with service(work_dir) as api:
        first = await api["alice"].post("/execute", json=slow, headers=key("slow"))
        again = await api["alice"].post("/execute", json=slow, headers=key("slow"))
        assert (first.status_code, again.status_code) == (202, 202)
        assert again.json()["job_id"] == first.json()["job_id"]
        assert again.headers["idempotent-replayed"] == "true"
        job_id = first.json()["job_id"]
        ended = await api["alice"].post(f"/jobs/{job_id}/wait", params={"timeout_s": 30})
        assert ended.json()["status"] == "succeeded"
        final = await api["alice"].post("/execute", json=slow, headers=key("slow"))
        assert (final.status_code, final.json()["status"]) == (200, "succeeded")
    assert runs_of(runs) == 1


async def test_a_replay_answers_in_its_own_view_selection(work_dir: Path) -> None:
    # calls= and fields= shape the answer only: a replay asking for another selection is the same request
    script, runs = counting(work_dir)
    async with service(work_dir) as api:
        body = {"script": script, "wait_s": 30}
        first = await api["alice"].post("/execute", json=body, headers=key("sel"))
        again = await api["alice"].post(
            "/execute", json=body, headers=key("sel"), params={"calls": "none", "fields": "stdout"}
        )
        assert again.status_code == 200, again.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == {"job_id": first.json()["job_id"], "status": "succeeded", "stdout": "done\n"}
        slow = {"script": "import time\ntime.sleep(3)\n" + script, "wait_s": 0}
        running = await api["alice"].post("/execute", json=slow, headers=key("slow-sel"))
        replayed = await api["alice"].post("/execute", json=slow, headers=key("slow-sel"), params={"fields": "status"})
        assert (running.status_code, replayed.status_code) == (202, 202)
        job_id = running.json()["job_id"]
        assert replayed.json() == {"job_id": job_id, "status": running.json()["status"]}
        assert replayed.headers["location"] == running.headers["location"] == f"/jobs/{job_id}"
        await api["alice"].post(f"/jobs/{job_id}/wait", params={"timeout_s": 30})
    assert runs_of(runs) == 2


async def test_another_body_with_the_same_key_is_refused(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    async with service(work_dir) as api:
        first = await api["alice"].post("/execute", json={"script": script}, headers=key("k"))
        assert first.status_code == 200
        other = await api["alice"].post("/execute", json={"script": script + "print(2)\n"}, headers=key("k"))
        assert other.status_code == 422
        assert other.headers["content-type"] == "application/problem+json"
        assert other.json()["type"] == PROBLEMS + "idempotency-key-reused"
        # the key of a job is not the key of a session
        session = await api["alice"].post("/sessions", json={}, headers=key("k"))
        assert session.json()["type"] == PROBLEMS + "idempotency-key-reused"
    assert runs_of(runs) == 1


@pytest.mark.parametrize("value", ["", "x" * 256, "tab\there"])
async def test_a_malformed_key_is_refused_naming_the_header(work_dir: Path, value: str) -> None:
    async with service(work_dir) as api:
        answer = await api["alice"].post("/execute", json={"script": "print(1)"}, headers=key(value))
        assert answer.status_code == 422, answer.text
        assert answer.json()["type"] == PROBLEMS + "invalid-request"
        assert answer.json()["errors"][0]["loc"] == ["header", "Idempotency-Key"]
        assert answer.json()["detail"].startswith("header.Idempotency-Key: ")
        assert (await api["alice"].get("/jobs")).json()["jobs"] == []


async def test_a_request_refused_before_it_creates_a_job_binds_nothing(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    async with service(work_dir) as api:
        refused = await api["alice"].post("/execute", json={"script": script, "timeout_s": 10**9}, headers=key("k"))
        assert refused.status_code == 422
        unknown = await api["alice"].post(
            "/execute", json={"script": script, "session_id": "ses_" + "0" * 24}, headers=key("k")
        )
        assert unknown.status_code == 404
        fixed = await api["alice"].post("/execute", json={"script": script}, headers=key("k"))
        assert fixed.status_code == 200, fixed.text
        assert "idempotent-replayed" not in fixed.headers
    assert runs_of(runs) == 1


async def test_another_api_key_with_the_same_key_gets_its_own_job(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    async with service(work_dir) as api:
        alices = await api["alice"].post("/execute", json={"script": script}, headers=key("shared"))
        bobs = await api["bob"].post("/execute", json={"script": script}, headers=key("shared"))
        assert (alices.status_code, bobs.status_code) == (200, 200)
        assert "idempotent-replayed" not in bobs.headers
        assert alices.json()["job_id"] != bobs.json()["job_id"]
        assert (alices.json()["owner"], bobs.json()["owner"]) == ("alice", "bob")
        # bob's different body with alice's key is bob's own new job, not alice's 422
        other = await api["bob"].post("/execute", json={"script": "print(3)"}, headers=key("alice-only"))
        assert other.status_code == 200
    assert runs_of(runs) == 2


async def test_a_key_still_maps_to_its_job_after_a_restart(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    async with service(work_dir) as api:
        first = (await api["alice"].post("/execute", json={"script": script}, headers=key("k"))).json()
    async with service(work_dir) as api:
        again = await api["alice"].post("/execute", json={"script": script}, headers=key("k"))
        assert again.status_code == 200
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["job_id"] == first["job_id"]
        assert again.json()["stdout"] == "done\n"
        other = await api["alice"].post("/execute", json={"script": "print(2)"}, headers=key("k"))
        assert other.json()["type"] == PROBLEMS + "idempotency-key-reused"
    assert runs_of(runs) == 1


async def test_a_purged_job_frees_its_key(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    async with service(work_dir, job_retention_s=0.001) as api:
        first = (await api["alice"].post("/execute", json={"script": script}, headers=key("k"))).json()
        await asyncio.sleep(0.01)
        assert await api.app.state.jobs.recovery.purge_expired() == 1  # what the purge loop does after the retention
        second = await api["alice"].post("/execute", json={"script": script}, headers=key("k"))
        assert second.status_code == 200
        assert "idempotent-replayed" not in second.headers
        assert second.json()["job_id"] != first["job_id"]
    assert runs_of(runs) == 2


async def test_a_repeat_while_the_first_is_admitted_too_long_answers_409(work_dir: Path) -> None:
    async with service(work_dir) as api:
        keys: IdempotencyKeys = api.app.state.idempotency
        keys.wait_s = 0.05
        held = await keys.claim("alice", "k", "0" * 64, "job")  # a first request still being admitted
        assert isinstance(held, Claim)
        answer = await api["alice"].post("/execute", json={"script": "print(1)"}, headers=key("k"))
        assert (answer.status_code, answer.json()["type"]) == (409, PROBLEMS + "idempotency-key-in-flight")
        assert int(answer.headers["retry-after"]) >= 1
        bobs = await api["bob"].post("/execute", json={"script": "print(1)"}, headers=key("k"))
        assert bobs.status_code == 200  # not alice's: no wait, no 409
        held.release()
        assert (await api["alice"].post("/execute", json={"script": "print(1)"}, headers=key("k"))).status_code == 200


async def test_the_same_session_request_starts_one_session(work_dir: Path) -> None:
    async with service(work_dir) as api:
        body = {"metadata": {"conversation": "c1"}, "idle_timeout_s": 600}
        answers = await asyncio.gather(*(api["alice"].post("/sessions", json=body, headers=key("s")) for _ in range(5)))
        assert [a.status_code for a in answers] == [201] * 5, [a.text for a in answers]
        assert len({a.json()["session_id"] for a in answers}) == 1
        assert sorted(a.headers.get("idempotent-replayed", "") for a in answers) == [""] + ["true"] * 4
        assert len((await api["alice"].get("/sessions")).json()["sessions"]) == 1
        session_id = answers[0].json()["session_id"]
        other = await api["alice"].post("/sessions", json={"idle_timeout_s": 60}, headers=key("s"))
        assert (other.status_code, other.json()["type"]) == (422, PROBLEMS + "idempotency-key-reused")
        bobs = await api["bob"].post("/sessions", json=body, headers=key("s"))
        assert bobs.status_code == 201 and bobs.json()["session_id"] != session_id
        await api["alice"].delete(f"/sessions/{session_id}")
        ended = await api["alice"].post("/sessions", json=body, headers=key("s"))
        assert (ended.status_code, ended.json()["status"]) == (200, "closed")  # what GET /sessions/{id} answers
        assert ended.headers["idempotent-replayed"] == "true"
        await api["bob"].delete(f"/sessions/{bobs.json()['session_id']}")
    async with service(work_dir) as api:  # sessions do not outlive the service; their keys do
        gone = await api["alice"].post("/sessions", json=body, headers=key("s"))
        assert (gone.status_code, gone.json()["type"]) == (404, PROBLEMS + "session-not-found")
        assert gone.headers["idempotent-replayed"] == "true"


async def test_a_job_the_engine_could_not_start_keeps_its_key(work_dir: Path) -> None:
    async with service(work_dir) as api:
        backend: FakeBackend = api.app.state.backend
        backend.engine_down = True
        try:
            first = await api["alice"].post("/execute", json={"script": "print(1)"}, headers=key("k"))
            again = await api["alice"].post("/execute", json={"script": "print(1)"}, headers=key("k"))
        finally:
            backend.engine_down = False
        assert (first.status_code, again.status_code) == (503, 503)
        assert first.json()["type"] == again.json()["type"] == PROBLEMS + "engine-unavailable"
        assert again.json()["job_id"] == first.json()["job_id"]
        assert again.headers["idempotent-replayed"] == "true"
