"""Errors to problem+json (service/api/problems.py): one table, one handler, every error class decided."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import errors
from service.api import problems
from service.api.openapi import Problem
from service.api.problems import RULES, TYPES, ProblemType, rule_for
from service.egress import EgressDenied
from service.errors import PtcError
from service.observability.metrics import Metrics
from service.settings import Settings
from tests.unit.test_docs_links import anchors

ROOT = Path(__file__).resolve().parents[3]

# Errors that never reach a route: start-up refusals, and failures that become a tool's error inside the script.
NEVER_HTTP = {
    errors.WorkDirBusy,
    errors.InsecureConfig,
    errors.CheckTooCostly,
    EgressDenied,
    errors.InstanceIdInUse,
    errors.LeaseLost,
}


def subclasses(cls: type[Exception]) -> set[type[Exception]]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= subclasses(sub)
    return found


def test_every_error_class_is_mapped_or_declared_never_http() -> None:
    for module in ("service.jobs", "service.sessions.manager", "service.broker", "service.quotas", "service.store"):
        __import__(module)  # every module that defines or raises service errors, so that all are subclassed
    for cls in subclasses(PtcError):
        if cls.__module__.startswith("service."):
            assert (rule_for(cls) is not None) != (cls in NEVER_HTTP), cls
    for cls in NEVER_HTTP:
        assert rule_for(cls) is None, cls


def test_problem_types_are_distinct_stable_tag_uris() -> None:
    names = [t.name for t in TYPES]
    assert len(set(names)) == len(names)
    for problem_type in TYPES:
        assert re.fullmatch(r"tag:ptc-sandbox\.dev,2026:problems/[a-z]+(-[a-z]+)*", problem_type.uri)
    assert {rule.type for rule in RULES.values()} <= set(TYPES)
    assert problems.INTERNAL_ERROR.uri == "tag:ptc-sandbox.dev,2026:problems/internal-error"


def raising(exc: Exception) -> FastAPI:
    app = FastAPI()
    app.state.metrics = Metrics(Settings(auth="disabled"))
    problems.install(app)

    @app.get("/boom")
    async def boom() -> None:
        raise exc

    return app


async def answer(exc: Exception) -> httpx.Response:
    transport = httpx.ASGITransport(app=raising(exc), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get("/boom")


CASES: list[tuple[Exception, int, str, str, dict[str, Any]]] = [
    (errors.JobNotFound("job_1"), 404, "job-not-found", "Job not found", {"detail": "no job with id job_1"}),
    (errors.SessionNotFound("s"), 404, "session-not-found", "Session not found", {}),
    (
        errors.SessionClosed("s", "expired", "idle"),
        409,
        "session-ended",
        "Session ended",
        {"session_id": "s", "session_status": "expired"},
    ),
    (errors.CallNotPending("c"), 409, "call-not-pending", "Call not waiting", {}),
    (
        errors.RequestLimitError("too long", ("body", "timeout_s")),
        422,
        "limit-exceeded",
        "Limit exceeds the server maximum",
        {
            "detail": "timeout_s: too long",
            "errors": [{"loc": ["body", "timeout_s"], "msg": "too long", "type": "limit"}],
        },
    ),
    (errors.InvalidField("bad", ()), 422, "invalid-request", "Invalid request", {"detail": "request: bad"}),
    (
        errors.ManifestError("no", ("body", "tools", 0)),
        422,
        "invalid-manifest",
        "Invalid tool manifest",
        {"detail": "tools.0: no"},
    ),
    (errors.PayloadTooLarge("big", ("body", "script"), 9), 413, "payload-too-large", "Request body too large", {}),
    (errors.QueueFull(3), 429, "queue-full", "Too many jobs", {"reason": "queue_full"}),
    (errors.TooManySessions(2), 429, "too-many-sessions", "Too many sessions", {"reason": "max_sessions"}),
    (errors.QuotaExceeded("q", "sessions", 2, 5), 429, "quota-exceeded", "Quota exceeded", {"limit": 2}),
    (
        errors.HostCapacityExceeded("h", "host_cpus", 4.0, 5),
        429,
        "host-capacity-exceeded",
        "Host capacity exceeded",
        {"reason": "host_cpus", "limit": 4.0},
    ),
    (errors.EngineUnavailable("down"), 503, "engine-unavailable", "Container engine unavailable", {"detail": "down"}),
    (errors.SandboxError("broke"), 503, "sandbox-failure", "Sandbox failure", {"detail": "broke"}),
    (
        errors.StoreUnavailable("get"),
        503,
        "store-unavailable",
        "Job store unavailable",
        {"detail": "the job store did not answer (get); retry later"},
    ),
]


@pytest.mark.parametrize(("exc", "status", "name", "title", "members"), CASES, ids=lambda v: type(v).__name__)
async def test_each_error_answers_its_problem(
    exc: Exception, status: int, name: str, title: str, members: dict[str, Any]
) -> None:
    response = await answer(exc)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert list(body)[:4] == ["type", "title", "status", "detail"]
    assert (body["type"], body["title"], body["status"]) == (f"{problems.TYPE_PREFIX}{name}", title, status)
    assert body.items() >= members.items()


@pytest.mark.parametrize(
    ("exc", "retry_after"),
    [(errors.QueueFull(3), "3"), (errors.TooManySessions(2), "30"), (errors.QuotaExceeded("q", "sessions", 2, 7), "7")],
)
async def test_a_429_says_when_to_retry_and_is_counted(exc: Exception, retry_after: str) -> None:
    app = raising(exc)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/boom")
    assert response.status_code == 429 and response.headers["retry-after"] == retry_after
    exposition = app.state.metrics.exposition().decode()
    assert f'ptc_rejections_total{{reason="{response.json()["reason"]}"}} 1.0' in exposition


@pytest.mark.parametrize("exc", [RuntimeError("secret text"), EgressDenied("secret text"), errors.WorkDirBusy("/x")])
async def test_an_unmapped_error_is_logged_and_answered_500_without_its_text(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="service.api.problems"):
        response = await answer(exc)
    assert response.status_code == 500
    assert response.json() == {
        "type": "tag:ptc-sandbox.dev,2026:problems/internal-error",
        "title": "Internal error",
        "status": 500,
        "detail": "the service failed; the error is in its log",
    }
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [exc]


async def test_the_http_layers_own_errors_have_documented_types() -> None:
    """An unknown path, a wrong method, an unreadable body and any other status of Starlette's (before: all
    ``about:blank``, which docs/problems.md cannot document)."""
    app = raising(RuntimeError())

    @app.get("/teapot")
    async def teapot() -> None:
        raise StarletteHTTPException(418)

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        missing, wrong_method = await client.get("/nowhere"), await client.delete("/boom")
        other = await client.get("/teapot")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["type"] == problems.ROUTE_NOT_FOUND.uri and missing.json()["title"] == "Route not found"
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET"
    assert wrong_method.json()["type"] == problems.METHOD_NOT_ALLOWED.uri
    assert other.json() == {
        "type": problems.HTTP_ERROR.uri,
        "title": "I'm a Teapot",
        "status": 418,
        "detail": "I'm a Teapot",
    }
    for response in (missing, wrong_method, other):
        assert documented(response.json()["type"]), response.json()


async def test_fastapis_unreadable_body_is_bad_request() -> None:
    app = raising(RuntimeError())

    @app.post("/body")
    async def body(value: dict[str, int]) -> None:
        raise AssertionError("not reached")

    async def broken() -> AsyncIterator[bytes]:
        yield b'{"a":'
        raise OSError("the client went away")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/body", content=broken(), headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == problems.BAD_REQUEST.uri


def documented(type_uri: str) -> bool:
    """Whether ``type_uri`` is a service problem type with its section in docs/problems.md."""
    name = type_uri.removeprefix(problems.TYPE_PREFIX)
    return type_uri.startswith(problems.TYPE_PREFIX) and name in anchors(ROOT / "docs" / "problems.md")


def every_problem_type() -> set[ProblemType]:
    """Every ``ProblemType`` the service can answer with: those defined in service.api.problems (``TYPES``,
    ``RULES``, ``HTTP_LAYER``) and any made elsewhere in ``service/`` (found by name in the source)."""
    found = {value for value in vars(problems).values() if isinstance(value, ProblemType)}
    found |= {rule.type for rule in RULES.values()} | set(problems.HTTP_LAYER.values())
    return found


def test_every_problem_type_has_its_section_in_docs_problems_md() -> None:
    page = ROOT / "docs" / "problems.md"
    sections = page.read_text().split("\n## ")[1:]
    by_name = {section.split("\n", 1)[0].strip(): section for section in sections}
    types = every_problem_type()
    assert types == set(TYPES), "every ProblemType is listed in TYPES"
    for problem_type in types:
        assert problem_type.name in anchors(page), problem_type.name
        section = by_name[problem_type.name]
        status = (
            "the HTTP layer's own (4xx or 5xx)" if problem_type is problems.HTTP_ERROR else str(problem_type.status)
        )
        assert f"**Status** {status} · **Title** {problem_type.title}\n" in section, problem_type.name
        assert "**Client:**" in section, problem_type.name
    assert set(by_name) == {t.name for t in types}, "a section for a type that does not exist"


def test_no_answer_is_about_blank() -> None:
    """No code in service/ makes an ``about:blank`` problem (``problem()`` has no default type any more), and
    ``ProblemType`` is made only in service/api/problems.py (so ``every_problem_type`` sees them all)."""
    for path in sorted((ROOT / "service").rglob("*.py")):
        text = path.read_text()
        if path != ROOT / "service" / "api" / "problems.py":
            assert "ProblemType(" not in text, path
            assert "about:blank" not in text, path
    assert "about:blank" not in json.dumps(Problem.model_json_schema())


async def test_fastapis_validation_errors_are_invalid_request() -> None:
    app = raising(RuntimeError())

    @app.get("/n")
    async def n(k: int) -> int:
        return k

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/n", params={"k": "x"})
    body = response.json()
    assert response.status_code == 422 and body["type"] == problems.INVALID_REQUEST.uri
    assert body["detail"].startswith("query.k: ") and body["errors"][0]["loc"] == ["query", "k"]
