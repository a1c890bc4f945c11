"""Forwarding between replicas (docs/scaling.md, steps 3 and 4; issue 17): the internal calls' signatures, the
owner refusing any signed request that fails a check (never falling back to the bearer token), the egress rules
refusing the replicas' internal addresses, sessions in the store on both stores, and on PostgreSQL two in-process
services whose peers' client reaches the other app in process: requests about a job or a session held by the
other replica are relayed there and answered as the owner answers them, another key's ids stay 404 and are never
relayed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import httpx2
import orjson
import pytest
from fastapi import FastAPI
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from service.api import create_app
from service.egress import EgressDenied, EgressPolicy
from service.errors import InsecureConfig
from service.replicas import internal
from service.replicas.remote import Remote
from service.settings import Settings
from service.store import Incarnation, JobStore, Registration, StoredSession
from tests.unit.test_replicas import ALICE, BOB, INTERNAL_SECRET, bearer, held_until, replica
from tests.unit.test_replicas import short as short

SECRET = b"s" * 32
OLD = b"o" * 32


def signed(
    secret: bytes = SECRET,
    body: bytes = b"",
    target: str = "t1.1",
    now: float | None = None,
    path: str = "/jobs/j?calls=summary",
) -> dict[str, str]:
    headers = internal.signed_headers(secret, "POST", path, "alice", "t2", target, body, "key-1", None, now)
    return {**headers, "idempotency-key": "key-1"}


def verifier(*secrets: bytes) -> internal.Verifier:
    checker = internal.Verifier(list(secrets or (SECRET,)))
    checker.target = "t1.1"
    return checker


def test_a_signed_request_is_accepted_once_as_its_caller() -> None:
    checker = verifier()
    headers = signed(body=b'{"a": 1}')
    assert checker.verify("POST", "/jobs/j?calls=summary", headers, b'{"a": 1}') == "alice"
    with pytest.raises(internal.InternalRefused) as replayed:  # the same nonce again
        checker.verify("POST", "/jobs/j?calls=summary", headers, b'{"a": 1}')
    assert replayed.value.outcome == "replayed"
    assert checker.counts == {"accepted": 1, "replayed": 1}


@pytest.mark.parametrize(
    ("change", "outcome"),
    [
        (lambda h, b, p: (h, b + b" ", p), "bad_signature"),  # the body
        (lambda h, b, p: ({**h, internal.CALLER: "bob"}, b, p), "bad_signature"),  # a signed header
        (lambda h, b, p: ({**h, "idempotency-key": "key-2"}, b, p), "bad_signature"),  # a relayed header
        (lambda h, b, p: ({**h, internal.TARGET: "t1.2"}, b, p), "bad_signature"),  # the target, changed after
        (lambda h, b, p: (h, b, "/jobs/other?calls=summary"), "bad_signature"),  # the path
        (lambda h, b, p: (h, b, "/jobs/j?calls=full"), "bad_signature"),  # the query
        (lambda h, b, p: ({k: v for k, v in h.items() if k != internal.SIGNATURE}, b, p), "bad_signature"),
    ],
)
def test_a_tampered_request_is_refused(
    change: Callable[[dict[str, str], bytes, str], tuple[dict[str, str], bytes, str]], outcome: str
) -> None:
    headers, body, path = change(signed(body=b"{}"), b"{}", "/jobs/j?calls=summary")
    with pytest.raises(internal.InternalRefused) as refused:
        verifier().verify("POST", path, headers, body)
    assert refused.value.outcome == outcome


def test_another_incarnation_a_stale_date_and_another_secret_are_refused() -> None:
    checker = verifier()
    for headers, outcome in (
        (signed(target="t1.2"), "wrong_target"),  # signed for the owner's previous or next start
        (signed(now=datetime.now(UTC).timestamp() - 31), "stale"),
        (signed(now=datetime.now(UTC).timestamp() + 31), "stale"),
        (signed(secret=b"x" * 32), "bad_signature"),
    ):
        with pytest.raises(internal.InternalRefused) as refused:
            checker.verify("POST", "/jobs/j?calls=summary", headers, b"")
        assert refused.value.outcome == outcome
    unregistered = internal.Verifier([SECRET])  # target None: not registered yet
    with pytest.raises(internal.InternalRefused, match="another incarnation"):
        unregistered.verify("POST", "/jobs/j?calls=summary", signed(), b"")


def test_rotation_signs_with_the_first_secret_and_accepts_any() -> None:
    rotating = verifier(SECRET, OLD)
    assert rotating.verify("POST", "/jobs/j?calls=summary", signed(secret=OLD), b"") == "alice"
    assert rotating.verify("POST", "/jobs/j?calls=summary", signed(secret=SECRET), b"") == "alice"
    with pytest.raises(internal.InternalRefused):  # the old secret dropped: refused
        verifier(SECRET).verify("POST", "/jobs/j?calls=summary", signed(secret=OLD), b"")
    assert internal.parse_secrets(f"{SECRET.decode()} {OLD.decode()}") == [SECRET, OLD]


def test_the_nonce_set_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(internal, "MAX_NONCES", 3)
    checker = verifier()
    for _ in range(3):
        checker.verify("POST", "/jobs/j?calls=summary", signed(), b"")
    with pytest.raises(internal.InternalRefused) as full:
        checker.verify("POST", "/jobs/j?calls=summary", signed(), b"")
    assert full.value.outcome == "busy"


def test_the_secret_is_required_with_a_shared_store_and_long_enough(tmp_path: Path) -> None:
    with pytest.raises(InsecureConfig, match="at least 32 characters") as short_secret:
        create_app(Settings(work_dir=tmp_path, internal_secret="too-short", auth="disabled"))
    assert "too-short" not in str(short_secret.value)
    with pytest.raises(InsecureConfig, match="PTC_INTERNAL_SECRET"):
        create_app(Settings(work_dir=tmp_path, store_url="postgresql://u:p@127.0.0.1:1/db", auth="disabled"))
    rotating = Settings(work_dir=tmp_path, internal_secret="a" * 32 + " " + "b" * 40, auth="disabled")
    assert create_app(rotating).state.verifier is not None


async def test_the_egress_rules_refuse_the_replicas_internal_addresses() -> None:
    policy = EgressPolicy(["*://localhost:*", "*://127.0.0.0/8:*", "http://replica-2.internal:*"])
    assert policy.target("http://127.0.0.1:7001/x").port == 7001
    policy.refuse_peers(["http://127.0.0.1:7001", "http://replica-2.internal:8000"])
    for url in ("http://127.0.0.1:7001/x", "http://replica-2.internal:8000/"):
        with pytest.raises(EgressDenied, match="own address"):
            policy.target(url)
    with pytest.raises(EgressDenied, match="own address"):  # a name: refused once resolved
        await policy.resolve("http://localhost:7001/x")
    assert policy.target("http://127.0.0.1:7002/x").port == 7002  # another port of the same host
    policy.refuse_peers([])  # the registry changed: replaced
    assert policy.target("http://127.0.0.1:7001/x").port == 7001


# -- sessions in the store, both stores ------------------------------------------------------------------------


def stored_session(session_id: str, owner: str = "alice", ended: bool = False, epoch: int = 1) -> StoredSession:
    created = datetime(2026, 1, 1, tzinfo=UTC)
    view = {"session_id": session_id, "status": "closed" if ended else "ready", "owner": owner, "queued": 0}
    return StoredSession(
        session_id,
        owner,
        "r1",
        epoch,
        "closed" if ended else "ready",
        created,
        created if ended else None,
        created + timedelta(hours=1),
        orjson.dumps(view),
    )


async def test_sessions_are_saved_fenced_listed_and_broken_with_their_incarnation(store: JobStore) -> None:
    epoch = await store.replicas.register(Registration("r1", "http://127.0.0.1:8001", "a" * 64, "0.test", 10.0))
    me = Incarnation("r1", epoch)
    assert await store.sessions.save(stored_session("ses_a"), me)
    assert await store.sessions.save(stored_session("ses_b", owner="bob"), me)
    assert await store.sessions.save(stored_session("ses_c"), me)
    assert await store.sessions.save(stored_session("ses_c", ended=True), me)  # its end
    assert not await store.sessions.save(stored_session("ses_c"), me)  # an ended row never changes
    assert not await store.sessions.save(stored_session("ses_d"), Incarnation("r1", epoch + 1))  # not live
    assert [s.session_id for s in await store.sessions.unended("alice")] == ["ses_a"]
    assert {s.session_id for s in await store.sessions.unended(None)} == {"ses_a", "ses_b"}
    row = await store.sessions.get("ses_a")
    assert row is not None and (row.owner, row.instance_epoch, row.ended_at) == ("alice", epoch, None)
    assert await store.sessions.get("ses_zz") is None

    assert await store.sessions.mark_broken(Incarnation("r1", epoch + 1)) == []  # another incarnation's: none
    assert sorted(await store.sessions.mark_broken(me)) == ["ses_a", "ses_b"]
    assert await store.sessions.mark_broken(me) == []  # once
    broken = await store.sessions.get("ses_a")
    assert broken is not None and broken.status == "broken" and broken.ended_at is not None
    view = orjson.loads(broken.view)
    assert (view["status"], view["error"]["type"], view["expires_at"]) == ("broken", "session_broken", None)
    ended = await store.sessions.get("ses_c")
    assert ended is not None and ended.status == "closed"  # an ended session stays as it ended
    assert await store.sessions.unended(None) == []
    assert not await store.sessions.save(stored_session("ses_a"), me)  # its owner's late save changes nothing


# -- two services on one PostgreSQL store, the peers' client connected in process --------------------------------


class Peers(httpx.AsyncBaseTransport):
    """The peers' transport of the tests: each internal URL's app, in process (no TCP)."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}

    def add(self, url: str, app: FastAPI) -> None:
        self.apps[httpx.URL(url).netloc.decode()] = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self.apps.get(request.url.netloc.decode())
        if transport is None:
            raise httpx.ConnectError("no such peer", request=request)
        return await transport.handle_async_request(request)


Pair = tuple[FastAPI, FastAPI, httpx.AsyncClient, httpx.AsyncClient, httpx.AsyncClient]


@asynccontextmanager
async def pair(url: str, folder: Path) -> AsyncIterator[Pair]:
    """t1 and t2 on one store, each reaching the other in process: (app1, app2, alice on t1, alice on t2, bob on
    t2)."""
    peers = Peers()
    u1, u2 = "http://t1.peer:7001", "http://t2.peer:7002"
    async with (
        replica(folder / "w1", url, "t1", internal=u1) as (app1, alice1, _),
        replica(folder / "w2", url, "t2", internal=u2) as (app2, alice2, bob2),
    ):
        for app, name, own in ((app1, "t1", u1), (app2, "t2", u2)):
            peers.add(own, app)
            await app.state.remote.aclose()
            app.state.remote = Remote(INTERNAL_SECRET.encode(), name, transport=peers)
            await app.state.replicas.refresh()  # each knows the other now
        yield app1, app2, alice1, alice2, bob2


def counted(app: FastAPI, name: str, **labels: str) -> float:
    """A counter's value in the app's metrics (0 when absent)."""
    metric = app.state.metrics.registry.get_sample_value(f"{name}_total", labels)
    return float(metric or 0.0)


async def started(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    answer = await client.post("/execute", json={"wait_s": 0, "timeout_s": 30, **body})
    assert answer.status_code in (200, 202), answer.text
    return str(answer.json()["job_id"])


async def until_view(client: httpx.AsyncClient, job_id: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    view: dict[str, Any] = {}
    for _ in range(500):
        answer = await client.get(f"/jobs/{job_id}")
        assert answer.status_code == 200, answer.text
        view = answer.json()
        if check(view):
            return view
        await asyncio.sleep(0.02)
    raise AssertionError(f"never so: {view}")


async def test_requests_for_a_running_job_elsewhere_are_relayed_to_its_owner(postgres_url: str, short: Path) -> None:
    flag = short / "flag"
    async with pair(postgres_url, short) as (app1, app2, alice1, alice2, bob2):
        job_id = await started(alice1, {"script": held_until(flag)})
        view = await until_view(alice2, job_id, lambda v: v["stdout"] == "started\n")  # t1's live view, from t2
        assert view["status"] == "running"
        output = await alice2.get(f"/jobs/{job_id}/output/stdout")
        assert (output.status_code, output.content, output.headers["x-offset"]) == (200, b"started\n", "0")
        sliced = await alice2.get(f"/jobs/{job_id}", params={"stdout_offset": 3, "fields": "stdout"})
        assert sliced.json()["stdout"] == "rted\n"
        relayed = counted(app2, "ptc_forwarded_requests", route="/jobs/{job_id}", outcome="relayed")
        assert relayed >= 2

        accepted = counted(app1, "ptc_internal_requests", outcome="accepted")
        for method, path in (
            ("GET", f"/jobs/{job_id}"),
            ("GET", f"/jobs/{job_id}/events"),
            ("GET", f"/jobs/{job_id}/output/stdout"),
            ("POST", f"/jobs/{job_id}/stop"),
            ("POST", f"/jobs/{job_id}/wait"),
        ):
            assert (await bob2.request(method, path)).status_code == 404, path  # another tenant: never relayed
        assert counted(app1, "ptc_internal_requests", outcome="accepted") == accepted
        assert counted(app2, "ptc_forwarded_requests", route="/jobs/{job_id}", outcome="relayed") == relayed

        stopped = await alice2.post(f"/jobs/{job_id}/stop", params={"calls": "summary"})  # stopped by t1, from t2
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["status"] == "stopped"
        for client in (alice1, alice2):  # ended: served from the store by either, nothing relayed
            assert (await client.get(f"/jobs/{job_id}")).json()["status"] == "stopped"
        assert counted(app2, "ptc_forwarded_requests", route="/jobs/{job_id}/stop", outcome="relayed") == 1


@contextmanager
def lagging(app: FastAPI) -> Iterator[None]:
    """The app's store reads every unended job's row as ``waiting`` (a row that lags its owner)."""
    store = app.state.store
    get = store.jobs.get

    async def stale(job_id: str) -> Any:
        row = await get(job_id)
        return dataclasses.replace(row, status="waiting") if row is not None and row.ended_at is None else row

    store.jobs.get = stale
    try:
        yield
    finally:
        store.jobs.get = get


async def test_waits_calls_and_approvals_elsewhere(postgres_url: str, short: Path) -> None:
    client_tool = {
        "name": "ask",
        "parameters": {"properties": {"q": {"type": "string"}}},
        "endpoint": {"kind": "client"},
    }
    gated = {
        "name": "write",
        "parameters": {"properties": {"path": {"type": "string"}}},
        "approval": "always",
        "endpoint": {"kind": "echo"},
    }
    async with pair(postgres_url, short) as (_app1, app2, alice1, alice2, bob2):
        asking = await started(alice1, {"script": "import tools\nprint(tools.ask(q='x'))\n", "tools": [client_tool]})
        gating = await started(
            alice1, {"script": "import tools\nprint(tools.write(path='/a')['args'])\n", "tools": [gated]}
        )
        for job_id, answer in ((asking, {"result": 42}), (gating, None)):
            waited = await alice2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 20})  # waits on t2, view from t1
            assert waited.status_code == 200, waited.text
            assert waited.json()["status"] == "waiting"
            [call] = waited.json()["pending_calls"]
            base = f"/jobs/{job_id}/calls/{call['call_id']}"
            if answer is None:
                assert (await bob2.post(f"{base}/approve")).status_code == 404
                decided = await alice2.post(f"{base}/approve", json={"reason": "fine"})
            else:
                assert (await bob2.post(base, json=answer)).status_code == 404
                decided = await alice2.post(base, json=answer)
            assert decided.status_code == 200, decided.text
            with lagging(app2):  # t2 reads the row as still waiting: the wait goes to t1, which knows better
                ended = await alice2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 20})
            assert ended.json()["status"] == "succeeded", ended.text
        assert (await alice2.get(f"/jobs/{asking}")).json()["stdout"] == "42\n"
        gated_view = (await alice2.get(f"/jobs/{gating}")).json()
        assert gated_view["stdout"] == "{'path': '/a'}\n"
        assert gated_view["calls"][0]["approval"]["by"] == "alice"


async def test_the_owner_refuses_bad_signatures_without_falling_back_to_the_bearer_token(
    postgres_url: str, short: Path
) -> None:
    async with pair(postgres_url, short) as (app1, _app2, alice1, _alice2, _bob2):
        incarnation = app1.state.replicas.incarnation
        target = f"{incarnation.instance_id}.{incarnation.epoch}"
        good = internal.signed_headers(INTERNAL_SECRET.encode(), "GET", "/jobs", "alice", "t2", target, b"")
        assert (await alice1.get("/jobs", headers=good)).status_code == 200  # the bearer token is ignored
        replayed = await alice1.get("/jobs", headers=good)
        assert replayed.status_code == 401, replayed.text  # even with alice's valid token beside it
        for headers in (
            internal.signed_headers(b"w" * 32, "GET", "/jobs", "alice", "t2", target, b""),
            internal.signed_headers(INTERNAL_SECRET.encode(), "GET", "/jobs", "alice", "t2", "t1.999", b""),
            internal.signed_headers(INTERNAL_SECRET.encode(), "GET", "/other", "alice", "t2", target, b""),
            internal.signed_headers(INTERNAL_SECRET.encode(), "GET", "/jobs", "", "t2", target, b""),  # no key
        ):
            refused = await alice1.get("/jobs", headers=headers)
            assert refused.status_code == 401, refused.text
        assert counted(app1, "ptc_internal_requests", outcome="replayed") == 1
        assert counted(app1, "ptc_internal_requests", outcome="wrong_target") == 1


async def test_a_session_elsewhere_is_served_through_either_replica(postgres_url: str, short: Path) -> None:
    async with pair(postgres_url, short) as (app1, app2, alice1, alice2, bob2):
        created = await alice1.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        listed = (await alice2.get("/sessions")).json()["sessions"]  # from the store
        assert [s["session_id"] for s in listed] == [session_id]
        assert (await bob2.get("/sessions")).json()["sessions"] == []
        assert (await alice2.get(f"/sessions/{session_id}")).json()["status"] == "ready"  # relayed: exact
        ran = await alice2.post(
            "/execute",
            json={"script": "print('in session')", "session_id": session_id},
            headers={"Idempotency-Key": "run-1"},
        )
        assert ran.status_code == 200, ran.text
        assert (ran.json()["status"], ran.json()["stdout"]) == ("succeeded", "in session\n")
        again = await alice2.post(  # replayed by the owner, which claimed the key
            "/execute",
            json={"script": "print('in session')", "session_id": session_id},
            headers={"Idempotency-Key": "run-1"},
        )
        assert again.json()["job_id"] == ran.json()["job_id"], again.text
        put = await alice2.put(f"/sessions/{session_id}/files/m.txt", content=b"eight")
        assert put.status_code == 200, put.text
        got = await alice2.get(f"/sessions/{session_id}/files/m.txt")
        assert (got.status_code, got.content) == (200, b"eight")
        for method, path in (
            ("GET", f"/sessions/{session_id}"),
            ("DELETE", f"/sessions/{session_id}"),
            ("GET", f"/sessions/{session_id}/files/m.txt"),
        ):
            assert (await bob2.request(method, path)).status_code == 404, path
        bob_run = await bob2.post("/execute", json={"script": "print(1)", "session_id": session_id})
        assert bob_run.status_code == 404, bob_run.text
        assert counted(app2, "ptc_forwarded_requests", route="/execute", outcome="relayed") == 1  # the replay: stored
        deleted = await alice2.delete(f"/sessions/{session_id}")
        assert deleted.status_code == 200 and deleted.json()["status"] == "closed", deleted.text
        view = await alice2.get(f"/sessions/{session_id}")  # ended: the store's view, on t2
        assert view.status_code == 200 and view.json()["status"] == "closed"
        assert (await alice2.get("/sessions")).json()["sessions"] == []
        assert app1.state.jobs is not None


@asynccontextmanager
async def mcp_session(app: FastAPI, token: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://test", headers=bearer(token), timeout=30
        ) as client,
        streamable_http_client("http://test/mcp", http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def test_the_mcp_front_relays_get_wait_and_stop(postgres_url: str, short: Path) -> None:
    flag = short / "flag"
    async with pair(postgres_url, short) as (app1, app2, alice1, _alice2, _bob2):
        job_id = await started(alice1, {"script": held_until(flag)})
        async with mcp_session(app2, BOB) as session:  # another key: not found, nothing relayed
            refused = await session.call_tool("get_job", {"job_id": job_id})
            assert refused.is_error and "job-not-found" in str(refused.content[0])
        assert counted(app1, "ptc_internal_requests", outcome="accepted") == 0
        async with mcp_session(app2, ALICE) as session:
            view = await session.call_tool("get_job", {"job_id": job_id})  # t1's live view
            assert not view.is_error and isinstance(view.structured_content, dict), view.content
            assert view.structured_content["status"] in ("queued", "running")
            waited = await session.call_tool("wait_job", {"job_id": job_id, "timeout_s": 0})
            assert isinstance(waited.structured_content, dict)
            assert waited.structured_content["status"] in ("queued", "running")
            stopped = await session.call_tool("stop_job", {"job_id": job_id})
            assert isinstance(stopped.structured_content, dict) and stopped.structured_content["status"] == "stopped"
        assert counted(app1, "ptc_internal_requests", outcome="accepted") == 3


async def test_a_repeated_key_on_the_other_replica_is_replayed_by_the_owner(postgres_url: str, short: Path) -> None:
    """A client retrying through the balancer: the repeat of a job still running, or of a session still open,
    lands on the replica that does not hold it and is relayed to the owner, which replays it (not a 503)."""
    flag = short / "flag"
    async with pair(postgres_url, short) as (app1, app2, alice1, alice2, bob2):
        body = {"script": held_until(flag), "wait_s": 0, "timeout_s": 30}
        first = await alice1.post("/execute", json=body, headers={"Idempotency-Key": "job-1"})
        assert first.status_code == 202, first.text
        again = await alice2.post("/execute", json=body, headers={"Idempotency-Key": "job-1"})
        assert again.status_code == 202, again.text
        assert again.json()["job_id"] == first.json()["job_id"]
        assert again.headers["idempotent-replayed"] == "true"
        flag.touch()

        session = await alice1.post("/sessions", json={}, headers={"Idempotency-Key": "ses-1"})
        assert session.status_code == 201, session.text
        repeat = await alice2.post("/sessions", json={}, headers={"Idempotency-Key": "ses-1"})
        assert repeat.status_code == 201, repeat.text
        assert repeat.json()["session_id"] == session.json()["session_id"]
        assert repeat.headers["idempotent-replayed"] == "true"
        bobs = await bob2.post("/sessions", json={}, headers={"Idempotency-Key": "ses-1"})  # bob's key: his own
        assert bobs.status_code == 201 and bobs.json()["session_id"] != session.json()["session_id"]
        assert "idempotent-replayed" not in bobs.headers
        assert counted(app2, "ptc_forwarded_requests", route="/sessions", outcome="relayed") == 1
        assert app1.state.jobs is not None
