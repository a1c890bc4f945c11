"""Job views without an engine: a late follower of the events stream of a job whose final save failed (the store
still holds its ``running`` view) gets that view as ``end`` (before the fix: an ``assert`` failed)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson

from service.jobs.live import now, stored_job
from service.jobs.model import JobStatus
from service.store import JobQuery
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


async def test_a_read_does_not_show_the_end_before_the_final_view_is_saved(parts: Parts) -> None:
    """The runner sets a job's final status (``Runner._finish``), saves its final view, then sets ``done`` and drops
    it from the live jobs (``Runner._cleanup``). A read in between served the live view, already ``succeeded``, while
    the store still held ``running``: ``GET /jobs/{id}`` told the end before it was saved, and ``GET /jobs?status=
    succeeded`` did not list the job it said had ended (a flaky test under load). The read now waits for the save."""
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    running = await render.encode(render_head(job.view_dict()), [])
    await parts.store.put(stored_job(running.head, 0, running.body, "test"))  # its last status save
    cache = render.ViewCache(1 << 20)
    job_views = JobViews(cast(Any, parts.store), parts.live, job.output_dir.parent, cache)
    job.stdout.close()
    job.stderr.close()
    job.ended_at = now()
    job.end(JobStatus.SUCCEEDED, None)  # its final save is under way
    reading = asyncio.ensure_future(job_views.view(job.id, Caller("alice")))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not reading.done(), "the live view (succeeded) was served before the final view was saved"
    assert parts.store.rows[job.id].status == "running"
    final = await render.encode(render_head(job.view_dict()), [])  # the final save, then the end told
    cache.put(job.id, final)
    await parts.store.put(stored_job(final.head, 0, final.body, "test"))
    job.done.set()
    parts.live.remove(job.id)
    body = await asyncio.wait_for(reading, 5)
    assert isinstance(body, bytes) and orjson.loads(body)["status"] == "succeeded"
    assert parts.store.rows[job.id].status == "succeeded"


async def test_a_listing_does_not_show_the_end_before_the_final_view_is_saved(parts: Parts) -> None:
    """As above for ``GET /jobs``: a live job's summary comes from its live view, except once its final status is
    set, when the page waits for the final save and lists the saved summary."""
    job = parts.new_job("alice")
    job.move(JobStatus.RUNNING)
    running = await render.encode(render_head(job.view_dict()), [])
    await parts.store.put(stored_job(running.head, 0, running.body, "test"))
    cache = render.ViewCache(1 << 20)
    job_views = JobViews(cast(Any, parts.store), parts.live, job.output_dir.parent, cache)
    [summary], _ = await job_views.page(JobQuery(owner="alice"))
    assert summary.status == "running"  # live, not ending: its live view
    job.stdout.close()
    job.stderr.close()
    job.ended_at = now()
    job.end(JobStatus.SUCCEEDED, None)
    listing = asyncio.ensure_future(job_views.page(JobQuery(owner="alice")))
    done, _ = await asyncio.wait({listing}, timeout=0.5)  # its summaries are parsed in a thread: give it time
    assert not done, "the live summary (succeeded) was listed before the final view was saved"
    final = await render.encode(render_head(job.view_dict()), [])
    cache.put(job.id, final)
    await parts.store.put(stored_job(final.head, 0, final.body, "test"))
    job.done.set()
    parts.live.remove(job.id)
    listed, _ = await asyncio.wait_for(listing, 5)
    assert [summary.status for summary in listed] == ["succeeded"]
