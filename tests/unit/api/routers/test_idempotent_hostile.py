"""``Idempotency-Key`` under hostile or buggy clients (issue 14's review): bodies the stdlib reads and orjson
cannot write, the header sent twice. Through the whole service on the fake backend (no engine)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.unit.api.routers.test_idempotent import PROBLEMS, counting, key, runs_of, service, work_dir

__all__ = ["work_dir"]  # the fixture, shared with test_idempotent

JSON = {"content-type": "application/json"}


async def test_a_body_with_nan_and_a_big_integer_gets_the_answer_it_gets_without_a_key(work_dir: Path) -> None:
    # NaN (read by the stdlib's parser) beside an integer past 64 bits: the digest was a ValueError, a 500
    body = '{"script":"print(1)","tools":[{"name":"t","x":NaN,"y":100000000000000000000000000}],"wait_s":5}'
    async with service(work_dir) as api:
        plain = await api["alice"].post("/execute", content=body, headers=JSON)
        keyed = await api["alice"].post("/execute", content=body, headers={**JSON, **key("nan-big")})
    assert plain.status_code == keyed.status_code == 422, keyed.text
    assert keyed.json()["type"] == plain.json()["type"] == PROBLEMS + "invalid-manifest"


async def test_nan_and_null_are_different_requests(work_dir: Path) -> None:
    # A tool's schema default NaN (the stdlib's reader takes it) was fingerprinted as null: a repeat with null
    # replayed the NaN request's job instead of answering 422
    script, runs = counting(work_dir)
    tool = (
        '{"name": "t", "description": "d", "endpoint": {"kind": "http", "url": "http://127.0.0.1:9/t"}, '
        '"parameters": {"type": "object", "properties": {"a": {"type": "number", "default": NaN}}}}'
    )
    first = '{"script": ' + httpx.Response(200, json=script).text + ', "wait_s": 30, "tools": [' + tool + "]}"
    async with service(work_dir) as api:
        ran = await api["alice"].post("/execute", content=first, headers={**JSON, **key("nan")})
        assert ran.status_code == 200, ran.text
        other = await api["alice"].post(
            "/execute", content=first.replace("NaN", "null"), headers={**JSON, **key("nan")}
        )
        assert other.status_code == 422, other.text
        assert other.json()["type"] == PROBLEMS + "idempotency-key-reused"
        again = await api["alice"].post("/execute", content=first, headers={**JSON, **key("nan")})
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["job_id"] == ran.json()["job_id"]
    assert runs_of(runs) == 1


async def test_the_header_sent_twice_is_refused_and_binds_nothing(work_dir: Path) -> None:
    script, runs = counting(work_dir)
    body = {"script": script, "wait_s": 30}
    async with service(work_dir) as api:
        twice = [("Idempotency-Key", "k-a"), ("Idempotency-Key", "k-b")]
        refused = await api["alice"].post("/execute", json=body, headers=twice)
        assert refused.status_code == 422, refused.text
        assert refused.json()["type"] == PROBLEMS + "invalid-request"
        assert refused.json()["errors"][0]["loc"] == ["header", "Idempotency-Key"]
        refused = await api["alice"].post("/sessions", json={}, headers=twice)
        assert refused.status_code == 422, refused.text
        for value in ("k-a", "k-b"):  # neither key was bound: each runs the script once
            answer = await api["alice"].post("/execute", json=body, headers=key(value))
            assert answer.status_code == 200, answer.text
            assert "idempotent-replayed" not in answer.headers
    assert runs_of(runs) == 2
