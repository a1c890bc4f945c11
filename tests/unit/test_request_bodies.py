"""Request bodies are parsed and validated on worker threads, fairly between keys, never on the event loop.

Issue 11 review, fault 2: a 7 MiB ``metadata`` of empty arrays, refused with 422, held the loop 2.45 s.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Annotated, Any

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import AfterValidator, BaseModel

from service.api.bodies import INLINE_BODY_BYTES, INLINE_BODY_CONTAINERS, MAX_BODY_DEPTH, ParsedOffLoop, parse_body
from service.collector import gc_paused
from service.schemas.common import check_metadata
from service.schemas.job_models import ExecuteRequest
from service.toolkit.validation import CheckScheduler

ON_LOOP: list[bool] = []


def _where(value: int) -> int:
    try:
        asyncio.get_running_loop()
        ON_LOOP.append(True)
    except RuntimeError:
        ON_LOOP.append(False)
    return value


class Probe(BaseModel):
    x: Annotated[int, AfterValidator(_where)]


def _probe_app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = ParsedOffLoop
    app.state.bodies = CheckScheduler(1, 60.0)

    @app.post("/probe")
    async def probe(body: Probe, request: Request) -> dict[str, Any]:
        return {"x": body.x, "fields": sorted(body.model_fields_set)}

    return app


@pytest.mark.parametrize(
    ("pad", "on_loop"),
    [
        ("", True),  # small: parsed and validated on the loop (a hand-off costs more)
        ("a" * INLINE_BODY_BYTES, False),  # large: on a worker thread
        ("[" * (INLINE_BODY_CONTAINERS + 1), False),  # small, but with many containers to walk: a worker thread
    ],
)
def test_body_validators_run_off_the_event_loop_but_for_small_bodies(pad: str, on_loop: bool) -> None:
    ON_LOOP.clear()
    with TestClient(_probe_app()) as client:
        ok = client.post("/probe", json={"x": 3, "pad": pad})
        bad = client.post("/probe", json={"x": "three", "pad": pad})
        not_json = client.post("/probe", content=b'{"x": ', headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json() == {"x": 3, "fields": ["x"]}
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "x"]
    assert not_json.status_code == 422 and not_json.json()["detail"][0]["type"] == "json_invalid"
    assert ON_LOOP == [on_loop]  # validated once (FastAPI's own pass keeps the instance)


def test_refused_bodies_carry_no_input_in_their_errors() -> None:
    huge = b'{"script": "print(1)", "metadata": {"x": [' + b"[]," * 100_000 + b"[]]}}"
    field = _field(ExecuteRequest)
    with pytest.raises(RequestValidationError) as caught:
        parse_body(huge, field)
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [("body", "metadata")]
    assert all(set(e) == {"type", "loc", "msg"} for e in errors)  # no megabytes of "input" to encode


@pytest.mark.parametrize("levels", [MAX_BODY_DEPTH + 1, 1_000, 5_000])
def test_bodies_nested_deeper_than_the_limit_are_refused(levels: int) -> None:
    deep = b'{"script": "print(1)", "metadata": ' + b"[" * levels + b"]" * levels + b"}"
    with pytest.raises(RequestValidationError) as caught:
        parse_body(deep, _field(ExecuteRequest))
    assert caught.value.errors()[0]["type"] in {"too_deep", "json_invalid"}


def test_a_body_at_the_depth_limit_is_parsed() -> None:
    levels = MAX_BODY_DEPTH - 1  # the object around it is one level
    value = parse_body(b'{"x": ' + b"[" * levels + b"]" * levels + b"}", lambda v: (v, []))
    assert isinstance(value["x"], list)


def test_bytes_that_are_not_utf8_are_invalid_json() -> None:
    with pytest.raises(RequestValidationError) as caught:
        parse_body(b'{"a": "\xff"}', lambda v: (v, []))
    assert caught.value.errors()[0]["type"] == "json_invalid"


def test_an_integer_past_the_interpreters_digit_limit_is_invalid_json() -> None:
    # Python refuses int() of more than 4,300 digits with a ValueError that is no JSONDecodeError: it was a 500
    # (internal-error) for POST /execute with such a number anywhere in the body (metadata, env, ...).
    with pytest.raises(RequestValidationError) as caught:
        parse_body(b'{"a": ' + b"1" * 5000 + b"}", lambda v: (v, []))
    error = caught.value.errors()[0]
    assert error["type"] == "json_invalid" and error["loc"] == ("body",)
    assert "1111" not in error["msg"]


def test_lone_surrogates_are_still_read() -> None:
    assert parse_body(b'{"a": "\\ud800"}', lambda v: (v, [])) == {"a": "\ud800"}


def test_metadata_size_is_checked_before_its_depth() -> None:
    with pytest.raises(ValueError, match="larger than"):
        check_metadata({"x": [[] for _ in range(100_000)]})


def _field(model: type[BaseModel]) -> Any:
    app = FastAPI()
    app.router.route_class = ParsedOffLoop

    async def m(body: Any) -> None:
        return None

    m.__annotations__ = {"body": model, "return": None}  # resolved now: this module's annotations are strings
    app.post("/m")(m)
    route = app.router.routes[-1]
    assert isinstance(route, ParsedOffLoop) and route.body_field is not None
    body_field = route.body_field

    def validate(value: Any) -> tuple[Any, list[Any]]:
        return body_field.validate(value, {}, loc=("body",))

    return validate


def test_the_collector_is_paused_while_any_parse_runs_and_restored_after() -> None:
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer parse still runs
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def test_young_cycles_are_collected_while_parses_overlap_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from service import collector

    collected: list[int] = []
    monkeypatch.setattr(collector, "GC_PAUSE_MAX_S", 0.0)

    def collect(generation: int = 2) -> int:
        collected.append(generation)
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    with gc_paused():
        with gc_paused():
            pass
        assert collected == [1]  # the outer parse still holds the pause, past GC_PAUSE_MAX_S
    assert collected == [1] and gc.isenabled()
