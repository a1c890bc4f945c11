"""Request limits (service/limits.py): body, script and manifest sizes, tools per manifest, per-key maxima."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import create_app
from service.errors import RequestLimitError
from service.limits import check_execute, check_session
from service.schemas.common import Limits
from service.schemas.job_models import ExecuteRequest
from service.schemas.session_models import SessionRequest
from service.settings import KeyLimits, Settings
from service.tenancy import hash_token

TOKEN = "limits-test-token-0123456789"


SMALL = "limits-small-token-0123456789"


MIB = 1024 * 1024


def settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "work_dir": tmp_path,
        "api_keys": f"big:{hash_token(TOKEN)},small:{hash_token(SMALL)}",
        "key_limits": {"small": KeyLimits(timeout_s=1, memory_mb=64, tools=1)},
        **overrides,
    }
    return Settings(**values)


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process, without its lifespan: the limits answer before a route needs the job manager."""
    app = create_app(settings(tmp_path, max_tools=3))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=bearer(TOKEN)) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def echo_tools(n: int, description: str = "") -> list[dict[str, Any]]:
    return [{"name": f"t{i}", "description": description, "endpoint": {"kind": "echo"}} for i in range(n)]


def assert_problem(response: httpx.Response, status: int, field: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status
    assert problem["detail"].startswith(field), problem
    return problem


async def test_script_over_1_mib_is_413(client: httpx.AsyncClient) -> None:
    problem = assert_problem(await client.post("/execute", json={"script": "#" * (MIB + 1)}), 413, "script")
    assert str(MIB) in problem["detail"]


async def test_script_size_counts_utf8_bytes_not_characters(client: httpx.AsyncClient) -> None:
    script = "# " + "é" * (MIB // 2 + 10)  # fewer than 1 Mi characters, more than 1 MiB of UTF-8
    assert len(script) < MIB
    assert_problem(await client.post("/execute", json={"script": script}), 413, "script")


@pytest.mark.parametrize("route", ["/execute", "/stubs", "/toolsets"])
async def test_manifest_over_4_mib_is_413(client: httpx.AsyncClient, route: str) -> None:
    body: dict[str, Any] = {"tools": echo_tools(2, "d" * (2 * MIB + 100))}
    if route == "/execute":
        body["script"] = "pass"
    assert_problem(await client.post(route, json=body), 413, "tools")


async def test_body_limit_is_a_setting(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path, max_body_bytes=4096))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        response = await c.post("/execute", json={"script": "#" * 5000}, headers=bearer(TOKEN))
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize("route", ["/execute", "/stubs", "/toolsets"])
async def test_more_tools_than_the_server_allows_is_422(client: httpx.AsyncClient, route: str) -> None:
    body: dict[str, Any] = {"tools": echo_tools(4), **({"script": ""} if route == "/execute" else {})}
    problem = assert_problem(await client.post(route, json=body), 422, "tools")
    assert "server maximum of 3" in problem["detail"]


async def test_a_key_cannot_ask_past_its_own_maxima(client: httpx.AsyncClient) -> None:
    small = bearer(SMALL)
    response = await client.post("/execute", json={"script": "", "timeout_s": 2}, headers=small)
    assert "key 'small'" in assert_problem(response, 422, "timeout_s")["detail"]
    response = await client.post("/execute", json={"script": "", "limits": {"memory_mb": 128}}, headers=small)
    assert_problem(response, 422, "limits.memory_mb")
    response = await client.post("/execute", json={"script": "", "tools": echo_tools(2)}, headers=small)
    assert "key 'small'" in assert_problem(response, 422, "tools")["detail"]
    response = await client.post("/stubs", json={"tools": echo_tools(2)}, headers=small)
    assert_problem(response, 422, "tools")


def test_unset_limits_get_the_server_default_lowered_to_the_key_maximum(tmp_path: Path) -> None:
    config = settings(tmp_path)
    body = ExecuteRequest(script="")
    check_execute(body, config, "small")
    assert body.timeout_s == 1 and body.limits.memory_mb == 64
    assert body.limits.cpus is None and body.limits.pids is None  # no key maximum: the server's default stays
    body = ExecuteRequest(script="", timeout_s=0.5)
    check_execute(body, config, "small")
    assert body.timeout_s == 0.5
    body = ExecuteRequest(script="")
    check_execute(body, config, "big")
    assert body.timeout_s is None and body.limits.memory_mb is None
    with pytest.raises(RequestLimitError):
        check_execute(ExecuteRequest(script="", limits=Limits(memory_mb=65)), config, "small")


async def test_a_key_cannot_open_a_session_past_its_maxima(client: httpx.AsyncClient, tmp_path: Path) -> None:
    small = bearer(SMALL)
    response = await client.post("/sessions", json={"limits": {"memory_mb": 128}}, headers=small)
    assert "key 'small'" in assert_problem(response, 422, "limits.memory_mb")["detail"]
    response = await client.post("/sessions", json={"tools": echo_tools(2)}, headers=small)
    assert "key 'small'" in assert_problem(response, 422, "tools")["detail"]
    body = SessionRequest()
    check_session(body, settings(tmp_path), "small")
    assert body.limits.memory_mb == 64  # lowered to the key's maximum, as its scripts' will be
