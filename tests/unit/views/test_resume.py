"""Resumable events without an engine: the event id (``service.views.resume``) and reconnecting after any event of a
job's stream, mid-job and after its end, on the whole service with the fake backend. Whatever the cut, the
output received concatenates to the job's output byte for byte, each call arrives once (they end out of order
here: client-executed calls answered in another order), and a status is sent again only if it changed."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import shutil
import sys
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.composition.job_manager import JobManager
from service.errors import JobNotFound
from service.sandbox.fake import FakeBackend
from service.schemas.job_models import ExecuteRequest
from service.settings import Settings
from service.tenancy import IMPLICIT_OWNER, Caller
from service.views import read as job_views
from service.views.render import BATCH_BYTES, FULL
from service.views.resume import InvalidPosition, Position, parse, record_call_id
from tests.unit.test_view_modes import ARG, RESULT, SCRIPT, TOOLS, fake_service, parse_sse, run_job, wait_for_pending

ANYONE = Caller(IMPLICIT_OWNER)


@pytest.fixture
async def app() -> AsyncIterator[FastAPI]:
    async with fake_service() as application:
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fake", timeout=60) as c:
        yield c


def test_a_position_round_trips_through_its_token() -> None:
    position = Position(stdout=70_000, stderr=3, status="waiting", ended=False)
    for seq in (1, 2, 3, 5, 9, 700):
        position.mark(seq)
    assert (position.low, position.after) == (3, {5, 9, 700})
    back = parse(position.token("job_a"), "job_a")
    assert back == position
    assert parse(Position().token("job_a"), "job_a") == Position()
    ended = Position(status="succeeded", ended=True, low=4)
    assert parse(ended.token("job_a"), "job_a") == ended


def _token(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "token",
    [
        "",
        "!!!not base64!!!",
        "x" * 20_000,
        "AQ",  # the version only
        _token(b"\x02" + hashlib.sha256(b"job_a").digest()[:4] + b"\x00\x00\x00\x00\x00"),  # another version
        _token(b"\x01" + hashlib.sha256(b"job_a").digest()[:4] + b"\x07\x00\x00\x00\x00"),  # unknown flags
        _token(b"\x01" + hashlib.sha256(b"job_a").digest()[:4] + b"\x00\x05bogus\x00\x00\x00"),  # no such status
        _token(b"\x01" + hashlib.sha256(b"job_a").digest()[:4] + b"\x00\x02\xff\xfe\x00\x00\x00"),  # not ASCII
        _token(b"\x01" + hashlib.sha256(b"job_a").digest()[:4] + b"\x00\x00" + b"\xff" * 11),  # endless varint
        _token(b"\x01" + hashlib.sha256(b"job_a").digest()[:4] + b"\x00\x00\x00\x00"),  # truncated
        Position(stdout=5).token("job_b"),  # another job's
    ],
)
def test_malformed_forged_or_foreign_tokens_are_refused(token: str) -> None:
    with pytest.raises(InvalidPosition):
        parse(token, "job_a")


def test_a_position_past_what_the_job_has_is_refused() -> None:
    retained = {"stdout": 10, "stderr": 0}
    Position(stdout=10, low=2).check(2, retained)
    with pytest.raises(InvalidPosition):
        Position(stdout=11).check(2, retained)
    with pytest.raises(InvalidPosition):
        Position(stderr=1).check(2, retained)
    with pytest.raises(InvalidPosition):
        Position(low=3).check(2, retained)
    position = Position()
    position.mark(3)
    with pytest.raises(InvalidPosition):
        position.check(2, retained)


def check_received(events: list[tuple[str, Any, str]], final: dict[str, Any]) -> None:
    """What a follower received over its connections, as if one: nothing lost, nothing repeated."""
    stdout = "".join(data["text"] for event, data, _ in events if event == "stdout")
    assert stdout == final["stdout"]
    offsets = [data["offset"] for event, data, _ in events if event == "stdout"]
    assert offsets == sorted(set(offsets))
    seqs = [orjson.loads(data)["seq"] for event, data, _ in events if event == "call"]
    assert sorted(seqs) == [call["seq"] for call in final["calls"]], seqs
    statuses = [data["status"] for event, data, _ in events if event == "status"]
    assert all(a != b for a, b in itertools.pairwise(statuses)), statuses
    assert [event for event, _, _ in events].count("end") == 1 and events[-1][0] == "end"


async def test_reconnecting_mid_job_resumes_right_after_the_last_event(app: FastAPI, client: httpx.AsyncClient) -> None:
    jobs: JobManager = app.state.jobs
    answer = await client.post("/execute", json={"script": SCRIPT, "tools": TOOLS, "wait_s": 0})
    job_id = answer.json()["job_id"]
    pending = await wait_for_pending(client, job_id, 3)
    by_arg = {call["args"]["q"]: call["call_id"] for call in pending}
    received: list[tuple[str, Any, str]] = []

    async def follow(until: Any, last_id: str | None) -> None:
        start = await jobs.views.resume_point(job_id, ANYONE, last_id, ("header",)) if last_id else None
        stream = cast(AsyncGenerator[tuple[str, Any, str]], jobs.views.events(job_id, ANYONE, FULL, start))
        try:
            async for event in stream:
                received.append(event)
                if until(event):
                    return
        finally:
            await stream.aclose()  # the disconnect

    await follow(lambda event: sum(e == "call" for e, _, _ in received) == 3, None)  # the echo calls
    await client.post(f"/jobs/{job_id}/calls/{by_arg[f'{ARG}-ask-2']}", json={"result": f"{RESULT}-2"})
    await follow(lambda event: event[0] == "call", received[-1][2])  # ask-2 (seq 6) ends first
    assert orjson.loads(received[-1][1])["seq"] == 6
    position = parse(received[-1][2], job_id)
    assert (position.low, position.after) == (3, {6})  # the id keeps the call that ended out of order
    await client.post(f"/jobs/{job_id}/calls/{by_arg[f'{ARG}-ask-0']}", json={"result": f"{RESULT}-0"})
    await follow(lambda event: event[0] == "call", received[-1][2])
    await client.post(f"/jobs/{job_id}/calls/{by_arg[f'{ARG}-ask-1']}", json={"result": f"{RESULT}-1"})
    await follow(lambda event: event[0] == "stdout" and "line 3 " in event[1]["text"], received[-1][2])
    await follow(lambda event: False, received[-1][2])  # to the end
    final = (await client.get(f"/jobs/{job_id}")).json()
    check_received(received, final)
    assert [orjson.loads(data)["seq"] for event, data, _ in received if event == "call"] == [1, 2, 3, 6, 4, 5]


async def test_reconnecting_after_any_event_of_an_ended_job(client: httpx.AsyncClient) -> None:
    final = await run_job(client)
    job_id = final["job_id"]
    whole = parse_sse((await client.get(f"/jobs/{job_id}/events")).content)
    assert all(event_id for _, _, event_id in whole)
    decoded = [
        (event, orjson.loads(data) if event in ("status", "stdout", "stderr") else data, i) for event, data, i in whole
    ]
    check_received(decoded, final)
    for cut in range(1, len(whole)):
        answer = await client.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": whole[cut - 1][2]})
        assert answer.status_code == 200
        assert parse_sse(answer.content) == whole[cut:], cut  # the same events, from the cut on
    # after the end: nothing follows, and an EventSource stops reconnecting on 204
    answer = await client.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": whole[-1][2]})
    assert answer.status_code == 204 and answer.content == b""


async def test_the_query_parameter_resumes_too_and_the_header_wins(client: httpx.AsyncClient) -> None:
    final = await run_job(client)
    job_id = final["job_id"]
    whole = parse_sse((await client.get(f"/jobs/{job_id}/events")).content)
    answer = await client.get(f"/jobs/{job_id}/events", params={"last_event_id": whole[2][2]})
    assert parse_sse(answer.content) == whole[3:]
    answer = await client.get(
        f"/jobs/{job_id}/events", params={"last_event_id": whole[2][2]}, headers={"Last-Event-ID": whole[4][2]}
    )
    assert parse_sse(answer.content) == whole[5:]


async def test_bad_event_ids_are_problems(client: httpx.AsyncClient) -> None:
    first = (await run_job(client))["job_id"]
    other = (await client.post("/execute", json={"script": "print(1)"})).json()["job_id"]
    foreign = parse_sse((await client.get(f"/jobs/{other}/events")).content)[0][2]
    too_far = Position(stdout=1 << 40).token(first)
    for headers, params, loc in (
        ({"Last-Event-ID": "garbage!"}, {}, ["header", "Last-Event-ID"]),
        ({"Last-Event-ID": foreign}, {}, ["header", "Last-Event-ID"]),
        ({"Last-Event-ID": too_far}, {}, ["header", "Last-Event-ID"]),
        ({}, {"last_event_id": "AQAAAAAA"}, ["query", "last_event_id"]),
    ):
        answer = await client.get(f"/jobs/{first}/events", headers=headers, params=params)
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["errors"][0]["loc"] == loc
    answer = await client.get("/jobs/job_000000000000000000000000/events", headers={"Last-Event-ID": "garbage!"})
    assert answer.status_code == 404  # an unknown job first: the id is not even looked at


async def test_another_owners_job_is_not_found_whatever_the_event_id(app: FastAPI, client: httpx.AsyncClient) -> None:
    jobs: JobManager = app.state.jobs
    job_id = (await client.post("/execute", json={"script": "print(1)"})).json()["job_id"]
    token = Position(stdout=2).token(job_id)
    assert (await jobs.views.resume_point(job_id, ANYONE, token, ("header",))).stdout == 2
    with pytest.raises(JobNotFound):
        await jobs.views.resume_point(job_id, Caller("mallory"), token, ("header",))
    with pytest.raises(JobNotFound):
        await jobs.views.resume_point(job_id, Caller("mallory"), "garbage", ("header",))


def _lines_in_resume(action: Any) -> int:
    """Python lines ``action()`` runs in ``service/views/resume.py`` (a cost that does not depend on the machine)."""
    from service.views import resume

    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == resume.__file__ else None

    sys.settrace(on_call)
    try:
        action()
    finally:
        sys.settrace(None)
    return count


def test_an_event_id_costs_the_same_however_many_calls_ended_out_of_order() -> None:
    """10,000 calls that end before seq 1 (pending all along): each of their events gets an id; building one must
    not walk the set of seqs sent in Python (it did: 10,000 ids then cost O(n^2), ~6 s of the event loop)."""
    position = Position()
    for seq in range(2, 10_002):
        position.mark(seq)
    few = Position()
    few.mark(2)
    assert _lines_in_resume(lambda: position.token("job_a")) <= _lines_in_resume(lambda: few.token("job_a")) + 5
    back = parse(position.token("job_a"), "job_a", 10_001)
    assert back == position and (back.low, len(back.after)) == (0, 10_000)
    position.mark(1)
    assert (position.low, position.after) == (10_001, set())
    assert parse(position.token("job_a"), "job_a") == position


def test_a_forged_id_counting_more_calls_than_the_job_has_is_refused_before_it_is_expanded() -> None:
    """An id of MAX_TOKEN_CHARS whose bitmap claims ~96,000 calls, for a job of 3: refused without marking them."""
    raw = b"\x01" + hashlib.sha256(b"job_a").digest()[:4] + b"\x00\x00\x00\x00\x00" + b"\xaa" * 12_000
    forged = _token(raw)
    with pytest.raises(InvalidPosition):
        parse(forged, "job_a", 3)

    def refuse() -> None:
        with pytest.raises(InvalidPosition):
            parse(forged, "job_a", 3)

    lines = _lines_in_resume(refuse)
    assert lines < 100, lines


async def test_a_follower_that_stops_reading_in_an_end_event_holds_up_no_other() -> None:
    """The ``end`` events being sent shared a byte budget, held while each was sent as one piece: a client that
    stopped reading in one kept its bytes held, holding up every other key's end events that did not fit
    beside them (the budget bounded nothing anyway: the server buffers a piece once handed it). Now nothing is
    held: the end of a whole view is the stored bytes themselves, sent in slices."""
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir, auth="disabled", sandbox_folders_tmpfs_mb=0, warm_pool_size=0, view_cache_bytes=4096
    )
    application = create_app(settings, FakeBackend())
    try:
        async with application.router.lifespan_context(application):
            jobs: JobManager = application.state.jobs
            alice, bob = Caller("alice"), Caller("bob")
            request = ExecuteRequest(script='print("x" * 3000)')
            ids: dict[str, list[str]] = {}
            for who in (alice, bob, alice):
                job = await jobs.submit(request, who.owner)
                await jobs.views.wait(job.id, who, 30)
                ids.setdefault(who.owner, []).append(job.id)
            stuck = cast(AsyncGenerator[tuple[str, Any, str]], jobs.views.events(ids["alice"][0], alice))
            try:
                while (await anext(stuck))[0] != "end":  # alice's client stops reading in the end event
                    pass
                for who, job_id in ((bob, ids["bob"][0]), (alice, ids["alice"][1])):
                    events = await asyncio.wait_for(_all(jobs.views.events(job_id, who)), 30)
                    assert events[-1][0] == "end" and b"x" * 3000 in events[-1][1]
            finally:
                await stuck.aclose()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


async def _all(events: AsyncIterator[tuple[str, Any, str]]) -> list[tuple[str, Any, str]]:
    return [event async for event in events]


async def test_following_a_job_looks_at_each_record_once_not_at_all_of_them_per_change(
    app: FastAPI, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower woke on each change and looked at every record from the first one not sent: with seq 1 pending
    (a client call) while 4,000 calls ended one by one, 8 million looks, ~3 s of the event loop per follower
    (O(n^2)). Now it looks again only at the records it saw pending."""
    count = 300
    script = f"""
import asyncio, tools
first = asyncio.ensure_future(tools.aio.ask(q="first"))
await asyncio.sleep(0.1)
for i in range({count}):
    tools.echo(text=str(i))
await first
"""
    looks = 0
    sent = Position.sent

    def counted(self: Position, seq: int) -> bool:
        nonlocal looks
        looks += 1
        return sent(self, seq)

    monkeypatch.setattr(Position, "sent", counted)
    jobs: JobManager = app.state.jobs
    answer = await client.post("/execute", json={"script": script, "tools": TOOLS, "wait_s": 0})
    job_id = answer.json()["job_id"]
    received: list[tuple[str, Any, str]] = []
    async for event in jobs.views.events(job_id, ANYONE):
        received.append(event)
        if event[0] == "call" and sum(e == "call" for e, _, _ in received) == count:  # every echo; the ask waits
            (pending,) = await wait_for_pending(client, job_id, 1)
            await client.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": 1})
    seqs = [orjson.loads(data)["seq"] for event, data, _ in received if event == "call"]
    assert seqs == [*range(2, count + 2), 1]
    assert looks <= 4 * count, looks


async def _sse_sends(
    app: FastAPI, path: str, headers: dict[str, str] | None = None, pieces: list[bytes] | None = None
) -> list[bytes]:
    """The body pieces the app hands the server for a GET of ``path`` (each ``send`` of the response, appended to
    ``pieces`` as they come), as the server gets them: a server writes each piece whole and waits for the client
    only between pieces."""
    pieces = [] if pieces is None else pieces
    done = asyncio.Event()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()] + [(b"host", b"fake")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            pieces.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await asyncio.wait_for(app(scope, receive, send), 60)
    return pieces


async def test_a_large_end_event_is_handed_to_the_server_in_slices(app: FastAPI, client: httpx.AsyncClient) -> None:
    """The ``end`` event was one piece, a copy of the whole view: a client that stopped reading left it in the
    server's write buffer (12 such connections to a 40 MB view: +330 MB of the service's memory, up to
    PTC_MAX_CONNECTIONS_PER_ADDRESS of them). Sent in slices of at most BATCH_BYTES, the server waits for the
    client between them; the event, once reassembled, is the same."""
    script = "import tools\nfor i in range(3):\n    tools.echo(text='" + ARG + "' * 100_000)\n"
    final = await client.post("/execute", json={"script": script, "tools": TOOLS, "wait_s": 60})
    job_id = final.json()["job_id"]
    assert len(final.content) > 3 * BATCH_BYTES
    for headers in ({}, {"Last-Event-ID": parse_sse((await client.get(f"/jobs/{job_id}/events")).content)[-2][2]}):
        pieces = await _sse_sends(app, f"/jobs/{job_id}/events", headers)
        assert max(map(len, pieces)) <= BATCH_BYTES + 1024, [len(p) for p in pieces]
        events = parse_sse(b"".join(pieces))
        assert events[-1][0] == "end" and events[-1][1] == final.content


async def test_a_quiet_live_job_gets_heartbeats_between_events(
    app: FastAPI, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's own pings (the library's are off: one could land inside a large event sent in slices) come as
    comments between events while a live job is quiet, and the events around them are intact."""
    monkeypatch.setattr(job_views, "HEARTBEAT_S", 0.05)
    answer = await client.post("/execute", json={"script": SCRIPT, "tools": TOOLS, "wait_s": 0})
    job_id = answer.json()["job_id"]
    pending = await wait_for_pending(client, job_id, 3)
    pieces: list[bytes] = []
    sending = asyncio.ensure_future(_sse_sends(app, f"/jobs/{job_id}/events", None, pieces))
    for _ in range(600):
        if b": ping\r\n\r\n" in pieces:
            break
        await asyncio.sleep(0.05)
    assert b": ping\r\n\r\n" in pieces
    for call in pending:
        await client.post(f"/jobs/{job_id}/calls/{call['call_id']}", json={"result": RESULT})
    await sending
    final = (await client.get(f"/jobs/{job_id}")).json()
    events = parse_sse(b"".join(pieces))
    check_received([(e, orjson.loads(d) if e in ("status", "stdout", "stderr") else d, i) for e, d, i in events], final)


async def test_a_job_that_changes_without_events_still_gets_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose changes send nothing (output past its retention: no output event) woke its followers again and
    again, and a ping came only after a quiet ``HEARTBEAT_S``: never, and a proxy's idle timeout cut the stream."""
    monkeypatch.setattr(job_views, "HEARTBEAT_S", 0.2)
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir, auth="disabled", sandbox_folders_tmpfs_mb=0, warm_pool_size=0, output_retention_bytes=0
    )
    application = create_app(settings, FakeBackend())
    script = """
import asyncio, tools
answer = asyncio.ensure_future(tools.aio.ask(q="stop"))
while not answer.done():
    print("chatter", flush=True)
    await asyncio.sleep(0.01)
"""
    try:
        async with application.router.lifespan_context(application):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://f") as c:
                jobs: JobManager = application.state.jobs
                job_id = (await c.post("/execute", json={"script": script, "tools": TOOLS, "wait_s": 0})).json()[
                    "job_id"
                ]
                (pending,) = await wait_for_pending(c, job_id, 1)
                received: list[str] = []

                async def follow() -> None:
                    async for event, _, _ in jobs.views.events(job_id, ANYONE):
                        received.append(event)
                        if event == "ping" and received.count("ping") == 1:
                            await c.post(f"/jobs/{job_id}/calls/{pending['call_id']}", json={"result": 1})

                await asyncio.wait_for(follow(), 30)  # no ping: the call is never answered, the job never ends
                assert "ping" in received and received[-1] == "end"
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def test_a_lost_jobs_position_is_clamped_to_what_it_kept() -> None:
    """A job marked lost keeps its output and records as of its last progress save: a follower's position may be
    past them (it saw more while the job ran). Refused unless clamped; clamped, it moves back to what the job has."""

    seen = Position(stdout=100, stderr=7, status="running")
    for seq in (1, 2, 3, 5, 6):
        seen.mark(seq)
    token = seen.token("job_1")
    with pytest.raises(InvalidPosition):
        parse(token, "job_1", 2)
    with pytest.raises(InvalidPosition):
        parse(token, "job_1", 6).check(6, {"stdout": 40, "stderr": 7})
    clamped = parse(token, "job_1", 2, clamp=True)
    clamped.check(2, {"stdout": 40, "stderr": 7}, clamp=True)
    assert (clamped.stdout, clamped.stderr, clamped.low, clamped.after) == (40, 7, 2, set())
    assert [clamped.sent(seq) for seq in (1, 2, 3)] == [True, True, False]
    kept = parse(token, "job_1", 5, clamp=True)  # seq 4 never sent, 5 sent: kept
    kept.check(5, {"stdout": 100, "stderr": 7}, clamp=True)
    assert (kept.stdout, kept.low, kept.after) == (100, 3, {5})
    assert parse(kept.token("job_1"), "job_1", 5).after == {5}  # a valid position of the lost job


def test_a_records_call_id_is_read_from_its_head_or_its_whole_json() -> None:
    """The stream knows a record by its call id (a resume's replay may reorder records): a stored record as written
    (``seq``, then ``call_id``) is read from its first bytes; one in another key order is parsed whole."""
    assert record_call_id({"seq": 1, "call_id": "call_a"}) == "call_a"
    assert record_call_id(memoryview(b'{"seq":12,"call_id":"call_0123456789abcdef","tool":"t"}')) == (
        "call_0123456789abcdef"
    )
    assert record_call_id(b'{"seq":1,"tool":"' + b"x" * 200 + b'","call_id":"call_b"}') == "call_b"
