"""The jobs router (service/api/routers/jobs.py), for what it answers before it asks the job service."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from service.api.deps import job_service
from service.api.problems import LIMIT_EXCEEDED
from service.tenancy import Caller
from service.views.render import FULL, Selection


@pytest.mark.parametrize(
    ("name", "value"),
    [("created_after", "9999-12-31T23:59:59-05:00"), ("created_before", "0001-01-01T00:00:00+05:00")],
)
async def test_a_date_outside_utc_names_its_own_parameter(client: httpx.AsyncClient, name: str, value: str) -> None:
    response = await client.get("/jobs", params={name: value})
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["detail"].startswith(f"query.{name}: ") and "outside the range of UTC datetimes" in problem["detail"]
    assert problem["errors"] == [{"loc": ["query", name], "msg": problem["errors"][0]["msg"], "type": "invalid"}]


class FakeJobs:
    """Stands for the job service (``deps.job_service``) and its reading part (``views``): records what the routes
    ask."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, ...]] = []
        self.selections: list[Selection] = []
        self.views = self

    async def view(
        self, job_id: str, caller: Caller, offsets: dict[str, int | None], selection: Selection = FULL
    ) -> bytes:
        self.asked.append(("view", job_id, caller.owner, offsets))
        self.selections.append(selection)
        return b'{"job_id": "job_1"}'

    async def wait(self, job_id: str, caller: Caller, timeout_s: float, selection: Selection = FULL) -> bytes:
        self.asked.append(("wait", job_id, timeout_s))
        return b'{"job_id": "job_1"}'

    async def answer_call(
        self, job_id: str, caller: Caller, call_id: str, ok: bool, value: Any, selection: Selection = FULL
    ) -> bytes:
        self.asked.append(("answer_call", job_id, call_id, ok, value))
        return b'{"job_id": "job_1"}'


@pytest.fixture
def jobs(app: FastAPI) -> FakeJobs:
    fake = FakeJobs()
    app.dependency_overrides[job_service] = lambda: fake
    return fake


async def test_a_view_passes_the_offsets_and_the_caller(client: httpx.AsyncClient, jobs: FakeJobs) -> None:
    response = await client.get("/jobs/job_1", params={"stdout_offset": 5})
    assert (response.status_code, response.content) == (200, b'{"job_id": "job_1"}')
    assert response.headers["content-length"] == str(len(response.content))
    assert jobs.asked == [("view", "job_1", "unit", {"stdout": 5, "stderr": None})]
    assert jobs.selections == [FULL]


async def test_a_view_passes_the_selection(client: httpx.AsyncClient, jobs: FakeJobs) -> None:
    response = await client.get("/jobs/job_1", params={"calls": "summary", "fields": "stdout, exit_code,,"})
    assert response.status_code == 200
    assert jobs.selections == [Selection("summary", frozenset({"job_id", "status", "stdout", "exit_code"}))]


async def test_wait_defaults_to_the_setting_and_refuses_past_the_maximum(
    client: httpx.AsyncClient, jobs: FakeJobs
) -> None:
    assert (await client.post("/jobs/job_1/wait")).status_code == 200
    refused = await client.post("/jobs/job_1/wait", params={"timeout_s": 301})
    assert refused.status_code == 422 and refused.json()["type"] == LIMIT_EXCEEDED.uri
    assert refused.json()["detail"] == "query.timeout_s: 301.0 exceeds the server maximum of 300.0"
    assert jobs.asked == [("wait", "job_1", 30.0)]


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        ({"result": None}, [("answer_call", "job_1", "c1", True, None)]),
        (
            {"error": {"type": "t", "message": "m"}},
            [("answer_call", "job_1", "c1", False, {"type": "t", "message": "m"})],
        ),
        ({}, []),
        ({"result": 1, "error": {"type": "t", "message": "m"}}, []),
    ],
)
async def test_a_client_answer_is_a_result_or_an_error(
    client: httpx.AsyncClient, jobs: FakeJobs, body: dict[str, Any], asked: list[Any]
) -> None:
    response = await client.post("/jobs/job_1/calls/c1", json=body)
    assert response.status_code == (200 if asked else 422), response.text
    assert jobs.asked == asked


@pytest.mark.parametrize(
    "raw",
    [
        b'{"error": {"type": "t", "message": "\\ud800"}}',
        b'{"error": {"type": "\\udfff", "message": "m"}}',
    ],
)
async def test_a_client_error_answer_that_is_not_unicode_text_is_refused(
    client: httpx.AsyncClient, jobs: FakeJobs, raw: bytes
) -> None:
    """An error answer's type and message reach the script and a durable job's call log (UTF-8): a lone surrogate is
    a 422 naming the field (before the fix, a parked job's answer was a 500, a live durable one's a store failure)."""
    response = await client.post("/jobs/job_1/calls/c1", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "lone surrogate" in response.text and jobs.asked == []
