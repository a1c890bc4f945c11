"""Tenants (issue 11, items 1-3): what one API key creates, another cannot see, touch, run in, or sign for.

One service runs with three keys besides the suite's own: ``alice`` and ``bob`` (tenants) and ``root``
(``PTC_ADMIN_KEYS``). Each attack of item 1 has its test: another key's job, session or toolset answers
exactly like an unknown id. The last tests start services of their own: authentication disabled (one
implicit owner), a restart on the same store, and a store of the schema before owners, migrated when opened.
Sandboxes started in this module: six, all trivial scripts (echo and client-executed tools).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from service.callbacks import OWNER_HEADER, SIGNATURE_HEADER, verify
from service.schemas.job_models import JobSummary, JobView
from service.store.sqlite import SQLiteJobStore
from service.tenancy import IMPLICIT_OWNER
from tests.conftest import Service, execute, labelled_containers, start_service, wait_until
from tests.toolserver import ToolServer
from tests.unit.test_tenants import (  # noqa: F401
    ALICE_CALLBACK_SECRET,
    SERVER_CALLBACK_SECRET,
    TOKENS,
    Receiver,
    alice,
    bob,
    client_of,
    keys_file,
    receiver,
    root,
    tenants,
)

ECHO = {"kind": "echo"}


ASK = [{"name": "ask", "endpoint": {"kind": "client"}}]


UNKNOWN_JOB = "job_" + "0" * 24


UNKNOWN_SESSION = "ses_" + "0" * 24


TOOL_CREDENTIAL = "Bearer alice-tool-credential-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def alice_job(alice: httpx.Client, receiver: Receiver) -> dict[str, Any]:
    """An ended job of alice's with output, a call record, metadata and a delivered callback."""
    view = execute(
        alice,
        "import tools\nprint('alice private output', tools.t())\n",
        [{"name": "t", "endpoint": ECHO}],
        metadata={"tenant": "alice", "order": 17},
        callback_url=receiver.url,
    )
    assert view["status"] == "succeeded" and view["owner"] == "alice", (view["stderr"], view["error"])
    wait_until(lambda: alice.get(f"/jobs/{view['job_id']}").json()["callback"]["state"] == "delivered", 20)
    return view


@pytest.fixture(scope="module")
def bob_job(bob: httpx.Client, receiver: Receiver) -> dict[str, Any]:
    """Bob's job claiming to be alice's in its metadata, with a callback to the same receiver."""
    view = execute(bob, "print('bob')", metadata={"tenant": "alice", "order": 17}, callback_url=receiver.url)
    assert view["status"] == "succeeded" and view["owner"] == "bob"
    wait_until(lambda: bob.get(f"/jobs/{view['job_id']}").json()["callback"]["state"] == "delivered", 20)
    return view


def like_unknown(client: httpx.Client, method: str, path: str, real_id: str, unknown_id: str, **kw: Any) -> None:
    """``method path`` on another owner's ``real_id`` answers exactly as on an id that does not exist."""
    theirs = client.request(method, path.format(id=real_id), **kw)
    unknown = client.request(method, path.format(id=unknown_id), **kw)
    assert theirs.status_code == unknown.status_code, (theirs.status_code, theirs.text)
    assert theirs.headers["content-type"] == unknown.headers["content-type"]
    assert theirs.text.replace(real_id, unknown_id) == unknown.text


def test_list_shows_only_the_callers_jobs(alice: httpx.Client, bob: httpx.Client, alice_job: dict[str, Any]) -> None:
    mine = [j["job_id"] for j in alice.get("/jobs", params={"limit": 500}).json()["jobs"]]
    assert alice_job["job_id"] in mine
    for params in ({}, {"status": "succeeded"}, {"limit": 500}):
        listed = bob.get("/jobs", params=params).json()["jobs"]
        assert alice_job["job_id"] not in [j["job_id"] for j in listed]
        assert all(j["owner"] == "bob" for j in listed)


def test_view_of_another_keys_job_is_404(bob: httpx.Client, alice_job: dict[str, Any]) -> None:
    job_id = alice_job["job_id"]
    like_unknown(bob, "GET", "/jobs/{id}", job_id, UNKNOWN_JOB)
    like_unknown(bob, "GET", "/jobs/{id}", job_id, UNKNOWN_JOB, params={"stdout_offset": 0})
    assert bob.get(f"/jobs/{job_id}").status_code == 404


def test_output_of_another_keys_job_is_404(bob: httpx.Client, alice_job: dict[str, Any]) -> None:
    for stream in ("stdout", "stderr"):
        like_unknown(bob, "GET", f"/jobs/{{id}}/output/{stream}", alice_job["job_id"], UNKNOWN_JOB)
        like_unknown(
            bob, "GET", f"/jobs/{{id}}/output/{stream}", alice_job["job_id"], UNKNOWN_JOB, params={"offset": 3}
        )
    assert bob.get(f"/jobs/{alice_job['job_id']}/output/stdout").status_code == 404


def test_events_of_another_keys_job_are_404(bob: httpx.Client, alice_job: dict[str, Any]) -> None:
    like_unknown(bob, "GET", "/jobs/{id}/events", alice_job["job_id"], UNKNOWN_JOB)
    assert bob.get(f"/jobs/{alice_job['job_id']}/events").status_code == 404


def test_a_running_job_cannot_be_stopped_waited_on_followed_or_answered_by_another_key(
    alice: httpx.Client, bob: httpx.Client
) -> None:
    """The issue's attack: bob answered alice's pending client call and her script printed his answer."""
    script = "import tools\nprint('answer:', tools.ask())\n"
    job = alice.post("/execute", json={"script": script, "tools": ASK, "wait_s": 30}).json()
    assert job["status"] == "waiting", job
    job_id, [call] = job["job_id"], job["pending_calls"]
    injected = {"json": {"result": "bob's injected answer"}}
    like_unknown(bob, "POST", f"/jobs/{{id}}/calls/{call['call_id']}", job_id, UNKNOWN_JOB, **injected)
    like_unknown(bob, "POST", "/jobs/{id}/stop", job_id, UNKNOWN_JOB)
    like_unknown(bob, "POST", "/jobs/{id}/wait", job_id, UNKNOWN_JOB, params={"timeout_s": 5})
    like_unknown(bob, "GET", "/jobs/{id}", job_id, UNKNOWN_JOB)
    like_unknown(bob, "GET", "/jobs/{id}/events", job_id, UNKNOWN_JOB)
    like_unknown(bob, "GET", "/jobs/{id}/output/stdout", job_id, UNKNOWN_JOB)
    assert job_id not in [j["job_id"] for j in bob.get("/jobs").json()["jobs"]]
    still = alice.get(f"/jobs/{job_id}").json()
    assert still["status"] == "waiting" and [c["call_id"] for c in still["pending_calls"]] == [call["call_id"]]
    answered = alice.post(f"/jobs/{job_id}/calls/{call['call_id']}", json={"result": "alice's own answer"})
    assert answered.status_code == 200
    final = alice.post(f"/jobs/{job_id}/wait", params={"timeout_s": 30}).json()
    assert final["status"] == "succeeded" and final["stdout"] == "answer: alice's own answer\n"
    assert final["calls"][0]["result"] == "alice's own answer"


def test_another_keys_session_cannot_be_seen_deleted_or_run_in(
    alice: httpx.Client, bob: httpx.Client, root: httpx.Client
) -> None:
    created = alice.post("/sessions", json={"tools": [{"name": "t", "endpoint": ECHO}], "env": {"TOKEN": "s3"}})
    assert created.status_code == 201, created.text
    session = created.json()
    session_id = session["session_id"]
    try:
        first = execute(alice, "open('/tmp/alice.txt', 'w').write('alice file')\nprint('ok')", session_id=session_id)
        assert first["stdout"] == "ok\n"
        like_unknown(bob, "GET", "/sessions/{id}", session_id, UNKNOWN_SESSION)
        like_unknown(bob, "DELETE", "/sessions/{id}", session_id, UNKNOWN_SESSION)
        thief = "import os\nprint(open('/tmp/alice.txt').read(), os.environ.get('TOKEN'))\n"
        for sid in (session_id, UNKNOWN_SESSION):
            response = bob.post("/execute", json={"script": thief, "session_id": sid})
            assert response.status_code == 404, response.text
            assert response.json() == {
                "type": "tag:ptc-sandbox.dev,2026:problems/session-not-found",
                "title": "Session not found",
                "status": 404,
                "detail": f"no session with id {sid}",
            }
        assert session_id not in [s["session_id"] for s in bob.get("/sessions").json()["sessions"]]
        assert all(s["owner"] == "bob" for s in bob.get("/sessions").json()["sessions"])
        view = alice.get(f"/sessions/{session_id}").json()
        assert view["status"] == "ready" and view["executions"] == 1  # nothing of bob's ran, nothing ended it
        assert session_id in [s["session_id"] for s in alice.get("/sessions").json()["sessions"]]
        assert session["owner"] == first["owner"] == "alice"
        admin_view = [s for s in root.get("/sessions").json()["sessions"] if s["session_id"] == session_id]
        assert [s["owner"] for s in admin_view] == ["alice"]
        assert root.get(f"/sessions/{session_id}").status_code == 200
    finally:
        assert alice.delete(f"/sessions/{session_id}").json()["status"] == "closed"


def test_another_keys_toolset_is_unknown(
    alice: httpx.Client, bob: httpx.Client, root: httpx.Client, tool_server: ToolServer
) -> None:
    """Bob learns alice's toolset id: it is unknown to him, so her endpoint's credential never serves him."""
    tools = [
        {
            "name": "guarded",
            "endpoint": {
                "kind": "http",
                "url": tool_server.url("auth_echo"),
                "headers": {"Authorization": TOOL_CREDENTIAL},
            },
        }
    ]
    registered = alice.post("/toolsets", json={"tools": tools})
    assert registered.status_code == 200, registered.text
    toolset = registered.json()["toolset_id"]
    unknown = "ts_" + "0" * 32
    sent_before = len(tool_server.headers)
    script = "import tools\ntry:\n    tools.guarded()\nexcept tools.ToolError as e:\n    print(e.message)\n"
    for path, body in (
        ("/execute", {"script": script, "toolset": "{id}"}),
        ("/stubs", {"toolset": "{id}"}),
        ("/sessions", {"toolset": "{id}"}),
    ):
        theirs = bob.post(path, json={k: v.format(id=toolset) if k == "toolset" else v for k, v in body.items()})
        never = bob.post(path, json={k: v.format(id=unknown) if k == "toolset" else v for k, v in body.items()})
        assert theirs.status_code == never.status_code == 422, (path, theirs.text)
        assert theirs.text.replace(toolset, unknown) == never.text
    assert len(tool_server.headers) == sent_before  # nothing of bob's reached the tool
    assert alice.post("/stubs", json={"toolset": toolset}).status_code == 200
    assert root.post("/stubs", json={"toolset": toolset}).status_code == 200  # the admin role may use any
    # Registering the same manifest (credential included: bob must know it) gives bob the same id, as his own.
    assert bob.post("/toolsets", json={"tools": tools}).json()["toolset_id"] == toolset
    assert bob.post("/stubs", json={"toolset": toolset}).status_code == 200


def test_the_admin_role_sees_and_acts_on_everything(
    root: httpx.Client, alice: httpx.Client, alice_job: dict[str, Any], bob_job: dict[str, Any]
) -> None:
    listed = {j["job_id"]: j["owner"] for j in root.get("/jobs", params={"limit": 500}).json()["jobs"]}
    assert listed[alice_job["job_id"]] == "alice" and listed[bob_job["job_id"]] == "bob"
    view = root.get(f"/jobs/{alice_job['job_id']}").json()
    assert view["owner"] == "alice" and view["stdout"] == alice_job["stdout"]
    assert root.get(f"/jobs/{alice_job['job_id']}/output/stdout").content == alice_job["stdout"].encode()
    assert root.post(f"/jobs/{alice_job['job_id']}/stop").json()["status"] == "succeeded"  # ended: the view
    job = alice.post("/execute", json={"script": "import tools\ntools.ask()\n", "tools": ASK, "wait_s": 30}).json()
    assert root.post(f"/jobs/{job['job_id']}/stop").json()["status"] == "stopped"
    assert bob_job["job_id"] not in [j["job_id"] for j in alice.get("/jobs", params={"limit": 500}).json()["jobs"]]


def test_metrics_are_refused_to_a_tenant_and_served_to_the_admin_role_and_a_metrics_key(
    tenants: Service, alice: httpx.Client, root: httpx.Client, alice_job: dict[str, Any]
) -> None:
    refused = alice.get("/metrics")  # they name every tenant's tools and count everyone's jobs
    assert refused.status_code == 403 and "ptc_tool_calls_total" not in refused.text
    with tenants.client() as scraper:  # the suite's own key, named in PTC_METRICS_KEYS (tests/conftest.py)
        for reader in (root, scraper):
            answer = reader.get("/metrics")
            assert answer.status_code == 200 and 'ptc_executions_total{status="succeeded"}' in answer.text


def test_callbacks_name_their_owner_and_a_key_with_its_own_secret_gets_it(
    alice_job: dict[str, Any], bob_job: dict[str, Any], receiver: Receiver
) -> None:
    """Bob copies alice's metadata into his job: his callback still names bob, and alice's secret refuses it."""
    headers, body = receiver.delivery_of(alice_job["job_id"])
    delivered = json.loads(body)
    assert delivered["owner"] == "alice" and headers[OWNER_HEADER] == "alice"
    assert verify(ALICE_CALLBACK_SECRET, headers[SIGNATURE_HEADER], body)
    assert not verify(SERVER_CALLBACK_SECRET, headers[SIGNATURE_HEADER], body)
    assert Webhook(ALICE_CALLBACK_SECRET.encode()).verify(body, headers)["owner"] == "alice"  # Standard Webhooks
    with pytest.raises(WebhookVerificationError):
        Webhook(SERVER_CALLBACK_SECRET.encode()).verify(body, headers)

    headers, body = receiver.delivery_of(bob_job["job_id"])
    delivered = json.loads(body)
    assert delivered["metadata"] == alice_job["metadata"]  # the forged claim ...
    assert delivered["owner"] == "bob" and headers[OWNER_HEADER] == "bob"  # ... is signed as bob's
    assert verify(SERVER_CALLBACK_SECRET, headers[SIGNATURE_HEADER], body)
    assert not verify(ALICE_CALLBACK_SECRET, headers[SIGNATURE_HEADER], body)  # alice's receiver refuses it
    assert Webhook(SERVER_CALLBACK_SECRET.encode()).verify(body, headers)["owner"] == "bob"
    with pytest.raises(WebhookVerificationError):  # nor does the standardwebhooks library with alice's secret
        Webhook(ALICE_CALLBACK_SECRET.encode()).verify(body, headers)


def test_with_auth_disabled_there_is_one_implicit_owner(engine: docker.DockerClient, scratch: Path) -> None:
    svc = start_service(
        f"pytest-anon-{secrets.token_hex(4)}", scratch / "anon", PTC_AUTH="disabled", PTC_WARM_POOL_SIZE="0"
    )
    try:
        with httpx.Client(base_url=svc.url, timeout=60) as anyone:
            view = execute(anyone, "print('hi')")
            assert view["owner"] == IMPLICIT_OWNER == "anonymous"
            assert [(j["job_id"], j["owner"]) for j in anyone.get("/jobs").json()["jobs"]] == [
                (view["job_id"], "anonymous")
            ]
            assert anyone.get(f"/jobs/{view['job_id']}").json()["stdout"] == "hi\n"
            toolset = anyone.post("/toolsets", json={"tools": [{"name": "t", "endpoint": ECHO}]}).json()["toolset_id"]
            assert anyone.post("/stubs", json={"toolset": toolset}).status_code == 200
    finally:
        svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


def test_owners_survive_a_restart(engine: docker.DockerClient, scratch: Path) -> None:
    instance, work_dir = f"pytest-restart-owners-{secrets.token_hex(4)}", scratch / "restart-owners"
    env = {
        "PTC_API_KEYS_FILE": str(keys_file(scratch, "alice", "bob", "root")),
        "PTC_ADMIN_KEYS": "root",
        "PTC_WARM_POOL_SIZE": "0",
    }
    first = start_service(instance, work_dir, **env)
    try:
        with client_of(first, "alice") as alice:
            job = execute(alice, "print('kept')")
            toolset = alice.post("/toolsets", json={"tools": [{"name": "t", "endpoint": ECHO}]}).json()["toolset_id"]
    finally:
        first.stop()
    second = start_service(instance, work_dir, **env)
    try:
        with client_of(second, "alice") as alice, client_of(second, "bob") as bob, client_of(second, "root") as root:
            assert alice.get(f"/jobs/{job['job_id']}").json()["owner"] == "alice"
            like_unknown(bob, "GET", "/jobs/{id}", job["job_id"], UNKNOWN_JOB)
            assert bob.get("/jobs").json()["jobs"] == []
            assert [j["job_id"] for j in alice.get("/jobs").json()["jobs"]] == [job["job_id"]]
            assert [j["owner"] for j in root.get("/jobs").json()["jobs"]] == ["alice"]
            assert alice.post("/stubs", json={"toolset": toolset}).status_code == 200
            assert bob.post("/stubs", json={"toolset": toolset}).status_code == 422
    finally:
        second.stop()
    assert not labelled_containers(engine, instance, include_pool=True)


OLD_SCHEMA = """
CREATE TABLE jobs (
    job_id      TEXT PRIMARY KEY,
    status      TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    ended_at    TEXT,
    view        BLOB NOT NULL,
    summary     BLOB NOT NULL,
    callback_pending INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE toolsets (
    toolset_id  TEXT PRIMARY KEY,
    manifest    BLOB NOT NULL,
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX jobs_by_created ON jobs (created_at DESC, job_id DESC);
"""


"""The store's schema before owners were recorded (main before issue 11), written by hand."""


def old_store(path: Path, job_id: str, toolset_id: str) -> None:
    """A store of the old schema holding one ended job and one toolset, as main saved them."""
    now = datetime.now(UTC)
    view = {
        "job_id": job_id,
        "status": "succeeded",
        "exit_code": 0,
        "stdout": "legacy output\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "stdout_bytes": 14,
        "stderr_bytes": 0,
        "stdout_invalid_utf8": False,
        "stderr_invalid_utf8": False,
        "calls": [],
        "calls_over_limit": 0,
        "error": None,
        "metadata": {"from": "before owners"},
        "created_at": (now - timedelta(minutes=5)).isoformat(),
        "started_at": (now - timedelta(minutes=5)).isoformat(),
        "ended_at": (now - timedelta(minutes=4)).isoformat(),
        "duration_ms": 60000.0,
        "queue_ms": 1.0,
    }
    model = JobView.model_validate(view)
    assert "owner" not in model.model_dump(exclude_defaults=True)
    summary = JobSummary.model_validate({**model.model_dump(), "calls": 0}).model_dump_json(exclude={"owner"})
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute(
        "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, 0)",
        (
            job_id,
            "succeeded",
            "old-instance",
            model.created_at.isoformat(),
            model.ended_at.isoformat() if model.ended_at else None,
            model.model_dump_json(exclude={"owner"}).encode(),
            summary.encode(),
        ),
    )
    manifest = json.dumps([{"name": "t", "endpoint": ECHO}]).encode()
    db.execute("INSERT INTO toolsets (toolset_id, manifest) VALUES (?, ?)", (toolset_id, manifest))
    db.commit()
    db.close()


def test_an_old_store_is_migrated_and_its_rows_are_legacy(engine: docker.DockerClient, scratch: Path) -> None:
    """Rows from before owners get owner NULL: the admin role (and auth disabled) sees them, no tenant does."""
    work_dir = scratch / "old-store"
    job_id, toolset_id = "job_" + secrets.token_hex(12), "ts_" + secrets.token_hex(16)
    old_store(work_dir / "jobs.sqlite3", job_id, toolset_id)

    async def reopen() -> None:  # the store alone: the column and the owner table appear, the row is legacy
        store = SQLiteJobStore(work_dir / "jobs.sqlite3")
        await store.open()
        try:
            stored = await store.jobs.get(job_id)
            assert stored is not None and stored.owner is None
            assert await store.toolsets.get(toolset_id, "alice") is None
            assert await store.toolsets.get(toolset_id, None) is not None
        finally:
            await store.close()

    asyncio.run(reopen())
    with sqlite3.connect(work_dir / "jobs.sqlite3") as db:
        assert "owner" in {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        assert db.execute("SELECT owner FROM jobs WHERE job_id = ?", (job_id,)).fetchone() == (None,)

    instance = f"pytest-old-store-{secrets.token_hex(4)}"
    keyed = start_service(
        instance,
        work_dir,
        PTC_API_KEYS_FILE=str(keys_file(scratch, "alice", "root")),
        PTC_ADMIN_KEYS="root",
        PTC_WARM_POOL_SIZE="0",
    )
    try:
        with client_of(keyed, "alice") as alice, client_of(keyed, "root") as root:
            like_unknown(alice, "GET", "/jobs/{id}", job_id, UNKNOWN_JOB)
            assert alice.get("/jobs").json()["jobs"] == []
            assert alice.post("/stubs", json={"toolset": toolset_id}).status_code == 422
            assert [(j["job_id"], j["owner"]) for j in root.get("/jobs").json()["jobs"]] == [(job_id, None)]
            legacy = root.get(f"/jobs/{job_id}").json()
            assert legacy["stdout"] == "legacy output\n" and legacy.get("owner") is None  # served as it was saved
            assert root.post("/stubs", json={"toolset": toolset_id}).status_code == 200
    finally:
        keyed.stop()
    anonymous = start_service(instance, work_dir, PTC_AUTH="disabled", PTC_WARM_POOL_SIZE="0")
    try:
        with httpx.Client(base_url=anonymous.url, timeout=60) as anyone:
            assert anyone.get(f"/jobs/{job_id}").json()["stdout"] == "legacy output\n"
            assert [j["job_id"] for j in anyone.get("/jobs").json()["jobs"]] == [job_id]
    finally:
        anonymous.stop()
    assert not labelled_containers(engine, instance, include_pool=True)
