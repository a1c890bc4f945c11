"""The served OpenAPI document: FastAPI's, completed with the service's errors and its authentication.

FastAPI documents routes, parameters and bodies from the code; what it cannot
see is added here, for every operation (so new routes are covered too):

- every 4xx/5xx answer is ``application/problem+json`` with the ``Problem``
  schema (RFC 9457), including FastAPI's own 422 (which this service answers
  as problem+json, not as FastAPI's ``HTTPValidationError``);
- ``401`` on every operation that needs an API key, with its
  ``WWW-Authenticate`` header; the ``bearerAuth`` security scheme, required
  everywhere but on the open paths (``security: []`` there);
- ``400`` (an unreadable body) and ``413`` on operations with a body, ``422`` on operations with parameters or a
  body, and ``500`` on all.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

PROBLEM = "application/problem+json"
_PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}


class ProblemField(BaseModel):
    """One wrong field of a request."""

    loc: list[str | int] = Field(description="Path to the field, e.g. [body, limits, memory_mb].")
    msg: str
    type: str


class Problem(BaseModel):
    """An RFC 9457 problem detail; every error of the service has this shape."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(
        description="A URI naming the kind of problem, to compare as a string (never fetched): "
        "tag:ptc-sandbox.dev,2026:problems/<name>, each name documented in docs/problems.md (its section's "
        "anchor is the name).",
        examples=["tag:ptc-sandbox.dev,2026:problems/job-not-found"],
    )
    title: str = Field(description="Short summary of the kind of problem.")
    status: int = Field(description="The HTTP status code.")
    detail: str = Field(description="What went wrong with this request; a 422's starts with the field at fault.")
    errors: list[ProblemField] | None = Field(None, description="422: every wrong field.")
    job_id: str | None = Field(None, description="The job concerned, when there is one.")


def _describe(code: str) -> str:
    try:
        return HTTPStatus(int(code)).phrase
    except ValueError:
        return "Error"


_EXTRA_DESCRIPTIONS = {
    "400": "The body cannot be read as JSON text (e.g. not UTF-8).",
    "401": "No API key, or not a valid one (WWW-Authenticate: Bearer).",
    "413": "The body, its script or its manifest is larger than the server allows.",
    "422": "The request is not valid: detail starts with the field at fault.",
    "500": "The service failed; the error is in its log.",
}


def document(app: FastAPI, open_paths: frozenset[str], authenticated: bool = True) -> None:
    """Replace ``app.openapi`` with one that completes FastAPI's document as the module docstring says.

    ``authenticated=False`` (``PTC_AUTH=disabled``) leaves out the security scheme and the 401s.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(problem.pop("$defs", {}))
        schemas["Problem"] = problem
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        if authenticated:
            components["securitySchemes"] = {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key (PTC_API_KEYS holds its SHA-256; docs/operations.md).",
                }
            }
            schema["security"] = [{"bearerAuth": []}]
        for path, item in schema.get("paths", {}).items():
            for operation in item.values():
                _complete(operation, open_path=not authenticated or path in open_paths, authenticated=authenticated)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _complete(operation: dict[str, Any], open_path: bool, authenticated: bool) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    if open_path:
        if authenticated:
            operation["security"] = []
    else:
        responses["401"] = {
            "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
        }
    if "requestBody" in operation:
        responses.setdefault("400", {})
        responses.setdefault("413", {})
    if operation.get("parameters") or "requestBody" in operation:
        responses["422"] = {}
    responses.setdefault("500", {})
    for code, response in responses.items():
        if code[:1] in ("4", "5"):
            description = response.get("description")
            if not description or description in ("Additional Response", "Validation Error"):
                response["description"] = _EXTRA_DESCRIPTIONS.get(code, _describe(code))
            response["content"] = {PROBLEM: {"schema": _PROBLEM_REF}}
