"""The whole service on the fake backend with the PostgreSQL store (``PTC_STORE_URL``), no engine: a job's view,
listing and calls come back from the store after a restart; an ended job's output ranges, slices and output files
are served by a service on another work dir (another replica) from the store; a store that stops answering makes
``/readyz`` and the store's reads answer 503 problems (never a hang, never the URL's password). Issue 17, point 1."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa

from service.api import create_app
from service.sandbox.fake import FakeBackend
from service.settings import Settings
from service.tenancy import hash_token

TOOLS = [{"name": "t", "parameters": {"properties": {"x": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]


def scratch_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


work_dir = pytest.fixture(scratch_dir)
other_work_dir = pytest.fixture(scratch_dir)


ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdefgh"
KEYS = f"alice:{hash_token(ALICE)},bob:{hash_token(BOB)}"


def service(
    work_dir: Path, url: str, token: str | None = None
) -> Callable[[], AbstractAsyncContextManager[httpx.AsyncClient]]:
    """The service on ``work_dir`` and the store at ``url``; with ``token``, authentication is on (alice and bob)
    and the client sends that token."""

    @asynccontextmanager
    async def run() -> AsyncIterator[httpx.AsyncClient]:
        auth: dict[str, Any] = {"api_keys": KEYS} if token else {"auth": "disabled"}
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        settings = Settings(
            **auth,
            work_dir=work_dir,
            sandbox_folders_tmpfs_mb=0,
            warm_pool_size=0,
            instance_id="pg-" + work_dir.name,
            store_url=url,
            store_timeout_s=2,
            internal_secret="x" * 32,
        )
        app = create_app(settings, FakeBackend())
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://fake", timeout=60, headers=headers
            ) as client:
                yield client

    return run


def admin(url: str) -> psycopg.Connection:
    return psycopg.connect(
        sa.make_url(url).set(database="postgres").render_as_string(hide_password=False), autocommit=True
    )


async def test_a_job_is_served_from_postgresql_after_a_restart(work_dir: Path, postgres_url: str) -> None:
    run = service(work_dir, postgres_url)
    async with run() as client:
        assert (await client.get("/readyz")).status_code == 200
        view = (
            await client.post("/execute", json={"script": "import tools\nprint(tools.t(x=1))", "tools": TOOLS})
        ).json()
        assert view["status"] == "succeeded", view
    async with run() as client:
        again = (await client.get(f"/jobs/{view['job_id']}")).json()
        assert (again["status"], again["stdout"], len(again["calls"])) == ("succeeded", view["stdout"], 1)
        listed = (await client.get("/jobs")).json()
        assert [job["job_id"] for job in listed["jobs"]] == [view["job_id"]]


async def test_a_store_that_stops_answering_is_a_503_not_a_hang(
    work_dir: Path, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = sa.make_url(postgres_url).database
    password = sa.make_url(postgres_url).password
    assert password
    run = service(work_dir, postgres_url)
    async with run() as client:
        view = (await client.post("/execute", json={"script": "print(1)"})).json()
        with admin(postgres_url) as db:
            db.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
            db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        try:
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["type"].endswith("/not-ready")
            assert "job store" in ready.json()["detail"]
            answer = await client.get("/jobs")  # a listing reads the store (an ended job's view may be cached)
            assert answer.status_code == 503
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"].endswith("/store-unavailable")
            assert answer.headers["retry-after"] == "5"
            for text in (ready.text, answer.text, caplog.text):
                assert password not in text
        finally:
            with admin(postgres_url) as db:
                db.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        for _ in range(100):  # back once the store answers again and the listener has re-opened (RECONNECT_MAX_S)
            if (ready := await client.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert ready.status_code == 200, ready.text
        assert (await client.get("/jobs")).json()["jobs"][0]["job_id"] == view["job_id"]


OUTPUTS = """
import os, sys
os.makedirs("outputs", exist_ok=True)
with open("outputs/report.bin", "wb") as f:
    f.write(bytes(range(256)))
for i in range(2000):
    print("line", i)
print("to stderr", file=sys.stderr)
"""


async def test_another_replica_serves_an_ended_jobs_output_and_files_from_the_store(
    work_dir: Path, other_work_dir: Path, postgres_url: str
) -> None:
    async with service(work_dir, postgres_url)() as client:
        view = (await client.post("/execute", json={"script": OUTPUTS})).json()
        assert view["status"] == "succeeded", view
        job_id = view["job_id"]
        here = {
            "stdout": (await client.get(f"/jobs/{job_id}/output/stdout")).content,
            "range": (await client.get(f"/jobs/{job_id}/output/stdout", params={"offset": 100, "length": 50})).content,
            "stderr": (await client.get(f"/jobs/{job_id}/output/stderr")).content,
            "slice": (await client.get(f"/jobs/{job_id}", params={"stdout_offset": 9000})).json()["stdout"],
            "file": (await client.get(f"/jobs/{job_id}/files/outputs/report.bin")).content,
        }
    assert here["file"] == bytes(range(256)) and len(here["stdout"]) > 9000 and here["slice"]
    async with service(other_work_dir, postgres_url)() as other:  # no output/<job_id>/ on this one's disk
        assert not (other_work_dir / "output" / job_id).exists()
        there = {
            "stdout": (await other.get(f"/jobs/{job_id}/output/stdout")).content,
            "range": (await other.get(f"/jobs/{job_id}/output/stdout", params={"offset": 100, "length": 50})).content,
            "stderr": (await other.get(f"/jobs/{job_id}/output/stderr")).content,
            "slice": (await other.get(f"/jobs/{job_id}", params={"stdout_offset": 9000})).json()["stdout"],
            "file": (await other.get(f"/jobs/{job_id}/files/outputs/report.bin")).content,
        }
        assert there == here
        file = await other.get(f"/jobs/{job_id}/files/outputs/report.bin")
        assert file.headers["x-content-sha256"] == view["files"][0]["sha256"]
        assert (await other.get(f"/jobs/{job_id}/files/outputs/none.bin")).status_code == 404
        assert (await other.get(f"/jobs/{job_id}/output/stdout", params={"offset": 10**9})).content == b""


async def test_another_owners_job_output_is_not_found_on_another_replica(
    work_dir: Path, other_work_dir: Path, postgres_url: str
) -> None:
    async with service(work_dir, postgres_url, ALICE)() as alice:
        view = (await alice.post("/execute", json={"script": OUTPUTS})).json()
        assert view["status"] == "succeeded", view
    job_id = view["job_id"]
    async with service(other_work_dir, postgres_url, BOB)() as bob:
        for path in (f"/jobs/{job_id}/output/stdout", f"/jobs/{job_id}/files/outputs/report.bin", f"/jobs/{job_id}"):
            answer = await bob.get(path)
            assert answer.status_code == 404 and answer.json()["type"].endswith("/job-not-found"), path
    async with service(other_work_dir, postgres_url, ALICE)() as alice:
        assert (await alice.get(f"/jobs/{job_id}/files/outputs/report.bin")).content == bytes(range(256))


async def test_ids_no_row_can_hold_are_not_found_not_a_500(work_dir: Path, postgres_url: str) -> None:
    """A NUL in a job id (path), a cursor or a toolset id: PostgreSQL's text refuses it; the answer is the one for
    an unknown id (404, 422), as on SQLite, never a 500."""
    import base64

    async with service(work_dir, postgres_url, ALICE)() as client:
        for path in ("/jobs/job_%00x", "/jobs/job_%00x/output/stdout", "/jobs/job_%00x/files/a"):
            answer = await client.get(path)
            assert answer.status_code == 404, (path, answer.text)
        assert (await client.post("/jobs/job_%00x/stop")).status_code == 404
        cursor = base64.urlsafe_b64encode(b"2026-01-01T00:00:00+00:00|job_\x00").decode()
        answer = await client.get("/jobs", params={"cursor": cursor})
        assert answer.status_code == 422, answer.text
        answer = await client.post("/execute", json={"script": "print(1)", "toolset": "ts_\x00"})
        assert answer.status_code == 422, answer.text


async def test_a_final_view_the_store_refuses_is_served_and_saved_once_it_answers(
    work_dir: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails (a blip, a full pool) just when a job ends: the finished result is not lost. This replica
    serves the final view meanwhile, and saves it again until the store takes it (then any replica serves it)."""

    from service.errors import StoreUnavailable
    from service.store import StoredJob
    from service.store.pg import PostgresJobStore
    from service.store.pg_jobs import PostgresJobRecords

    save = PostgresJobRecords.save
    refused: list[str] = []

    async def flaky_save(self: PostgresJobRecords, job: StoredJob, incarnation: Any) -> bool:
        if job.ended_at is not None and len(refused) < 2:
            refused.append(job.job_id)
            raise StoreUnavailable("save")
        return await save(self, job, incarnation)

    monkeypatch.setattr(PostgresJobRecords, "save", flaky_save)  # the runner's saves are fenced: Replicas.save
    run = service(work_dir, postgres_url)
    async with run() as client:
        view = (await client.post("/execute", json={"script": "print(1)"})).json()
        assert view["status"] == "succeeded", view
        assert refused == [view["job_id"]]
        again = (await client.get(f"/jobs/{view['job_id']}")).json()
        assert again["status"] == "succeeded", again  # not the last status the store took ("running")
        store = PostgresJobStore(postgres_url)
        await store.open()
        try:
            for _ in range(600):  # saved again once the store answers (every few seconds at first)
                stored = await store.jobs.get(view["job_id"])
                if stored is not None and stored.ended_at is not None:
                    break
                await asyncio.sleep(0.1)
            assert stored is not None and stored.status == "succeeded"
        finally:
            await store.close()
    async with run() as client:  # another process: only the store has it
        assert (await client.get(f"/jobs/{view['job_id']}")).json()["status"] == "succeeded"


BIG = """
import os, sys
os.makedirs("outputs", exist_ok=True)
with open("outputs/big.bin", "wb") as f:
    f.write(os.urandom(3 * 1024 * 1024))
sys.stdout.write("y" * (3 * 1024 * 1024))
"""


async def test_another_replica_reads_stored_output_a_slice_at_a_time(
    work_dir: Path, other_work_dir: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ended job's output and files served from the store are read a slice at a time as the client takes
    them, as from disk: a request (or a client that stops reading) never holds a whole 16 MiB range or 32 MiB file
    in memory."""
    import hashlib

    from service.api.responses import OUTPUT_SLICE_BYTES
    from service.store.pg_blobs import PostgresJobBlobs

    async with service(work_dir, postgres_url)() as client:
        view = (await client.post("/execute", json={"script": BIG})).json()
        assert view["status"] == "succeeded", view
    job_id = view["job_id"]
    read_blob = PostgresJobBlobs.read
    asked: list[int | None] = []

    async def recording(
        self: PostgresJobBlobs, job_id: str, name: str, offset: int = 0, length: int | None = None
    ) -> bytes | None:
        asked.append(length)
        return await read_blob(self, job_id, name, offset, length)

    monkeypatch.setattr(PostgresJobBlobs, "read", recording)
    async with service(other_work_dir, postgres_url)() as other:
        answer = await other.get(f"/jobs/{job_id}/output/stdout", params={"length": 16 * 1024 * 1024})
        assert answer.status_code == 200 and answer.content == b"y" * (3 * 1024 * 1024)
        answer = await other.get(f"/jobs/{job_id}/output/stdout", params={"offset": 3 * 1024 * 1024 - 5})
        assert answer.content == b"yyyyy" and answer.headers["content-length"] == "5"
        assert (await other.get(f"/jobs/{job_id}/output/stderr")).content == b""
        entry = view["files"][0]
        answer = await other.get(f"/jobs/{job_id}/files/{entry['path']}")
        assert answer.status_code == 200
        assert hashlib.sha256(answer.content).hexdigest() == entry["sha256"] == answer.headers["x-content-sha256"]
        assert answer.headers["content-length"] == str(3 * 1024 * 1024)
    assert asked and all(length is not None and length <= OUTPUT_SLICE_BYTES for length in asked), asked


async def test_saving_a_refused_final_view_again_never_undoes_a_later_save(
    work_dir: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """While a refused final view waits to be saved again, a later save of the ended job (its callback's delivery,
    which updates the view) reaches the store first: the retry must not overwrite it with the older view."""
    import logging

    from service.errors import StoreUnavailable
    from service.store import StoredJob
    from service.store.pg import PostgresJobStore
    from service.store.pg_jobs import PostgresJobRecords

    save = PostgresJobRecords.save
    refused: list[str] = []

    async def flaky_save(self: PostgresJobRecords, job: StoredJob, incarnation: Any) -> bool:
        if job.ended_at is not None and not refused:
            refused.append(job.job_id)
            raise StoreUnavailable("save")
        return await save(self, job, incarnation)

    monkeypatch.setattr(PostgresJobRecords, "save", flaky_save)  # the runner's saves are fenced: Replicas.save
    caplog.set_level(logging.INFO, logger="service.jobs.tasks")
    async with service(work_dir, postgres_url)() as client:
        view = (await client.post("/execute", json={"script": "print(1)"})).json()
        assert refused == [view["job_id"]]
        store = PostgresJobStore(postgres_url)
        await store.open()
        try:
            first = await store.jobs.get(view["job_id"])
            assert first is not None and first.ended_at is None
            later = StoredJob(
                first.job_id, "succeeded", first.instance_id, first.created_at, first.created_at,
                b'{"later": true}', first.summary, False, first.owner,
            )  # fmt: skip
            await store.jobs.put(later)  # e.g. the callback's delivery saved the view (delivered) meanwhile
            for _ in range(600):
                if "saving its final view: done" in caplog.text:
                    break
                await asyncio.sleep(0.1)
            assert "saving its final view: done" in caplog.text
            stored = await store.jobs.get(view["job_id"])
            assert stored is not None and stored.view == b'{"later": true}'
        finally:
            await store.close()


async def test_each_replica_purges_its_own_ended_jobs(work_dir: Path, other_work_dir: Path, postgres_url: str) -> None:
    """Two instances on one store: the retention purge of one must not take the other's jobs, whose output folder
    (and the owner's output quota it counts against) only that other instance can free: it would never hear of
    them again, and keep both for ever."""
    from datetime import UTC, datetime, timedelta

    def settings(folder: Path) -> Settings:
        return Settings(
            auth="disabled",
            work_dir=folder,
            sandbox_folders_tmpfs_mb=0,
            warm_pool_size=0,
            instance_id="pg-" + folder.name,
            store_url=postgres_url,
            store_timeout_s=2,
            internal_secret="x" * 32,
            job_retention_s=60,
        )

    first, second = create_app(settings(work_dir), FakeBackend()), create_app(settings(other_work_dir), FakeBackend())
    async with first.router.lifespan_context(first), second.router.lifespan_context(second):
        transport = httpx.ASGITransport(app=first, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as client:
            view = (await client.post("/execute", json={"script": "print(1)"})).json()
        assert view["status"] == "succeeded", view
        folder = work_dir / "output" / view["job_id"]
        assert folder.is_dir()
        store = first.state.store
        stored = await store.jobs.get(view["job_id"])
        assert stored is not None and stored.ended_at is not None
        old = datetime.now(UTC) - timedelta(hours=1)  # ended long ago: past the retention
        await store.jobs.put(type(stored)(**{**stored.__dict__, "ended_at": old, "created_at": old}))
        assert await second.state.jobs.recovery.purge_expired() == 0  # not its job
        assert await store.jobs.get(view["job_id"]) is not None
        assert await first.state.jobs.recovery.purge_expired() == 1  # its own: the row, and its folder
        assert await store.jobs.get(view["job_id"]) is None
        assert not folder.exists()
