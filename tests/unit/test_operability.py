"""Operability of replicas (docs/scaling.md, Operability; issue 17, point 5): ``/readyz`` names the part that is
not ready (``reason``) and adds the store's kind and the live replicas; every log line carries ``instance``, and
the ``replica`` events; the sweep of a retired replica's sandboxes is refused while the registry shows it live."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from service.api import create_app
from service.api.routers.health import READY_PARTS
from service.errors import InstanceIdInUse, StoreUnavailable
from service.observability import logs
from service.replicas.notify import Listener, Waiters
from service.replicas.sweep import sweep_instance
from service.sandbox.fake import FakeBackend
from service.sandbox.labels import instance_labels
from service.settings import Settings
from service.store import Incarnation, JobStore, Registration
from tests.conftest import ROOT
from tests.unit.test_logs import Capture
from tests.unit.test_replicas import replica

Client = tuple[FastAPI, httpx.AsyncClient]


@pytest.fixture
def short() -> Iterator[Path]:
    """A scratch folder with a short path (the sandboxes' unix sockets live under the work dirs)."""
    path = Path(tempfile.mkdtemp(prefix="ptco", dir="/tmp"))
    (path / "w1").mkdir()
    (path / "w2").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@asynccontextmanager
async def single(work_dir: Path, backend: FakeBackend | None = None) -> AsyncIterator[Client]:
    """One service on SQLite (the embedded store), FakeBackend, no authentication."""
    settings = Settings(auth="disabled", work_dir=work_dir, sandbox_folders_tmpfs_mb=0, warm_pool_size=0)
    app = create_app(settings, backend or FakeBackend())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            yield app, client


async def not_ready(client: httpx.AsyncClient) -> dict[str, Any]:
    answer = await client.get("/readyz")
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = answer.json()
    assert body["reason"] in READY_PARTS
    return body


async def test_readyz_adds_the_store_kind_and_the_live_replicas(short: Path) -> None:
    async with single(short / "w") as (_, client):
        answer = await client.get("/readyz")
        assert answer.status_code == 200
        assert {k: answer.json()[k] for k in ("status", "store", "replicas")} == {
            "status": "ready",
            "store": "sqlite",
            "replicas": 1,
        }


async def test_readyz_names_the_lease_when_fenced(short: Path) -> None:
    async with single(short / "w") as (app, client):
        app.state.replicas.fence("a test")
        body = await not_ready(client)
        assert body["reason"] == "lease" and "lost its lease" in body["detail"]


async def test_readyz_names_draining(short: Path) -> None:
    async with single(short / "w") as (app, client):
        app.state.replicas.draining = True
        assert (await not_ready(client))["reason"] == "draining"
        app.state.replicas.draining = False
        assert (await client.get("/readyz")).status_code == 200


async def test_readyz_names_the_store_when_it_does_not_answer(short: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with single(short / "w") as (app, client):

        async def silent() -> None:
            raise StoreUnavailable("ping")

        monkeypatch.setattr(app.state.store, "ping", silent)
        body = await not_ready(client)
        assert body["reason"] == "store" and "did not answer (ping)" in body["detail"]


async def test_readyz_names_the_listener_while_it_is_not_listening(short: Path) -> None:
    async with single(short / "w") as (app, client):
        # Never started: as a listener whose connection was lost and is being re-opened. Nothing is dialled.
        app.state.listener = Listener("postgresql://ptc:secret@127.0.0.1:1/ptc", Waiters())
        body = await not_ready(client)
        assert body["reason"] == "listener" and "secret" not in json.dumps(body)
        app.state.listener.listening.set()
        assert (await client.get("/readyz")).status_code == 200


async def test_readyz_names_the_engine_and_the_images(short: Path) -> None:
    async with single(short / "w", FakeBackend(images={})) as (_, client):
        assert (await not_ready(client))["reason"] == "engine"  # the default image is missing
    settings = Settings(
        auth="disabled",
        work_dir=short / "w2",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        images="default=ptc-sandbox-runtime:latest,data=ptc-sandbox-data:missing",
    )
    backend = FakeBackend(images={settings.sandbox_image: {"io.ptc-sandbox.runtime": "session,privsep,files"}})
    app = create_app(settings, backend)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            body = await not_ready(client)
            assert body["reason"] == "images" and body["missing_images"] == ["data"]


async def test_readyz_on_postgresql_counts_the_live_replicas(postgres_url: str, short: Path) -> None:
    # Leases of 5 s: both services share this test's event loop, and the second's start (its migrations checked,
    # its sweep) can hold it past a 1 s lease's last heartbeat, which /readyz rightly reports as "lease".
    async with (
        replica(short / "w1", postgres_url, "t1", heartbeat_s=1.0) as (app1, alice1, _a),
        replica(short / "w2", postgres_url, "t2", heartbeat_s=1.0) as (_, _alice2, _b),
    ):
        await app1.state.replicas.refresh()
        answer = await alice1.get("/readyz")
        assert answer.status_code == 200, answer.text
        assert (answer.json()["store"], answer.json()["replicas"]) == ("postgresql", 2)


# -- logs -----------------------------------------------------------------------------------------------------


@pytest.fixture
def captured() -> Iterator[Capture]:
    capture = Capture()
    logs.EVENTS.addHandler(capture)
    level = logs.EVENTS.level
    logs.EVENTS.setLevel(logging.INFO)
    yield capture
    logs.EVENTS.removeHandler(capture)
    logs.EVENTS.setLevel(level)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_every_line_carries_the_instance_id(fmt: str) -> None:
    code = (
        "import logging\nfrom service.observability import logs\n"
        f"logs.configure('info', {fmt!r}, 'r-7')\n"
        "logs.event('job', job_id='job_1', status='queued')\n"
        "logging.getLogger('uvicorn.error').info('started')\n"
        "logging.getLogger('service.jobs').warning('a plain line')\n"
        "logs.replica('registered', 'r-7', 3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    lines = done.stderr.splitlines()
    assert len(lines) == 4, done.stderr
    if fmt == "json":
        parsed = [json.loads(line) for line in lines]
        assert [line["instance"] for line in parsed] == ["r-7"] * 4
        assert {k: parsed[3][k] for k in ("event", "action", "replica", "epoch")} == {
            "event": "replica",
            "action": "registered",
            "replica": "r-7",
            "epoch": 3,
        }
    else:
        assert all(' instance="r-7": ' in line for line in lines), lines


def test_without_an_instance_lines_have_no_instance_field() -> None:
    code = "from service.observability import logs\nlogs.configure('info', 'json')\nlogs.event('job', job_id='j')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "instance" not in json.loads(done.stderr.splitlines()[0])


def test_replica_expired_event(captured: Capture) -> None:
    logs.replica_expired("r2", 4, detected_after_s=3.21234, jobs_lost=3, sessions_broken=1)
    (line,) = captured.lines
    assert line["level"] == "warning"
    assert {k: line[k] for k in ("event", "action", "replica", "epoch", "detected_after_s")} == {
        "event": "replica",
        "action": "expired",
        "replica": "r2",
        "epoch": 4,
        "detected_after_s": 3.212,
    }
    assert (line["jobs_lost"], line["sessions_broken"]) == (3, 1)


async def test_a_replica_logs_registered_and_left(short: Path, captured: Capture) -> None:
    async with single(short / "w") as (app, _):
        instance = app.state.replicas.incarnation.instance_id
    events = [line for line in captured.lines if line["event"] == "replica"]
    actions = [(line["action"], line["replica"], line["epoch"]) for line in events]
    assert actions == [("registered", instance, 1), ("left", instance, 1)]


async def test_a_fenced_replica_logs_lease_lost(short: Path, captured: Capture) -> None:
    async with single(short / "w") as (app, _):
        app.state.replicas.fence("a test")
    lost = [line for line in captured.lines if line["event"] == "replica" and line["action"] == "lease_lost"]
    assert len(lost) == 1 and lost[0]["level"] == "error" and lost[0]["reason"] == "a test"
    assert not [line for line in captured.lines if line["event"] == "replica" and line["action"] == "left"]


# -- sweep ----------------------------------------------------------------------------------------------------


class Sweeper(FakeBackend):
    """Records the labels each removal asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.removals: list[dict[str, str]] = []

    async def remove_labelled(self, labels: Mapping[str, str]) -> int:
        self.removals.append(dict(labels))
        return 2


def registration(instance: str, lease_s: float = 30.0) -> Registration:
    return Registration(instance, "http://127.0.0.1:8081", "a" * 64, "0.test", lease_s)


async def test_sweep_is_refused_while_the_instance_is_live(store: JobStore) -> None:
    backend = Sweeper()
    await store.replicas.register(registration("r1"))
    with pytest.raises(InstanceIdInUse, match="live in the registry"):
        await sweep_instance(store, backend, "r1")
    with pytest.raises(InstanceIdInUse, match="live in the registry"):
        await sweep_instance(store, backend, "r1", unregistered=True)  # the flag is for unknown ids only
    assert backend.removals == []


async def test_sweep_of_an_unknown_instance_needs_unregistered(store: JobStore) -> None:
    backend = Sweeper()
    with pytest.raises(InstanceIdInUse, match="not in this store's registry"):
        await sweep_instance(store, backend, "gone")
    assert backend.removals == []
    assert await sweep_instance(store, backend, "gone", unregistered=True) == 2
    assert backend.removals == [instance_labels("gone")]


async def test_sweep_removes_a_left_instance_s_sandboxes(store: JobStore) -> None:
    backend = Sweeper()
    epoch = await store.replicas.register(registration("r1"))
    assert await store.replicas.set_state(Incarnation("r1", epoch), "left")
    await store.replicas.register(registration("r2"))  # another, live (SQLite: once r1 left)
    assert await sweep_instance(store, backend, "r1") == 2
    assert backend.removals == [instance_labels("r1")]  # r2's labels never asked for


async def test_sweep_removes_an_instance_whose_lease_passed(store: JobStore) -> None:
    backend = Sweeper()
    await store.replicas.register(registration("r1", lease_s=0.05))  # killed: never renewed, never left
    await asyncio.sleep(0.3)
    assert await sweep_instance(store, backend, "r1") == 2
    assert backend.removals == [instance_labels("r1")]


async def test_a_lost_listener_is_counted_and_not_ready_until_it_reconnects(postgres_url: str, short: Path) -> None:
    import psycopg
    import sqlalchemy as sa

    async with replica(short / "w1", postgres_url, "t1") as (app, alice, _):
        listener = app.state.listener
        assert listener.listening.is_set() and (await alice.get("/readyz")).status_code == 200
        conninfo = sa.make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False)
        async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as admin:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid != pg_backend_pid()"
            )
        for _ in range(200):
            if listener.reconnects:
                break
            await asyncio.sleep(0.05)
        assert listener.reconnects == 1
        assert (await alice.get("/readyz")).status_code == 200  # listening again
        assert b"ptc_store_listener_reconnects_total 1.0" in app.state.metrics.exposition()
