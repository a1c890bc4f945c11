"""Background tasks are held and their failures logged at once (before: a failed save spawned in the background
ended as "Task exception was never retrieved", seen only when the task was collected)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from service.jobs.tasks import Tasks


async def test_a_failed_task_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    tasks = Tasks()

    async def save() -> None:
        raise OSError("the store is down")

    with caplog.at_level(logging.ERROR):
        task = tasks.spawn(save(), "save job_1")
        await asyncio.wait({task})
        await asyncio.sleep(0)
    assert "background task 'save job_1' failed" in caplog.text and "the store is down" in caplog.text
    assert len(tasks) == 0  # held until it ended, then let go


async def test_close_cancels_and_awaits_what_is_left() -> None:
    tasks = Tasks()
    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    tasks.spawn(forever(), "forever")
    await asyncio.sleep(0)
    await tasks.close()
    assert ended.is_set() and len(tasks) == 0
