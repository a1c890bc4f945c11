"""The app factory (service/api/app.py): routers per resource, one error handler, services from the lifespan."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Scope

from service.api import problems
from service.api.app import RESOURCES
from service.api.bodies import ParsedOffLoop
from service.api.deps import NOT_STARTED
from service.api.routers.docs import ASSETS
from service.errors import PtcError
from tests.unit.api.conftest import TOKEN
from tests.unit.test_docs_links import ROOT, anchors

ROUTES = {
    "jobs": {
        ("POST", "/execute"),
        ("GET", "/jobs"),
        ("GET", "/jobs/{job_id}"),
        ("GET", "/jobs/{job_id}/output/{stream}"),
        ("GET", "/jobs/{job_id}/files/{path:path}"),
        ("POST", "/jobs/{job_id}/wait"),
        ("POST", "/jobs/{job_id}/calls/{call_id}"),
        ("POST", "/jobs/{job_id}/calls/{call_id}/approve"),
        ("POST", "/jobs/{job_id}/calls/{call_id}/deny"),
        ("POST", "/jobs/{job_id}/stop"),
        ("GET", "/jobs/{job_id}/events"),
    },
    "sessions": {
        ("POST", "/sessions"),
        ("GET", "/sessions"),
        ("GET", "/sessions/{session_id}"),
        ("DELETE", "/sessions/{session_id}"),
        ("PUT", "/sessions/{session_id}/files/{path:path}"),
        ("GET", "/sessions/{session_id}/files/{path:path}"),
        ("GET", "/sessions/{session_id}/files"),
    },
    "tools": {("POST", "/stubs"), ("POST", "/toolsets")},
    "health": {("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/readyz")},
    "docs": {("GET", "/docs"), ("GET", "/redoc"), *(("GET", f"/docs/assets/{name}") for name in ASSETS)},
}
UNDOCUMENTED = {"docs"}  # the API documents' own routes are not in /openapi.json


def test_each_route_lives_in_the_router_of_its_resource(app: FastAPI) -> None:
    found: dict[str, set[tuple[str, str]]] = {}
    for resource in RESOURCES:
        name = resource.__name__.removeprefix("service.api.routers.")
        for route in resource.router.routes:
            assert isinstance(route, ParsedOffLoop), route
            assert route.endpoint.__module__ == resource.__name__
            found.setdefault(name, set()).update((method, route.path) for method in route.methods or ())
    assert found == ROUTES
    served = {(method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item}
    documented = set().union(*(routes for name, routes in ROUTES.items() if name not in UNDOCUMENTED))
    assert served == {(method, path.replace(":path}", "}")) for method, path in documented}  # OpenAPI: {path}


def test_one_handler_answers_every_error(app: FastAPI) -> None:
    for cls in (PtcError, RequestValidationError, StarletteHTTPException, Exception):
        assert app.exception_handlers[cls] is problems.handle


def test_services_are_placeholders_until_the_lifespan_starts_them(app: FastAPI) -> None:
    assert app.state.jobs is NOT_STARTED and app.state.sessions is NOT_STARTED
    with pytest.raises(RuntimeError, match="not started"):
        app.state.jobs.submit  # noqa: B018


async def test_checks_that_need_no_service_answer_before_the_lifespan(client: httpx.AsyncClient) -> None:
    response = await client.post("/execute", json={"script": "x" * (2 * 1024 * 1024)})
    assert response.status_code == 413 and response.json()["type"] == problems.PAYLOAD_TOO_LARGE.uri
    assert (await client.get("/healthz")).json() == {"status": "ok"}


async def test_requests_the_router_never_saw_are_counted_under_their_route(client: httpx.AsyncClient) -> None:
    """A body refused by the size limit, or a request refused for its key, still names its route's template."""
    too_large = await client.post("/execute", content=b"x" * (9 * 1024 * 1024), headers={"content-type": "text/plain"})
    no_key = await client.get("/jobs/abc", headers={"Authorization": ""})
    no_key_list = await client.get("/sessions", headers={"Authorization": ""})
    nowhere = await client.get("/nowhere")
    assert (too_large.status_code, no_key.status_code, no_key_list.status_code) == (413, 401, 401)
    assert nowhere.status_code == 404
    metrics = client._transport.app.state.metrics  # type: ignore[attr-defined]
    exposition = metrics.exposition().decode()
    for method, route, status in [
        ("POST", "/execute", 413),
        ("GET", "/jobs/{job_id}", 401),
        ("GET", "/sessions", 401),
        ("GET", "unmatched", 404),
    ]:
        assert f'ptc_http_requests_total{{method="{method}",route="{route}",status="{status}"}} 1.0' in exposition


async def test_an_unknown_route_or_method_answers_a_documented_problem_type(client: httpx.AsyncClient) -> None:
    """The service as built (authentication on): before, both were ``about:blank``."""
    page = ROOT / "docs" / "problems.md"
    nowhere, wrong_method = await client.get("/jobs/"), await client.put("/execute")
    assert nowhere.status_code == 404 and nowhere.json()["type"] == problems.ROUTE_NOT_FOUND.uri
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["type"] == problems.METHOD_NOT_ALLOWED.uri
    no_key = await client.get("/nowhere", headers={"Authorization": ""})
    assert no_key.status_code == 401 and no_key.json()["type"] == problems.UNAUTHORIZED.uri
    for response in (nowhere, wrong_method, no_key):
        assert response.headers["content-type"] == "application/problem+json"
        name = response.json()["type"].removeprefix(problems.TYPE_PREFIX)
        assert name in anchors(page), name


async def test_a_client_that_leaves_mid_body_is_a_400_not_an_error(
    app: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    # ParsedOffLoop reads the body before FastAPI does: Starlette's ClientDisconnect went up as an unhandled
    # error (a 500 and two tracebacks in the log per request, at any client's will)
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"scr', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/execute",
        "raw_path": b"/execute",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"test"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"100"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    with caplog.at_level(logging.WARNING):
        await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400, sent
    assert b"bad-request" in b"".join(m.get("body", b"") for m in sent)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
