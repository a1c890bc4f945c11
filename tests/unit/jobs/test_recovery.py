"""Recovery at start-up without an engine: the work dir is locked once (a second instance is refused), a job
folder left behind that cannot be removed is logged (before: ``rmtree(..., ignore_errors=True)`` said nothing),
and a job marked lost keeps its call records in arrival order (before: its pending calls were moved last, so
the seq of a record no longer told its place, which a resumed event stream counts on)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from service.errors import WorkDirBusy
from service.jobs.durability import RunSpec
from service.jobs.events import Events
from service.jobs.live import LiveJobs, stored_job
from service.jobs.marks import OWNER_FILE, RECORDS_FILE
from service.jobs.model import JobStatus
from service.jobs.recovery import Recovery
from service.jobs.state import JobState
from service.jobs.tasks import Tasks
from service.quotas import HostCapacity, Quotas
from service.sandbox.folders import SandboxFolders
from service.schemas.job_models import ExecuteRequest
from service.settings import Settings
from service.store import StoredJob
from service.views import render
from service.views.render import render_head
from tests.unit.jobs.conftest import Parts


class Engines:
    async def sweep(self) -> int:
        return 0


class Store:
    """The job records recovery uses (``store.jobs``), in memory."""

    def __init__(self, unfinished: list[StoredJob] | None = None) -> None:
        self.left = unfinished or []
        self.puts: list[StoredJob] = []
        self.expired: list[str] = []  # what the next purge returns

    @property
    def jobs(self) -> Store:
        return self

    @property
    def runs(self) -> Store:  # no run specs: no job is resumed
        return self

    async def spec(self, job_id: str) -> bytes | None:
        return None

    async def forget(self, job_id: str) -> None:
        pass

    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        return self.left

    async def put(self, job: StoredJob) -> None:
        self.puts.append(job)

    async def save_lost(self, job: StoredJob) -> bool:
        self.puts.append(job)
        return True

    async def purge(self, cutoff: datetime, instance_id: str) -> list[str]:
        purged, self.expired = self.expired, []
        return purged


def recovery(work_dir: Path, store: Store | None = None, quotas: Quotas | None = None, **more: Any) -> Recovery:
    settings = Settings(work_dir=work_dir, sandbox_folders_tmpfs_mb=0, instance_id="test", **more)
    return Recovery(
        settings,
        cast(Any, Engines()),
        cast(Any, store or Store()),
        SandboxFolders(work_dir / "run", 0),
        quotas or Quotas(settings, HostCapacity(1024, 1)),
        JobState(LiveJobs(), Events(), Tasks(), render.ViewCache(1 << 20)),
    )


async def test_a_job_folder_that_cannot_be_removed_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    left = tmp_path / "run" / "jobs" / "job_old"
    left.mkdir(parents=True)
    (left / "script.py").write_text("print(1)")
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith("script.py"):
            raise PermissionError(1, "Operation not permitted", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    started = recovery(tmp_path)
    with caplog.at_level(logging.WARNING):
        await started.start()
    started.release()
    assert "could not remove" in caplog.text and "Operation not permitted" in caplog.text


async def test_the_bytes_call_records_keep_count_against_their_owner_until_purged(tmp_path: Path) -> None:
    quotas = Quotas(Settings(work_dir=tmp_path), HostCapacity(1024, 1))
    folder = tmp_path / "output" / "job_old"
    folder.mkdir(parents=True)
    (folder / OWNER_FILE).write_text("alice")
    (folder / "stdout").write_bytes(b"x" * 100)
    (folder / RECORDS_FILE).write_text("5000")  # a folder written before the marks: the runner wrote this file
    store = Store()
    started = recovery(tmp_path, store, quotas)
    await started.start()  # counted again at start-up, with its retained output
    assert quotas.output("alice").used == 5100
    store.expired = ["job_old"]
    assert await started.purge_expired() == 1
    started.release()
    assert quotas.output("alice").used == 0 and not folder.exists()  # given back with the job


async def test_the_work_dir_is_locked_once(tmp_path: Path) -> None:
    first = recovery(tmp_path)
    await first.start()
    with pytest.raises(WorkDirBusy):
        await recovery(tmp_path).start()
    first.release()
    second = recovery(tmp_path)
    await second.start()  # given back: the next instance takes it
    second.release()


async def test_a_job_marked_lost_keeps_its_calls_in_arrival_order(tmp_path: Path, parts: Parts) -> None:
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    started = datetime.now(UTC)
    job.calls = [
        {"seq": seq, "call_id": f"call_{seq}", "tool": "t", "args": None, "status": status, "started_at": started}
        for seq, status in ((1, "ok"), (2, "pending"), (3, "ok"))
    ]
    view = job.view_dict()
    job.stdout.close()
    job.stderr.close()
    encoded = await render.encode(render_head(view), render.snapshot(view["calls"]))
    store = Store([stored_job(encoded.head, 3, encoded.body, "test")])
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    started_recovery = recovery(work_dir, store)
    await started_recovery.start()
    started_recovery.release()
    lost = orjson.loads(store.puts[-1].view)
    assert lost["status"] == "lost"
    assert [(call["seq"], call["status"]) for call in lost["calls"]] == [(1, "ok"), (2, "error"), (3, "ok")]


class FailingLog(Store):
    """The store's call log read fails (a connection reset, a failover)."""

    async def calls(self, job_id: str) -> list[Any]:
        raise ConnectionResetError("connection reset by peer")


async def test_a_store_failure_reading_the_call_log_leaves_a_job_to_resume_unfinished(
    tmp_path: Path, parts: Parts
) -> None:
    """A parked job's answer, or a start-up resume, that cannot read the job's call log raises what the store raised
    (the answer is refused, the job stays parked): before the fix it was marked lost, its answer with it."""
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    view = job.view_dict()
    job.stdout.close()
    job.stderr.close()
    encoded = await render.encode(render_head(view), render.snapshot(view["calls"]))
    stored = stored_job(encoded.head, 0, encoded.body, "test")
    spec = RunSpec(job.id, "alice", False, "docker", "default", job.created_at, 1, ExecuteRequest(script="1"))
    store = FailingLog()
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    with pytest.raises(ConnectionResetError):
        resumer = recovery(work_dir, store, auth="disabled")  # any owner's jobs resume
        await resumer.resume_job(replace(spec, stored=stored), "answered", cast(Any, None), print)
    assert store.puts == []  # not marked lost
