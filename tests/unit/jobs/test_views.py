"""Job views without an engine: a late follower of the events stream of a job whose final save failed (the store
still holds its ``running`` view) gets that view as ``end`` (before the fix: an ``assert`` failed)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson

from service import views
from service.auth import Caller
from service.jobs.live import stored_job
from service.jobs.model import JobStatus
from service.jobs.views import JobViews
from service.views import render_head
from tests.unit.jobs.conftest import Parts


async def test_late_follower_of_a_job_whose_final_save_failed(parts: Parts) -> None:
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    encoded = await views.encode(render_head(job.view_dict()), [])
    await parts.store.put(stored_job(encoded.head, 0, encoded.body, "test"))  # its last successful save
    parts.live.pop(job.id)  # it ended (its cleanup closed its output files); its final save failed
    job.stdout.close()
    job.stderr.close()
    job_views = JobViews(
        cast(Any, parts.store), parts.live, job.output_dir.parent, views.ViewCache(1 << 20), views.ByteBudget(1 << 20)
    )

    async def follow() -> list[tuple[str, Any]]:
        return [(event, data) async for event, data, _ in job_views.events(job.id, Caller("alice"))]

    followed = await asyncio.wait_for(follow(), 5)
    assert [event for event, _ in followed] == ["status", "end"]
    assert followed[0][1] == {"status": "running"}
    assert orjson.loads(followed[-1][1])["job_id"] == job.id
