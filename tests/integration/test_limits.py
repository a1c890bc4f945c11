"""Request limits (service/limits.py): body, script and manifest sizes, tools per manifest, per-key maxima."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx

from tests.conftest import SMALL_TOKEN, Service, execute
from tests.unit.test_limits import MIB, assert_problem, bearer, echo_tools


def test_the_small_key_times_out_at_its_own_maximum(restricted_service: Service) -> None:
    with httpx.Client(base_url=restricted_service.url, timeout=60, headers=bearer(SMALL_TOKEN)) as small:
        started = time.monotonic()
        view = execute(small, "import time\ntime.sleep(8)\n")
        assert view["status"] == "timed_out", view
        assert time.monotonic() - started < 6
        too_many = small.post("/execute", json={"script": "", "tools": echo_tools(3)})
        assert_problem(too_many, 422, "tools")
    with restricted_service.client() as other:  # the other key keeps the server's maxima
        assert execute(other, "print(1)", echo_tools(3))["status"] == "succeeded"


def twenty_mib() -> Iterator[bytes]:
    yield b'{"script": "'
    for _ in range(20):
        yield b"x" * MIB
    yield b'"}'


def test_20_mib_body_is_413_and_the_service_keeps_serving(api: httpx.Client) -> None:
    declared = api.post(
        "/execute",
        content=b"".join(twenty_mib()),
        headers={"content-type": "application/json"},
    )
    assert declared.status_code == 413
    assert declared.headers["content-type"] == "application/problem+json"
    streamed = api.post("/execute", content=twenty_mib(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413  # chunked, no Content-Length: counted while read
    assert api.get("/healthz").status_code == 200
    assert execute(api, "print(6 * 7)")["stdout"] == "42\n"
