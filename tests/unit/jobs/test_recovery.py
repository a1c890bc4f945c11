"""Recovery at start-up without an engine: the work dir is locked once (a second instance is refused), and a job
folder left behind that cannot be removed is logged (before: ``rmtree(..., ignore_errors=True)`` said nothing)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

import pytest

from service import views
from service.errors import WorkDirBusy
from service.jobs.events import Events
from service.jobs.recovery import Recovery
from service.quotas import HostCapacity, Quotas
from service.sandbox.folders import SandboxFolders
from service.settings import Settings
from service.store import StoredJob


class Backend:
    async def remove_labelled(self, labels: dict[str, str]) -> int:
        return 0


class Store:
    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        return []


def recovery(work_dir: Path) -> Recovery:
    settings = Settings(work_dir=work_dir, sandbox_folders_tmpfs_mb=0)
    return Recovery(
        settings,
        cast(Any, Backend()),
        cast(Any, Store()),
        SandboxFolders(work_dir / "run", 0),
        Quotas(settings, HostCapacity(1024, 1)),
        Events(),
        views.ViewCache(1 << 20),
        {},
        "test",
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


async def test_the_work_dir_is_locked_once(tmp_path: Path) -> None:
    first = recovery(tmp_path)
    await first.start()
    with pytest.raises(WorkDirBusy):
        await recovery(tmp_path).start()
    first.release()
    second = recovery(tmp_path)
    await second.start()  # given back: the next instance takes it
    second.release()
