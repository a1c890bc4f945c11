"""Approval-gated tools (``approval`` in the manifest), engine-free: the rule's parsing, the broker's pause and
decisions, and the whole service on the fake backend (status ``waiting``, approve / deny / time out, 404 and 409)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from service.api import create_app
from service.broker import Broker, BrokerConfig, BrokerHooks, BrokerShared
from service.broker.checks import check_arguments
from service.errors import CallNotPending, ManifestError
from service.sandbox.fake import FakeBackend
from service.schemas.job_models import CallRecord
from service.settings import Settings
from service.tenancy import hash_token
from service.toolkit.endpoints import EndpointClients
from service.toolkit.manifest import parse_tool
from service.toolkit.stubs import APPROVAL_NOTE, generate_stub_module

ECHO = {"kind": "echo"}
PARAMS = {"properties": {"path": {"type": "string"}, "size": {"type": "integer"}}, "required": ["path"]}
RULE = {"when": {"properties": {"path": {"pattern": "^/etc/"}}}}
ALICE, BOB, ROOT = "alice-token-0123456789", "bob-token-0123456789", "root-token-0123456789"


# -- the manifest field ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("approval", "needed"),
    [
        (None, {"x": False}),
        ("never", {"x": False}),
        ("always", {"x": True}),
        (RULE, {"/etc/passwd": True, "/tmp/x": False}),
    ],
)
def test_the_rule_decides_which_valid_calls_need_approval(approval: Any, needed: dict[str, bool]) -> None:
    entry: dict[str, Any] = {"name": "write", "parameters": PARAMS, "endpoint": ECHO}
    if approval is not None:
        entry["approval"] = approval
    tool = parse_tool(entry, ("tools", 0))
    for path, expected in needed.items():
        assert check_arguments(tool, {"path": path}).needs_approval is expected, path
    assert check_arguments(tool, {"path": 3}).needs_approval is False  # invalid: refused, never shown for approval


@pytest.mark.parametrize(
    ("extra", "where", "message"),
    [
        ({"approval": "sometimes"}, "approval", "approval must be"),
        ({"approval": {"when": {"type": "nope"}}}, "approval.when", "not a valid JSON Schema"),
        ({"approval": {"when": {}, "also": 1}}, "approval", "approval must be"),
        ({"approval": {"when": [1]}}, "approval.when", "JSON Schema object"),
        ({"approval": "always", "endpoint": {"kind": "client"}}, "approval", "client-executed"),
        ({"approval": "always", "approval_timeout_s": 0}, "approval_timeout_s", "approval_timeout_s must be"),
        (
            {"approval": {"when": {"patternProperties": {"a": {}}, "unevaluatedProperties": False}}},
            "approval.when",
            "may not combine",
        ),
        # an invalid pattern fails to match at call time: the rule never matched and every call went unapproved
        (
            {"approval": {"when": {"properties": {"path": {"pattern": "^/etc/\\cA"}}}}},
            "approval.when",
            "invalid pattern",
        ),
        (
            {"approval": {"when": {"anyOf": [{"patternProperties": {"a{2,1}": {}}}]}}},
            "approval.when",
            "invalid pattern",
        ),
    ],
)
def test_bad_rules_are_refused_when_the_manifest_is_parsed(extra: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_tool({"name": "write", "parameters": PARAMS, "endpoint": ECHO, **extra}, ("tools", 0))
    assert ".".join(map(str, caught.value.loc)) == f"tools.0.{where}"
    assert message in str(caught.value)


def test_a_pattern_in_data_is_not_a_pattern() -> None:
    rule = {"when": {"properties": {"path": {"const": {"pattern": "("}, "enum": [{"pattern": "("}], "pattern": "^/"}}}}
    tool = parse_tool({"name": "write", "parameters": PARAMS, "endpoint": ECHO, "approval": rule}, ("tools", 0))
    assert tool.approval is not None


async def test_bad_rules_answer_422_problems() -> None:
    async with service() as (client, _):
        tools = [{"name": "w", "approval": {"when": {"minLength": "x"}}, "endpoint": ECHO}]
        for path, body in (("/execute", {"script": "1", "tools": tools}), ("/toolsets", {"tools": tools})):
            answer = await client.post(path, json=body, headers=auth(ALICE))
            assert answer.status_code == 422, answer.text
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["detail"].startswith("tools.0.approval.when: when is not a valid JSON Schema")


# -- the broker ----------------------------------------------------------------------------------------------------


async def test_the_broker_holds_a_call_until_it_is_decided(tmp_path: Path) -> None:
    tool = parse_tool({"name": "w", "parameters": PARAMS, "approval": "always", "endpoint": ECHO}, ("t", 0))
    client_tool = parse_tool({"name": "ask", "endpoint": {"kind": "client"}}, ("t", 1))
    counts: list[int] = []
    endpoints = EndpointClients(5.0, 1 << 20)
    try:
        tools = {"w": tool, "ask": client_tool}
        broker = Broker(
            tools,
            BrokerShared(endpoints),
            BrokerConfig(10, 1 << 20, 1 << 20),
            hooks=BrokerHooks(on_paused_calls=counts.append),
        )
        await broker.start(tmp_path / "s")
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "s"))
        for n, (name, args) in enumerate([("w", {"path": "a"}), ("w", {"path": "b"}), ("ask", {})], 1):
            writer.write(orjson.dumps({"id": n, "tool": name, "args": args}) + b"\n")
        await until(lambda: len(broker.paused.pending_calls) == 3)
        assert [(p["tool"], p["awaiting"]) for p in broker.paused.pending_calls] == [
            ("w", "approval"),
            ("w", "approval"),
            ("ask", "client"),
        ]
        first, second, asked = (p["call_id"] for p in broker.paused.pending_calls)
        with pytest.raises(CallNotPending):
            broker.paused.answer_client_call(first, True, 1)  # an approval is not a client's answer
        with pytest.raises(CallNotPending):
            broker.paused.decide_approval(asked, True, "alice", None)  # nor the reverse
        broker.paused.decide_approval(first, True, "alice", "fine")
        broker.paused.decide_approval(second, False, "alice", "not that one")
        with pytest.raises(CallNotPending):
            broker.paused.decide_approval(second, True, "alice", None)  # decided already
        broker.paused.answer_client_call(asked, True, 7)
        replies = {reply["id"]: reply for reply in [orjson.loads(await reader.readline()) for _ in range(3)]}
        assert replies[1] == {"ok": True, "result": {"tool": "w", "args": {"path": "a"}}, "id": 1}
        assert replies[2]["error"] == {"type": "denied", "message": "w: denied: not that one"}
        assert replies[3]["result"] == 7
        records = {r["call_id"]: r for r in broker.records.calls}
        assert records[first]["approval"]["decision"] == "approved" and records[first]["approval"]["by"] == "alice"
        assert records[second]["approval"]["reason"] == "not that one"
        assert (records[second]["status"], records[asked]["approval"]) == ("error", None)
        assert counts[:3] == [1, 2, 3] and counts[-1] == 0
        writer.close()
        await writer.wait_closed()
        await broker.close()
    finally:
        await endpoints.aclose()


# -- the whole service on the fake backend --------------------------------------------------------------------


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def until(condition: Callable[[], Any], timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


@contextlib.asynccontextmanager
async def service(**overrides: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend]]:
    """The service on a ``FakeBackend``, with the keys alice, bob and root (the admin role) and the given settings."""
    work_dir = Path(tempfile.mkdtemp(prefix="ptca", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        api_keys=f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)},root:{hash_token(ROOT)}",
        admin_keys="root",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
        **overrides,
    )
    backend = FakeBackend()
    app = create_app(settings, backend)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as client:
                yield client, backend
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


SCRIPT = (
    "import tools\n"
    "for path in ('/etc/a', '/tmp/b', '/etc/c'):\n"
    "    try:\n"
    "        print(tools.write(path=path)['args']['path'], flush=True)\n"
    "    except tools.ToolError as e:\n"
    "        print(e.type, e.message, flush=True)\n"
)


async def pending(client: httpx.AsyncClient, job_id: str, count: int) -> dict[str, Any]:
    view: dict[str, Any] = {}

    async def check() -> bool:
        nonlocal view
        view = (await client.get(f"/jobs/{job_id}", headers=auth(ALICE))).json()
        return len(view["pending_calls"]) == count

    for _ in range(1000):
        if await check():
            return view
        await asyncio.sleep(0.02)
    raise AssertionError(f"never {count} pending calls: {view}")


async def ended(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    """The job's view once it has ended (``/wait`` returns as soon as it waits for the harness, so poll)."""
    for _ in range(1000):
        view: dict[str, Any] = (await client.get(f"/jobs/{job_id}", headers=auth(ALICE))).json()
        if view["status"] not in ("queued", "running", "waiting"):
            return view
        await asyncio.sleep(0.02)
    raise AssertionError(f"the job never ended: {view}")


async def test_a_job_waits_for_approval_and_only_its_owner_decides() -> None:
    tools = [{"name": "write", "parameters": PARAMS, "approval": RULE, "endpoint": ECHO}]
    async with service() as (client, _):
        answer = await client.post("/execute", json={"script": SCRIPT, "tools": tools}, headers=auth(ALICE))
        assert answer.status_code == 202, answer.text  # /execute returns as soon as the job waits for the harness
        job_id = answer.json()["job_id"]
        view = await pending(client, job_id, 1)
        assert view["status"] == "waiting"
        [call] = view["pending_calls"]
        assert (call["tool"], call["args"], call["awaiting"]) == ("write", {"path": "/etc/a"}, "approval")
        base = f"/jobs/{job_id}/calls/{call['call_id']}"
        for path in ("approve", "deny"):  # another key: as if the job did not exist
            refused = await client.post(f"{base}/{path}", json={"reason": "mine"}, headers=auth(BOB))
            assert refused.status_code == 404, refused.text
        assert (await client.post(base, json={"result": 1}, headers=auth(ALICE))).status_code == 409
        assert (await client.post(f"{base}/approve", json={"x": 1}, headers=auth(ALICE))).status_code == 422
        too_long = await client.post(f"{base}/deny", json={"reason": "r" * 2001}, headers=auth(ALICE))
        assert too_long.status_code == 422 and too_long.headers["content-type"] == "application/problem+json"
        surrogate = await client.post(  # a reason the record could not encode
            f"{base}/deny",
            content=b'{"reason": "\\ud800"}',
            headers={**auth(ALICE), "content-type": "application/json"},
        )
        assert surrogate.status_code == 422, surrogate.text
        approved = await client.post(f"{base}/approve", headers=auth(ALICE))  # no body: no reason
        assert approved.status_code == 200, approved.text
        assert (await client.post(f"{base}/approve", headers=auth(ALICE))).status_code == 409  # twice
        view = await pending(client, job_id, 1)  # /tmp/b went through without approval; /etc/c waits
        [call] = view["pending_calls"]
        assert call["args"] == {"path": "/etc/c"}
        denied = await client.post(
            f"/jobs/{job_id}/calls/{call['call_id']}/deny",
            json={"reason": "not /etc"},
            headers=auth(ALICE),
            params={"calls": "summary", "fields": "calls"},  # the answer in the caller's selection
        )
        assert denied.status_code == 200, denied.text
        assert set(denied.json()) == {"job_id", "status", "calls"}
        assert "/etc/a" not in denied.text and denied.json()["calls"][0]["approval"]["decision"] == "approved"
        final = await ended(client, job_id)
        assert final["status"] == "succeeded", final
        assert final["stdout"] == "/etc/a\n/tmp/b\ndenied write: denied: not /etc\n"
        first, second, third = final["calls"]
        assert first["approval"]["decision"] == "approved" and first["approval"]["by"] == "alice"
        assert first["approval"]["reason"] is None and first["approval"]["at"] >= first["started_at"]
        assert (second["status"], second["approval"]) == ("ok", None)
        assert (third["status"], third["error"]["type"]) == ("error", "denied")
        assert third["approval"] == {**third["approval"], "decision": "denied", "by": "alice", "reason": "not /etc"}
        assert list(first) == list(CallRecord.model_fields)  # the record keeps the order of CallRecord's fields
        late = await client.post(f"/jobs/{job_id}/calls/{call['call_id']}/deny", headers=auth(ALICE))
        assert late.status_code == 409  # the job has ended
        assert (await client.post(f"/jobs/{job_id}/calls/x/deny", headers=auth(BOB))).status_code == 404


async def test_an_approval_that_never_comes_times_out() -> None:
    tools = [
        {"name": "write", "parameters": PARAMS, "approval": "always", "approval_timeout_s": 0.5, "endpoint": ECHO},
        {"name": "other", "approval": "always", "endpoint": ECHO},
    ]
    script = SCRIPT.replace("('/etc/a', '/tmp/b', '/etc/c')", "('/etc/a',)") + (
        "try:\n    tools.other()\nexcept tools.ToolError as e:\n    print(e.type, flush=True)\n"
    )
    async with service(approval_timeout_s=0.5) as (client, _):
        answer = await client.post("/execute", json={"script": script, "tools": tools}, headers=auth(ALICE))
        final = await ended(client, answer.json()["job_id"])
        assert final["status"] == "succeeded", final
        assert final["stdout"] == (
            "approval_timeout write: no approval came within 0.5 s; the call was not made\napproval_timeout\n"
        )
        for call in final["calls"]:
            assert (call["status"], call["error"]["type"]) == ("timeout", "approval_timeout")
            assert call["approval"]["decision"] == "timed_out" and call["approval"]["by"] is None


async def test_the_admin_role_decides_in_its_own_name() -> None:
    tools = [{"name": "write", "parameters": PARAMS, "approval": "always", "endpoint": ECHO}]
    script = "import tools\nprint(tools.write(path='/x')['args'])\n"
    async with service() as (client, _):
        job_id = (await client.post("/execute", json={"script": script, "tools": tools}, headers=auth(ALICE))).json()[
            "job_id"
        ]
        [call] = (await pending(client, job_id, 1))["pending_calls"]
        approved = await client.post(f"/jobs/{job_id}/calls/{call['call_id']}/approve", headers=auth(ROOT))
        assert approved.status_code == 200, approved.text
        final = await ended(client, job_id)
        assert (final["status"], final["stdout"]) == ("succeeded", "{'path': '/x'}\n")
        assert final["calls"][0]["approval"]["by"] == "root"


async def test_stopping_a_job_that_awaits_approval_ends_it() -> None:
    tools = [{"name": "write", "parameters": PARAMS, "approval": "always", "endpoint": ECHO}]
    async with service() as (client, _):
        answer = await client.post("/execute", json={"script": SCRIPT, "tools": tools}, headers=auth(ALICE))
        job_id = answer.json()["job_id"]
        [call] = (await pending(client, job_id, 1))["pending_calls"]
        stopped = (await client.post(f"/jobs/{job_id}/stop", headers=auth(ALICE))).json()
        assert stopped["status"] == "stopped", stopped
        assert stopped["pending_calls"] == []
        [record] = stopped["calls"]
        assert (record["status"], record["error"]["type"], record["approval"]) == ("error", "cancelled", None)
        late = await client.post(f"/jobs/{job_id}/calls/{call['call_id']}/approve", headers=auth(ALICE))
        assert late.status_code == 409


def test_the_stub_of_a_gated_tool_says_a_call_may_be_denied() -> None:
    gated = parse_tool({"name": "write", "parameters": PARAMS, "approval": RULE, "endpoint": ECHO}, ("tools", 0))
    free = parse_tool({"name": "read", "parameters": PARAMS, "endpoint": ECHO}, ("tools", 1))
    module = generate_stub_module([gated, free])
    assert module.count(APPROVAL_NOTE) == 1
    assert module.index(APPROVAL_NOTE) < module.index("def read(")


async def test_a_flood_of_short_waits_does_not_save_the_view_at_each_flip(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each call waits 1 ms for an approval that never comes: the job flips running / waiting twice per call. A save
    # per flip wrote the whole view each time (quadratic: gigabytes for a few thousand calls of a few KB).
    from service.store import Incarnation, StoredJob
    from service.store.sqlite_jobs import SQLiteJobRecords

    saves: list[str] = []
    save = SQLiteJobRecords.save  # the runner's saves (fenced by its incarnation)

    async def counted(self: SQLiteJobRecords, job: StoredJob, incarnation: Incarnation) -> bool:
        saves.append(job.status)
        return await save(self, job, incarnation)

    monkeypatch.setattr(SQLiteJobRecords, "save", counted)
    calls = 100
    tools = [{"name": "w", "parameters": PARAMS, "approval": "always", "approval_timeout_s": 0.001, "endpoint": ECHO}]
    script = (
        f"import tools\nfor i in range({calls}):\n    try:\n        tools.w(path='x' * 1000)\n"
        "    except tools.ToolError as e:\n        assert e.type == 'approval_timeout', e.type\nprint('done')\n"
    )
    async with service() as (client, _):
        answer = await client.post("/execute", json={"script": script, "tools": tools}, headers=auth(ALICE))
        final = await ended(client, answer.json()["job_id"])
        assert (final["status"], final["stdout"], len(final["calls"])) == ("succeeded", "done\n", calls), final
        [listed] = (await client.get("/jobs", params={"status": "succeeded"}, headers=auth(ALICE))).json()["jobs"]
        assert listed["job_id"] == final["job_id"]  # no status save overtook the final one
    assert saves[-1] == "succeeded"
    assert len(saves) < calls // 2, saves  # 2 flips per call, once a save each


async def test_decisions_racing_each_other_and_a_stop_decide_once() -> None:
    # Twenty approve/deny requests at once, from the owner, the admin role and another key, with a stop among them
    tools = [{"name": "write", "parameters": PARAMS, "approval": "always", "endpoint": ECHO}]
    script = SCRIPT.replace("('/etc/a', '/tmp/b', '/etc/c')", "('/etc/a',)")
    async with service() as (client, _):
        answer = await client.post("/execute", json={"script": script, "tools": tools}, headers=auth(ALICE))
        job_id = answer.json()["job_id"]
        [call] = (await pending(client, job_id, 1))["pending_calls"]
        base = f"/jobs/{job_id}/calls/{call['call_id']}"
        tokens = [ALICE, ROOT, BOB]
        decisions = [
            client.post(
                f"{base}/{'approve' if i % 2 else 'deny'}", json={"reason": f"r{i}"}, headers=auth(tokens[i % 3])
            )
            for i in range(20)
        ]
        *decided, stopped = await asyncio.gather(*decisions, client.post(f"/jobs/{job_id}/stop", headers=auth(ALICE)))
        assert stopped.status_code == 200, stopped.text
        codes = [d.status_code for d in decided]
        assert codes.count(200) <= 1 and set(codes) <= {200, 404, 409}, codes  # none if the stop came first
        assert all(d.status_code == 404 for d, i in zip(decided, range(20), strict=True) if i % 3 == 2)  # bob's
        final = await ended(client, job_id)
        [record] = final["calls"]
        if 200 in codes:
            won = codes.index(200)
            assert (record["approval"]["reason"], record["approval"]["by"]) == (f"r{won}", ["alice", "root"][won % 3])
        else:
            assert (record["approval"], record["error"]["type"]) == (None, "cancelled")


async def test_a_pattern_too_costly_to_compile_answers_422_before_any_call() -> None:
    bomb = {"properties": {"path": {"type": "string", "pattern": "(?:(?:a{1000}){1000}){100}"}}}
    async with service() as (client, _):
        for tools in (
            [{"name": "w", "parameters": bomb, "endpoint": ECHO}],
            [{"name": "w", "parameters": PARAMS, "approval": {"when": bomb}, "endpoint": ECHO}],
        ):
            for path, body in (("/execute", {"script": "1", "tools": tools}), ("/toolsets", {"tools": tools})):
                answer = await client.post(path, json=body, headers=auth(ALICE))
                assert answer.status_code == 422, answer.text
                assert answer.json()["type"].endswith("/invalid-manifest")
                assert "too costly to compile" in answer.json()["detail"]
