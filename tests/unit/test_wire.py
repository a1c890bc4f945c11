"""What crosses the broker socket keeps its exact meaning, and every job view can be served (issue 12, items 5-6).

Item 6: integers of any size cross exactly, from the script to the record and the endpoint and back; nothing
is rounded. Item 5: whatever a script writes to the socket itself (not JSON, NaN, infinities, lone surrogates,
integers past 64 bits, deep nesting, wrong types, unknown fields and tools) is refused or recorded within
bounds, and the view stays servable and self-consistent. Property tests drive a real ``Broker`` over a real
unix socket in-process (many examples) and real sandboxes through the service (a few, one session reused).
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import exactjson, verdict
from service.broker import Broker, BrokerConfig, BrokerShared
from service.broker.config import REPORT_FIELD_CAP
from service.broker.dispatch import MAX_TOOL_NAME_SHOWN
from service.egress import EgressPolicy
from service.jobs.live import stored_job
from service.schemas.job_models import JobView
from service.toolkit.cache import ManifestCache
from service.toolkit.endpoints import EndpointClients
from service.views import render

BIG = [12345678901234567890123, -(2**70), 2**64, -(2**63) - 1, 2**64 - 1]


ECHO_ANY = {"name": "echo_any", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}


TYPED = {"name": "typed", "parameters": {"properties": {"n": {"type": "integer"}}, "required": ["n"]}}


def same(a: Any, b: Any) -> bool:
    """JSON values equal with their types: 1 is not 1.0, True is not 1."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_exactjson_keeps_integers_and_refuses_what_json_cannot_carry() -> None:
    for x in [*BIG, 10**4000, -(10**299)]:
        assert same(exactjson.loads(exactjson.dumps({"x": x})), {"x": x})
        assert same(exactjson.loads(json.dumps([x, "\U0001f600"]).encode()), [x, "\U0001f600"])
    for bad in [b"NaN", b"[1e400, 12345678901234567890]", b'["\\ud800", 12345678901234567890]', b"1" * 5000]:
        with pytest.raises(ValueError):
            exactjson.loads(bad)
    with pytest.raises(ValueError):
        exactjson.strict_dumps({"x": math.nan})
    assert exactjson.loads(b"[0.1, 1e300, -0.0]") == [0.1, 1e300, -0.0]


def consistent(view: dict[str, Any]) -> None:
    """Totals match what the view shows."""
    assert view["calls_total"] == len(view["calls"])
    by_status: dict[str, int] = {}
    for record in view["calls"]:
        by_status[record["status"]] = by_status.get(record["status"], 0) + 1
    assert view["calls_by_status"] == by_status
    assert [r["seq"] for r in view["calls"]] == list(range(1, len(view["calls"]) + 1))
    for stream in ("stdout", "stderr"):
        shown = len(view[stream].encode())
        if not view[f"{stream}_truncated"] and not view[f"{stream}_invalid_utf8"]:
            assert shown == view[f"{stream}_bytes"], (stream, view[stream], view[f"{stream}_bytes"])
        assert shown <= view[f"{stream}_bytes"] or view[f"{stream}_invalid_utf8"]
    if view["status"] == "succeeded":
        assert view["error"] is None and view["exit_code"] == 0


def nest(levels: int, leaf: Any) -> Any:
    value = leaf
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**300), max_value=2**300),
    st.sampled_from([2**64, -(2**63) - 1, 12345678901234567890123, -(10**4299)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "x\udfff", "\U0001f600", "\x00", "\u2028"]),
)


VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)


ARGS = st.one_of(
    VALUES,
    st.dictionaries(st.sampled_from(["x", "n", "other", ""]), VALUES, max_size=3),
    st.builds(nest, st.integers(1, 400), VALUES),
    st.builds(lambda n: {"n": n}, st.one_of(st.integers(), st.sampled_from(BIG), st.text(max_size=3))),
    st.builds(lambda s: {"x": s}, st.text(min_size=3000, max_size=3000)),  # quoted by a schema error
)


TOOL_NAMES = st.one_of(
    st.sampled_from(["echo_any", "typed", "no_such_tool", "echo_ani", ""]),
    st.text(max_size=400),
    st.integers(),
    st.none(),
    st.sampled_from(["\ud800", "x" * 5000]),
)


IDS = st.one_of(st.integers(), st.sampled_from([2**64, -(2**70), 2**64 - 1]), st.text(max_size=5), st.floats())


REQUESTS = st.fixed_dictionaries(
    {"id": IDS, "tool": TOOL_NAMES},
    optional={"extra": VALUES, "args": ARGS},
)


REPORTS = st.fixed_dictionaries(
    {"id": IDS, "op": st.just("report")},
    optional={
        "error": st.fixed_dictionaries({"type": st.text(max_size=5)}, optional={"line": LEAVES, "column": LEAVES})
    },
)


def encoded(value: Any) -> bytes:
    """As a careless script would write it: NaN and Infinity literals, lone surrogates as escapes."""
    return json.dumps(value, allow_nan=True).encode()


LINES = st.lists(
    st.one_of(
        REQUESTS.map(encoded),
        REPORTS.map(encoded),
        st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")),  # not JSON, not UTF-8
        REQUESTS.map(encoded).map(lambda b: b[: len(b) // 2]),  # cut short
        st.sampled_from([b"[]", b"null", b"12345678901234567890123", b'"tool"', b"{}", b'{"tool":"echo_any"}']),
        st.just(b'{"id":1,"tool":"echo_any","args":{"x":' + b"9" * 4400 + b"}}"),  # past Python's 4,300 digits
    ),
    min_size=1,
    max_size=5,
)


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def tool_call(line: bytes) -> dict[str, Any] | None:
    """The request a line carries when the broker must take it as a tool call (a record), else None."""
    try:
        request = json.loads(line, parse_constant=_no_constant)
        exactjson.strict_dumps(request)  # infinities and lone surrogates: not JSON that keeps its meaning
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict) or request.get("op") == "report" or not isinstance(request.get("tool"), str):
        return None
    return request


def view_of(records: list[dict[str, Any]], report: dict[str, Any] | None) -> dict[str, Any]:
    """A job view around ``records`` with every other field as a failed job's (the script's report in its error)."""
    now = datetime.now(UTC)
    return {
        "job_id": "job_wire",
        "status": "failed",
        "exit_code": 1,
        "stdout": "after\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "stdout_bytes": 6,
        "stderr_bytes": 0,
        "stdout_invalid_utf8": False,
        "stderr_invalid_utf8": False,
        "calls": records,
        "calls_total": len(records),
        "calls_by_status": {},
        "calls_over_limit": 0,
        "error": verdict.failure(1, None, report),
        "metadata": {},
        "created_at": now,
        "started_at": now,
        "ended_at": now,
        "duration_ms": 1.0,
        "queue_ms": 0.0,
        "owner": "pytest",
    }


async def exchange(lines: list[bytes], folder: Path) -> tuple[Broker, list[dict[str, Any]]]:
    """Send ``lines`` to a real broker over a real unix socket; returns it (closed) and the replies."""
    manifest = await ManifestCache(b"k" * 32).compile([ECHO_ANY, {**TYPED, "endpoint": {"kind": "echo"}}], "pytest")
    endpoints = EndpointClients(30.0, 8 * 1024 * 1024, EgressPolicy([]))
    broker = Broker(manifest.tools, BrokerShared(endpoints), BrokerConfig(100, 1024 * 1024, 64 * 1024))
    path = folder / "tools.sock"
    await broker.start(path)
    replies = []
    try:
        reader, writer = await asyncio.open_unix_connection(str(path), limit=16 * 1024 * 1024)
        writer.write(b"".join(line + b"\n" for line in lines))
        await writer.drain()
        for _ in range(sum(1 for line in lines if line.strip())):
            raw = await asyncio.wait_for(reader.readline(), 10)
            replies.append(exactjson.loads(raw))  # every reply is JSON that keeps its meaning
        # Wait for the broker to end the connection before closing it: closing the broker's server while an
        # accepted connection is still being set up leaks that connection inside asyncio (CPython gh-109564).
        writer.write_eof()
        await reader.read()
        writer.close()
        await writer.wait_closed()
    finally:
        await broker.close()
        await endpoints.aclose()
    return broker, replies


def test_a_refused_argument_is_quoted_within_bounds(socket_dir: Path) -> None:
    line = json.dumps({"id": 1, "tool": "typed", "args": {"n": "x" * 100_000}}).encode()
    broker, replies = asyncio.run(exchange([line], socket_dir))
    (reply,) = replies
    assert reply["error"]["type"] == "invalid_arguments"
    assert len(reply["error"]["message"]) <= REPORT_FIELD_CAP + 1
    assert broker.records.calls[0]["error"] == reply["error"]


def test_a_view_that_cannot_be_encoded_contradicts_nothing() -> None:
    view = view_of([], None)
    view.update(status="succeeded", exit_code=0, error=None, stdout="x" * 27, stdout_bytes=27)
    view["calls"] = [{"status": "ok", "seq": 1}]
    view.update(render.unencodable(view))
    consistent({**view, "error": None})
    assert view["stdout_truncated"] and view["error"]["type"] == "internal_error"


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ptcw", dir="/tmp") as folder:
        yield Path(folder)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=LINES)
def test_whatever_a_script_sends_the_records_stay_bounded_exact_and_servable(
    lines: list[bytes], socket_dir: Path
) -> None:
    broker, replies = asyncio.run(exchange(lines, socket_dir))
    assert all(isinstance(r, dict) and isinstance(r.get("ok"), bool) for r in replies)
    records = broker.records.calls
    # a record for each line the broker took as a tool call, nothing for the rest
    requests = [request for request in map(tool_call, lines) if request is not None]
    assert len(records) == len(requests)
    for record in records:
        assert record["status"] in ("ok", "rejected", "error")
        assert len(record["tool"]) <= MAX_TOOL_NAME_SHOWN
        assert record["error"] is None or len(record["error"]["message"]) <= REPORT_FIELD_CAP + 1
    # the view encodes, validates, reads back from the store and lists; its totals match what it shows
    view = view_of(render.snapshot(records), broker.records.script_report)
    head = render.render_head(view)
    body = asyncio.run(render.encode(head, render.snapshot(records))).body
    model = JobView.model_validate_json(body)
    shown = json.loads(body)
    shown["calls_by_status"] = {s: sum(r["status"] == s for r in shown["calls"]) for s in ("ok", "rejected", "error")}
    shown["calls_by_status"] = {k: v for k, v in shown["calls_by_status"].items() if v}
    consistent(shown)
    assert model.calls_total == len(model.calls) == len(records)
    stored_head, spans = render.scan(body)
    assert len(spans) == len(records)
    stored_job(stored_head, len(spans), body, "wire")
    # kept arguments are exactly what was sent
    for request, record in zip(requests, shown["calls"], strict=True):
        if record["args"] is not None and not record["repaired"]:
            assert same(record["args"], request.get("args")), (request, record["args"])
