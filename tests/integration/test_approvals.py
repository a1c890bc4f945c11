"""Approval-gated tools end to end (issue 14, point 5): a write tool served by a real HTTP tool server, its calls held
for approval in a real sandbox; approved ones reach the server, denied and timed-out ones never do.

One service of its own runs with two keys, ``alice`` (who runs the job) and ``bob`` (who may not decide on it).
Sandboxes started in this module: one.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import Service, labelled_containers, start_service, wait_until
from tests.toolserver import ToolServer

TOKENS = {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}


@pytest.fixture(scope="module")
def approvals(engine: docker.DockerClient, scratch: Path, tool_server: ToolServer) -> Iterator[Service]:
    keys = scratch / "approvals.keys"
    keys.write_text("".join(f"{name}:{hash_token(token)}\n" for name, token in TOKENS.items()))
    port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    svc = start_service(
        f"pytest-approvals-{secrets.token_hex(4)}",
        scratch / "approvals",
        PTC_API_KEYS_FILE=str(keys),
        PTC_WARM_POOL_SIZE="0",
        PTC_EGRESS_ALLOW=f"http://127.0.0.1:{port}",
    )
    yield svc
    svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


def like_unknown(client: httpx.Client, method: str, path: str, real_id: str, unknown_id: str, **kw: Any) -> None:
    """``method path`` on another owner's ``real_id`` answers exactly as on an id that does not exist."""
    theirs = client.request(method, path.format(id=real_id), **kw)
    unknown = client.request(method, path.format(id=unknown_id), **kw)
    assert (theirs.status_code, theirs.headers["content-type"]) == (
        unknown.status_code,
        unknown.headers["content-type"],
    )
    assert theirs.text.replace(real_id, unknown_id) == unknown.text


def client_of(service: Service, name: str) -> httpx.Client:
    return httpx.Client(base_url=service.url, timeout=60, headers={"Authorization": f"Bearer {TOKENS[name]}"})


def test_approved_calls_reach_the_tool_denied_and_undecided_ones_never_do(
    approvals: Service, tool_server: ToolServer
) -> None:
    marker = secrets.token_hex(8)  # the session's tool server is shared: count only this test's requests
    write = {
        "name": "files.write",
        "parameters": {
            "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
            "required": ["path", "text"],
        },
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        "approval": {"when": {"properties": {"path": {"pattern": "^/etc/"}}}},
    }
    publish = {
        "name": "publish",
        "parameters": {"properties": {"text": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        "approval": "always",
        "approval_timeout_s": 1,
    }
    script = (
        "import tools\n"
        "def attempt(tool, **args):\n"
        "    try:\n"
        "        print('ok', tool(**args)['args']['path'], flush=True)\n"
        "    except tools.ToolError as e:\n"
        "        print(e.type, '|', e.message, flush=True)\n"
        f"attempt(tools.files.write, path='/etc/hosts', text='{marker}')\n"
        f"attempt(tools.files.write, path='/tmp/notes', text='{marker}')\n"
        f"attempt(tools.files.write, path='/etc/passwd', text='{marker}')\n"
        f"attempt(tools.files.write, path=3, text='{marker}')\n"
        f"attempt(tools.publish, text='{marker}')\n"
        "print('done')\n"
    )
    with client_of(approvals, "alice") as alice, client_of(approvals, "bob") as bob:
        answer = alice.post("/execute", json={"script": script, "tools": [write, publish], "wait_s": 30})
        assert answer.status_code == 202, answer.text  # it answers once the job waits for a decision
        job_id = answer.json()["job_id"]

        def awaiting(path: str) -> dict[str, Any] | None:
            view = alice.get(f"/jobs/{job_id}").json()
            calls = [c for c in view["pending_calls"] if c["args"].get("path") == path]
            return {**calls[0], "status": view["status"]} if calls else None

        wait_until(lambda: awaiting("/etc/hosts"), 60)
        first = awaiting("/etc/hosts")
        assert first is not None and first["status"] == "waiting" and first["awaiting"] == "approval"
        assert first["args"] == {"path": "/etc/hosts", "text": marker}
        for decision in ("approve", "deny"):  # bob's answer: the job does not exist for him
            path = f"/jobs/{{id}}/calls/{first['call_id']}/{decision}"
            like_unknown(bob, "POST", path, job_id, "job_" + "0" * 24, json={"reason": "bob says so"})
            assert bob.post(path.format(id=job_id)).status_code == 404
        assert not [a for _, a in tool_server.requests if isinstance(a, dict) and a.get("text") == marker]
        assert alice.post(f"/jobs/{job_id}/calls/{first['call_id']}/approve").status_code == 200

        wait_until(lambda: awaiting("/etc/passwd"), 60)  # /tmp/notes needs no approval: it went straight out
        second = awaiting("/etc/passwd")
        assert second is not None
        denied = alice.post(f"/jobs/{job_id}/calls/{second['call_id']}/deny", json={"reason": "not the passwd file"})
        assert denied.status_code == 200, denied.text
        again = alice.post(f"/jobs/{job_id}/calls/{second['call_id']}/approve")
        assert again.status_code == 409 and again.headers["content-type"] == "application/problem+json"

        wait_until(lambda: alice.get(f"/jobs/{job_id}").json()["status"] == "succeeded", 60)  # publish times out
        final = alice.get(f"/jobs/{job_id}").json()

    lines = final["stdout"].splitlines()
    assert lines[3].startswith("invalid_arguments | files.write: argument 'path': 3 is not of type 'string'")
    assert lines[:3] + lines[4:] == [
        "ok /etc/hosts",
        "ok /tmp/notes",
        "denied | files.write: denied: not the passwd file",
        "approval_timeout | publish: no approval came within 1 s; the call was not made",
        "done",
    ]
    seen = [a["path"] for _, a in tool_server.requests if isinstance(a, dict) and a.get("text") == marker]
    assert seen == ["/etc/hosts", "/tmp/notes"]  # the denied, invalid and timed-out calls never reached the server
    calls = final["calls"]
    assert [(c["status"], (c["approval"] or {}).get("decision")) for c in calls] == [
        ("ok", "approved"),
        ("ok", None),
        ("error", "denied"),
        ("rejected", None),
        ("timeout", "timed_out"),
    ]
    assert calls[0]["approval"]["by"] == "alice" and calls[2]["approval"]["by"] == "alice"
    assert calls[2]["approval"]["reason"] == "not the passwd file"
    assert final["pending_calls"] == []
