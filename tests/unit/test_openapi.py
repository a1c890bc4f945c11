"""The served OpenAPI document (service/api/openapi.py), and schemathesis against the running service.

The schemathesis run is bounded: a few examples per operation (``-n``), one
worker, a request timeout above the service's longest wait, and a hard limit on
the whole run. It runs against ``restricted_service``, whose timeouts and waits
are at most 10 s (so no generated job runs long) and whose egress rules let no
generated manifest reach anything but the test tool server.

Checks: every built-in response check (no 5xx, status codes, content types,
headers and bodies as documented, invalid requests refused, missing auth
refused, undeclared methods answered 405 with ``Allow``) except
``positive_data_acceptance``: the service refuses, by design, schema-valid
values past its configured maxima (``timeout_s`` over ``PTC_MAX_TIMEOUT_S``,
a manifest entry without a usable ``name``), which that check counts as failures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from service.api import create_app
from service.api.openapi import PROBLEM
from service.settings import Settings
from service.tenancy import hash_token


def operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = Settings(work_dir=tmp_path_factory.mktemp("spec"), api_keys=f"a:{hash_token('t')}")
    return create_app(settings).openapi()


def test_every_error_is_documented_as_problem_json(spec: dict[str, Any]) -> None:
    assert spec["components"]["schemas"]["Problem"]["required"] == ["type", "title", "status", "detail"]
    for path, method, operation in operations(spec):
        responses = operation["responses"]
        assert "500" in responses, (method, path)
        if "requestBody" in operation:
            assert {"400", "413", "422"} <= responses.keys(), (method, path)
        for code, response in responses.items():
            if code[0] in "45":
                assert response["content"] == {PROBLEM: {"schema": {"$ref": "#/components/schemas/Problem"}}}
                assert response["description"] not in ("", "Additional Response"), (method, path, code)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_authentication_is_documented(spec: dict[str, Any]) -> None:
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    assert spec["security"] == [{"bearerAuth": []}]
    for path, method, operation in operations(spec):
        if path in ("/healthz", "/readyz"):
            assert operation["security"] == [] and "401" not in operation["responses"]
        else:
            assert "security" not in operation, (method, path)  # the document's default: a key
            assert "WWW-Authenticate" in operation["responses"]["401"]["headers"]


def test_every_route_is_documented(spec: dict[str, Any]) -> None:
    documented = {(method.upper(), path) for path, method, _ in operations(spec)}
    assert {
        ("POST", "/execute"),
        ("GET", "/jobs"),
        ("GET", "/jobs/{job_id}"),
        ("GET", "/jobs/{job_id}/output/{stream}"),
        ("POST", "/jobs/{job_id}/wait"),
        ("POST", "/jobs/{job_id}/calls/{call_id}"),
        ("POST", "/jobs/{job_id}/calls/{call_id}/approve"),
        ("POST", "/jobs/{job_id}/calls/{call_id}/deny"),
        ("POST", "/jobs/{job_id}/stop"),
        ("GET", "/jobs/{job_id}/events"),
        ("POST", "/stubs"),
        ("POST", "/toolsets"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("POST", "/sessions"),
        ("GET", "/sessions"),
        ("GET", "/sessions/{session_id}"),
        ("DELETE", "/sessions/{session_id}"),
    } <= documented
    for path, method, operation in operations(spec):
        assert operation.get("description") or operation.get("summary"), (method, path)
        assert any(code.startswith("2") for code in operation["responses"]), (method, path)


def test_view_selection_event_resumption_and_location_are_documented(spec: dict[str, Any]) -> None:
    paths = spec["paths"]
    for path, method in (
        ("/execute", "post"),
        ("/jobs/{job_id}", "get"),
        ("/jobs/{job_id}/wait", "post"),
        ("/jobs/{job_id}/events", "get"),
    ):
        parameters = {(p["name"], p["in"]): p for p in paths[path][method]["parameters"]}
        assert parameters[("calls", "query")]["schema"]["enum"] == ["full", "summary", "none"]
        assert ("fields", "query") in parameters
    events = {(p["name"], p["in"]) for p in paths["/jobs/{job_id}/events"]["get"]["parameters"]}
    assert {("Last-Event-ID", "header"), ("last_event_id", "query")} <= events
    assert "204" in paths["/jobs/{job_id}/events"]["get"]["responses"]
    assert "Location" in paths["/execute"]["post"]["responses"]["202"]["headers"]
    assert "Location" in paths["/sessions"]["post"]["responses"]["201"]["headers"]


def test_a_selected_view_is_documented_as_one_answer(spec: dict[str, Any]) -> None:
    """Under ``calls=summary|none`` or ``fields=`` a view lacks fields ``JobView`` requires: its answers are
    documented as ``JobView`` or ``JobViewSelection`` (before: schemathesis found views violating the schema)."""
    schemas = spec["components"]["schemas"]
    assert schemas["JobViewSelection"]["required"] == ["job_id", "status"]
    assert list(schemas["CallSummary"]["properties"]) == [
        "seq",
        "call_id",
        "tool",
        "status",
        "error",
        "duration_ms",
        "approval",
    ]
    for path, method in (("/execute", "post"), ("/jobs/{job_id}", "get"), ("/jobs/{job_id}/wait", "post")):
        for code in ("200", "202") if path == "/execute" else ("200",):
            schema = spec["paths"][path][method]["responses"][code]["content"]["application/json"]["schema"]
            assert schema["anyOf"] == [
                {"$ref": "#/components/schemas/JobView"},
                {"$ref": "#/components/schemas/JobViewSelection"},
            ]
