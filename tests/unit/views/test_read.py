"""Job views without an engine: a late follower of the events stream of a job whose final save failed (the store
still holds its ``running`` view) gets that view as ``end`` (before the fix: an ``assert`` failed)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson

from service.jobs.live import stored_job
from service.jobs.model import JobStatus
from service.tenancy import Caller
from service.views import render
from service.views.read import JobViews
from service.views.render import render_head
from tests.unit.jobs.conftest import Parts


async def test_late_follower_of_a_job_whose_final_save_failed(parts: Parts) -> None:
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    encoded = await render.encode(render_head(job.view_dict()), [])
    await parts.store.jobs.put(stored_job(encoded.head, 0, encoded.body, "test"))  # its last successful save
    parts.live.remove(job.id)  # it ended (its cleanup closed its output files); its final save failed
    job.stdout.close()
    job.stderr.close()
    job_views = JobViews(cast(Any, parts.store), parts.live, job.output_dir.parent, render.ViewCache(1 << 20))

    async def follow() -> list[tuple[str, Any]]:
        return [(event, data) async for event, data, _ in job_views.events(job.id, Caller("alice"))]

    followed = await asyncio.wait_for(follow(), 5)
    assert [event for event, _ in followed] == ["status", "end"]
    assert followed[0][1] == {"status": "running"}
    assert orjson.loads(followed[-1][1])["job_id"] == job.id


async def test_summaries_are_made_once_beside_the_encoded_view(parts: Parts) -> None:
    """``calls=summary`` of an ended view never decodes its records per request: ``encode`` makes the summaries
    from the records it encodes, ``scan`` from those it decodes anyway, a re-encode (a callback's save) is
    handed them, and a view without them gets them once."""
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    job.stdout.close()
    job.stderr.close()
    job.calls = [
        {
            "seq": seq,
            "call_id": f"call_{seq}",
            "tool": "t",
            "args": orjson.Fragment(b'{"secret":"ARGS"}'),
            "status": "ok",
            "result": orjson.Fragment(b'"RESULT"'),
            "error": None,
            "started_at": job.created_at,
            "duration_ms": 1.5,
        }
        for seq in (1, 2)
    ]
    head = render_head(job.view_dict())
    first = await render.encode(head, render.snapshot(job.calls))
    assert first.summaries == [render.summary_record(record) for record in job.calls]
    assert all(b"ARGS" not in s and b"RESULT" not in s for s in first.summaries)
    assert first.head_bytes() == head and first.head_end == render.head_end(first.body, first.spans)
    scanned: list[bytes] = []
    render.scan(first.body, scanned)
    assert scanned == first.summaries
    kept = await render.encode(head, list(first.records()), first.summaries)
    assert kept.body == first.body and kept.summaries == first.summaries
    bare = await render.encode(head, list(first.records()))
    assert bare.summaries is None
    job_views = JobViews(cast(Any, parts.store), parts.live, job.output_dir.parent, render.ViewCache(1 << 20))
    assert await job_views.summaries(bare) == first.summaries
    assert bare.summaries == first.summaries  # kept beside it from now on
