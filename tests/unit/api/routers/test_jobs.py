"""The jobs router (service/api/routers/jobs.py), for what it answers before it asks the job service."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize(
    ("name", "value"),
    [("created_after", "9999-12-31T23:59:59-05:00"), ("created_before", "0001-01-01T00:00:00+05:00")],
)
async def test_a_date_outside_utc_names_its_own_parameter(client: httpx.AsyncClient, name: str, value: str) -> None:
    response = await client.get("/jobs", params={name: value})
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["detail"].startswith(f"{name}: ") and "outside the range of UTC datetimes" in problem["detail"]
    assert problem["errors"] == [{"loc": ["query", name], "msg": problem["errors"][0]["msg"], "type": "invalid"}]
