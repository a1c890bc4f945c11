"""Egress rules (service/egress.py): what the broker's endpoint clients and callbacks may contact.

Refusals are shown to happen before any connection: private and metadata
addresses are never contacted (the inner transport is replaced by one that
fails the test if reached), and destinations off the allowlist are real
listeners on this machine's loopback (127.0.0.2, other ports) that must see
no connection at all.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, execute, start_service, stop_clean
from tests.toolserver import ToolServer
from tests.unit.test_egress import Listener, off_list  # noqa: F401


def test_a_script_gets_egress_denied_at_the_first_call_and_nothing_is_sent(
    restricted_service: Service, tool_server: ToolServer, off_list: list[Listener]
) -> None:
    """The service allows only the tool server's port: metadata, a private address, 127.0.0.2 and another
    port of 127.0.0.1 are each refused at the first call with a ToolError; the listeners see nothing."""
    targets = {
        "metadata": "http://169.254.169.254/latest/meta-data/iam",
        "private": "http://10.0.0.1:8080/tool",
        "other_host": off_list[0].url,
        "other_port": off_list[1].url,
        "allowed": tool_server.url("triangle_area"),
    }
    tools = [
        {
            "name": name,
            "parameters": {"type": "object", "additionalProperties": True},
            "endpoint": {"kind": "http", "url": url},
        }
        for name, url in targets.items()
    ] + [{"name": "mcp_metadata", "endpoint": {"kind": "mcp", "url": "http://169.254.169.254/mcp"}}]
    script = (
        "import tools\n"
        "for name in ['metadata', 'private', 'other_host', 'other_port', 'mcp_metadata']:\n"
        "    try:\n"
        "        getattr(tools, name)()\n"
        "    except tools.ToolError as e:\n"
        "        print(name, e.type)\n"
        "print(tools.allowed(base=3, height=4))\n"
    )
    with restricted_service.client() as api:
        view = execute(api, script, tools)
        assert view["status"] == "succeeded", view
        assert view["stdout"].splitlines() == [
            "metadata egress_denied",
            "private egress_denied",
            "other_host egress_denied",
            "other_port egress_denied",
            "mcp_metadata egress_denied",
            "6.0",
        ]
        denied = [c for c in view["calls"] if c["status"] == "error"]
        assert [c["error"]["type"] for c in denied] == ["egress_denied"] * 5
        assert "169.254.169.254" in denied[0]["error"]["message"]
        assert all(c["duration_ms"] < 1000 for c in denied)
        callback = api.post("/execute", json={"script": "", "callback_url": off_list[0].url})
        assert callback.status_code == 422
        assert callback.json()["detail"].startswith("callback_url: ")
    time.sleep(0.3)
    assert [listener.accepted for listener in off_list] == [0, 0]


@pytest.fixture(scope="module")
def default_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service with the default egress rules (no ``PTC_EGRESS_ALLOW``) and no warm pool."""
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / "default-egress",
        PTC_EGRESS_ALLOW=None,
        PTC_WARM_POOL_SIZE="0",
        PTC_CALLBACK_SECRET=secrets.token_hex(16),
    )
    yield svc
    stop_clean(engine, svc)


def test_by_default_no_tool_or_callback_reaches_another_loopback_service(
    default_service: Service, tool_server: ToolServer
) -> None:
    """Another service on this host (the tests' tool server on 127.0.0.1, its http and MCP routes) is refused to
    tool calls and callbacks with a clear error until the operator names it (``restricted_service`` does:
    ``test_a_script_gets_egress_denied_at_the_first_call_and_nothing_is_sent`` reaches it)."""
    tools = [
        {"name": "area", "parameters": {"type": "object", "additionalProperties": True},
         "endpoint": {"kind": "http", "url": tool_server.url("triangle_area")}},
        {"name": "listed", "parameters": {"type": "object", "additionalProperties": True},
         "endpoint": {"kind": "mcp", "url": tool_server.url("mcp")}},
    ]  # fmt: skip
    script = (
        "import tools\n"
        "for name in ['area', 'listed']:\n"
        "    try:\n"
        "        print(getattr(tools, name)(base=3, height=4))\n"
        "    except tools.ToolError as e:\n"
        "        print(name, e.type, e.message)\n"
    )
    seen = len(tool_server.headers)
    with default_service.client() as api:
        view = execute(api, script, tools)
        assert view["status"] == "succeeded", view
        lines = view["stdout"].splitlines()
        assert [line.split()[:2] for line in lines] == [["area", "egress_denied"], ["listed", "egress_denied"]]
        for line in lines:
            assert "not on the egress allowlist (PTC_EGRESS_ALLOW)" in line, line
            assert "reached only when the operator names them, address and port" in line, line
        callback = api.post("/execute", json={"script": "", "callback_url": tool_server.url("callback")})
        assert callback.status_code == 422, callback.text
        assert callback.json()["detail"].startswith("callback_url: "), callback.text
        assert "egress allowlist" in callback.json()["detail"], callback.text
    assert len(tool_server.headers) == seen  # nothing was sent to it


def test_a_tool_call_cannot_reach_the_services_own_api(service: Service, api: httpx.Client) -> None:
    """The suite's rules (every loopback port: ``TEST_EGRESS_RULES``) and a tool whose endpoint is the service
    itself, with the tenant's own key: every spelling of the service's address is refused before anything is
    sent."""
    port = service.url.rsplit(":", 1)[1]
    spellings = {
        "v4": f"http://127.0.0.1:{port}/execute",
        "alias": f"http://127.0.0.2:{port}/execute",
        "name": f"http://localhost:{port}/execute",
        "v6": f"http://[::1]:{port}/execute",
        "mapped": f"http://[::ffff:127.0.0.1]:{port}/execute",
    }
    tools = [
        {
            "name": name,
            "parameters": {"type": "object", "additionalProperties": True},
            "endpoint": {"kind": "http", "url": url, "headers": service.headers},
        }
        for name, url in spellings.items()
    ]
    script = (
        "import tools\n"
        f"for name in {list(spellings)!r}:\n"
        "    try:\n"
        "        print(name, 'answered', getattr(tools, name)(script='print(1)'))\n"
        "    except tools.ToolError as e:\n"
        "        print(name, e.type)\n"
    )
    view = execute(api, script, tools)
    assert view["stdout"].splitlines() == [f"{name} egress_denied" for name in spellings], view["stdout"]
    assert all("own address" in c["error"]["message"] for c in view["calls"]), view["calls"]


TOOL_URL = "http://127.0.0.1:9/x"


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [
        ({"kind": "http", "url": "http://user:secret@127.0.0.1:9/x"}, "url"),
        ({"kind": "mcp", "url": "http://token@127.0.0.1:9/mcp"}, "url"),
        *(
            ({"kind": "http", "url": TOOL_URL, "headers": {name: "x"}}, name)
            for name in ("Host", "transfer-encoding", "Content-Length", "Connection", "Proxy-Authorization", "Upgrade")
        ),
    ],
)
def test_manifests_with_credentials_in_urls_or_framing_headers_are_refused(
    api: httpx.Client, endpoint: dict[str, Any], field: str
) -> None:
    tools = [{"name": "t", "endpoint": endpoint}]
    for path, body in (("/toolsets", {"tools": tools}), ("/execute", {"script": "", "tools": tools})):
        answer = api.post(path, json=body)
        assert answer.status_code == 422, answer.text
        loc = answer.json()["errors"][0]["loc"]
        assert loc[-1] == field, loc
        assert "secret" not in answer.text


def test_mcp_servers_and_callbacks_with_credentials_or_framing_headers_are_refused(
    restricted_service: Service, tool_server: ToolServer
) -> None:
    """Refused when registered, for what they carry (the destinations are on the allowlist)."""
    allowed = tool_server.url("").rstrip("/")
    with restricted_service.client() as api:
        for server, why in (
            ({"url": allowed.replace("http://", "http://user:secret@") + "/mcp"}, "credentials"),
            ({"url": f"{allowed}/mcp", "headers": {"Transfer-Encoding": "chunked"}}, "'Transfer-Encoding'"),
        ):
            answer = api.post("/toolsets", json={"mcp_servers": [server]})
            assert answer.status_code == 422, answer.text
            error = answer.json()["errors"][0]
            assert error["loc"][:3] == ["body", "mcp_servers", 0] and why in error["msg"], error
        callback = allowed.replace("http://", "http://user:secret@") + "/callback"
        answer = api.post("/execute", json={"script": "", "callback_url": callback})
        assert answer.status_code == 422, answer.text
        error = answer.json()["errors"][0]
        assert error["loc"] == ["body", "callback_url"] and "credentials" in error["msg"], error
