"""Answers sent while the client takes them (service/api/reads.py), on the fake backend with the app in-process.

A slow client is an ASGI ``send`` that does not return: the tests look at what the service holds then (traced
memory, the key's slots) and at the pieces it sends, never at how long anything takes.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
import threading
import tracemalloc
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.api.reads import ReadSlots, holding
from service.api.responses import OUTPUT_SLICE_BYTES
from service.api.routers import jobs as jobs_router
from service.errors import QuotaExceeded
from service.sandbox.fake import FakeBackend
from service.schemas.job_models import JobSummary
from service.settings import Settings
from service.tenancy import hash_token

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdefgh"
FILE_BYTES = 8 * 1024 * 1024
READS_PER_KEY = 2


@pytest.fixture
async def app() -> AsyncIterator[FastAPI]:
    work_dir = Path(tempfile.mkdtemp(prefix="ptcr", dir="/tmp"))
    settings = Settings(
        work_dir=work_dir,
        api_keys=f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)}",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id="fake-" + work_dir.name,
        max_output_files_bytes=2 * FILE_BYTES,
        max_reads_per_key=READS_PER_KEY,
    )
    app = create_app(settings, FakeBackend())
    try:
        async with app.router.lifespan_context(app):
            yield app
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def client(app: FastAPI, token: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(
        transport=transport, base_url="http://fake", timeout=60, headers={"Authorization": f"Bearer {token}"}
    )


class SlowClient:
    """One GET sent straight to the app; its ``send`` stops at the first piece of the body until ``go`` is set.

    Attributes:
        pieces: the body's pieces as sent. status: the answer's status.
        first: set once the first piece is being sent (the client has not taken it).
        held_bytes: traced memory (``tracemalloc``, current) when the first piece was sent.
    """

    def __init__(self, app: FastAPI, path: str, token: str) -> None:
        self.pieces: list[bytes] = []
        self.status = 0
        self.first, self.go = asyncio.Event(), asyncio.Event()
        self.held_bytes = 0
        target, _, query = path.partition("?")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": target,
            "raw_path": target.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [(b"host", b"fake"), (b"authorization", f"Bearer {token}".encode())],
            "client": ("127.0.0.1", 50000),
            "server": ("fake", 80),
        }
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if not hasattr(self, "_asked"):
            self._asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # never disconnects
        raise AssertionError("unreachable")

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            if not self.first.is_set():
                self.held_bytes = tracemalloc.get_traced_memory()[0]
                self.first.set()
                await self.go.wait()
            self.pieces.append(message["body"])

    async def body(self) -> bytes:
        self.go.set()
        await self.task
        return b"".join(self.pieces)


async def test_a_session_file_is_sent_a_slice_at_a_time_and_never_held_whole(app: FastAPI) -> None:
    """A file of 8 MiB to a client that takes nothing: while the first slice waits, the service holds less than
    a quarter of the file (on main: the whole file, as one body); the pieces are slices of OUTPUT_SLICE_BYTES."""
    async with client(app, ALICE) as alice:
        sid = (await alice.post("/sessions", json={})).json()["session_id"]
        script = (
            f"import hashlib, os\ndata = os.urandom({FILE_BYTES})\nopen('big.bin', 'wb').write(data)\n"
            "print(hashlib.sha256(data).hexdigest())\n"
        )
        view = (await alice.post("/execute", json={"script": script, "session_id": sid})).json()
        assert view["status"] == "succeeded", view
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            slow = SlowClient(app, f"/sessions/{sid}/files/big.bin", ALICE)
            await asyncio.wait_for(slow.first.wait(), 60)
            held = slow.held_bytes - before
        finally:
            tracemalloc.stop()
        body = await slow.body()
        assert slow.status == 200
        assert hashlib.sha256(body).hexdigest() == view["stdout"].strip()
        assert held < FILE_BYTES // 4, f"{held} bytes held for a file of {FILE_BYTES}"
        assert len(slow.pieces) >= FILE_BYTES // OUTPUT_SLICE_BYTES
        assert max(map(len, slow.pieces)) <= OUTPUT_SLICE_BYTES


async def test_one_keys_lists_and_downloads_under_way_are_bounded_and_others_are_served(app: FastAPI) -> None:
    """Alice has READS_PER_KEY answers under way (a list and a download whose clients take nothing): one more of
    hers is a 429 with Retry-After at once; Bob's list and Alice's other requests are served; once hers are read,
    her slots are back."""
    async with client(app, ALICE) as alice, client(app, BOB) as bob:
        sid = (await alice.post("/sessions", json={})).json()["session_id"]
        view = (
            await alice.post("/execute", json={"script": "open('f', 'w').write('x' * 100)", "session_id": sid})
        ).json()
        assert view["status"] == "succeeded", view
        held = [SlowClient(app, "/jobs?limit=500", ALICE), SlowClient(app, f"/sessions/{sid}/files/f", ALICE)]
        for slow in held:
            await asyncio.wait_for(slow.first.wait(), 60)
        refused = await alice.get("/jobs?limit=500")
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == str(app.state.settings.retry_after_s)
        problem = refused.json()
        assert problem["type"].endswith("/quota-exceeded") and "PTC_MAX_READS_PER_KEY" in problem["detail"]
        assert (await alice.get(f"/sessions/{sid}/files/f")).status_code == 429
        counted = app.state.metrics.exposition().decode()
        assert 'ptc_rejections_total{reason="concurrent_reads"} 2.0' in counted  # its own label, not "other"
        assert (await bob.get("/jobs?limit=500")).status_code == 200
        assert (await alice.get(f"/jobs/{view['job_id']}")).status_code == 200  # a view is no list
        assert [slow.status for slow in held] == [200, 200]
        listed = orjson.loads(await held[0].body())
        assert [job["job_id"] for job in listed["jobs"]] == [view["job_id"]]
        assert await held[1].body() == b"x" * 100
        assert app.state.reads.held("alice") == 0
        assert (await alice.get("/jobs?limit=500")).status_code == 200


async def test_a_job_list_is_read_and_sent_in_batches(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    """With batches of 2, a page of 5 of 6 jobs comes in several pieces, with the same jobs and next_cursor as one
    read of the store gives, and the next page follows from that cursor."""
    async with client(app, ALICE) as alice:
        ids = []
        for n in range(6):
            ids.append((await alice.post("/execute", json={"script": f"print({n})"})).json()["job_id"])
        whole = (await alice.get("/jobs?limit=5")).json()
        monkeypatch.setattr(jobs_router, "LIST_BATCH", 2)
        slow = SlowClient(app, "/jobs?limit=5", ALICE)
        await asyncio.wait_for(slow.first.wait(), 60)
        batched = orjson.loads(await slow.body())
        assert len(slow.pieces) >= 4  # the head, three batches (2, 2, 1), the tail
        assert batched == whole
        assert [job["job_id"] for job in batched["jobs"]] == ids[::-1][:5]
        rest = (await alice.get("/jobs", params={"limit": 5, "cursor": batched["next_cursor"]})).json()
        assert [job["job_id"] for job in rest["jobs"]] == ids[:1] and rest["next_cursor"] is None


def test_a_slot_is_given_back_once_whatever_ends_the_answer() -> None:
    slots = ReadSlots(1, 2)
    release = slots.take("k")
    with pytest.raises(QuotaExceeded) as refused:
        slots.take("k")
    assert (refused.value.reason, refused.value.retry_after_s) == ("concurrent_reads", 2)
    slots.take("other")()
    release()
    release()  # idempotent: the finalizer and the end of the pieces may both call it
    assert slots.held("k") == 0
    slots.take("k")
    assert slots.held("k") == 1


async def test_an_answer_dropped_unsent_gives_its_slot_back() -> None:
    """A response whose pieces never start (the client left before the headers went out) runs no ``finally``:
    dropping the pieces gives the slot back and closes what they held."""
    slots, closed = ReadSlots(1, 2), []

    async def pieces() -> AsyncIterator[bytes]:
        yield b"never"

    held = holding(pieces(), slots.take("k"), lambda: closed.append(True))
    assert slots.held("k") == 1
    del held
    assert (slots.held("k"), closed) == (0, [True])
    sent = holding(pieces(), slots.take("k"))
    assert [piece async for piece in sent] == [b"never"] and slots.held("k") == 0


async def test_a_job_list_is_parsed_and_encoded_off_the_event_loop(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stored summaries of a page are parsed, and its batches encoded, on worker threads, never on the thread
    that runs the event loop (on main both ran on it, for up to 32 MiB a list)."""
    loop_thread = threading.get_ident()
    threads: dict[str, set[int]] = {"parsed": set(), "encoded": set()}
    parse, encode = JobSummary.model_validate_json, jobs_router._encoded

    def parsed(data: str | bytes, **options: Any) -> JobSummary:
        threads["parsed"].add(threading.get_ident())
        return parse(data, **options)

    def encoded(page: list[JobSummary]) -> bytes:
        threads["encoded"].add(threading.get_ident())
        return encode(page)

    async with client(app, ALICE) as alice:
        for n in range(3):
            assert (await alice.post("/execute", json={"script": f"print({n})"})).json()["status"] == "succeeded"
        monkeypatch.setattr(JobSummary, "model_validate_json", parsed)
        monkeypatch.setattr(jobs_router, "_encoded", encoded)
        listed = await alice.get("/jobs")
        assert listed.status_code == 200 and len(listed.json()["jobs"]) == 3
    assert threads["encoded"] and loop_thread not in threads["encoded"]
    assert threads["parsed"] and loop_thread not in threads["parsed"]
