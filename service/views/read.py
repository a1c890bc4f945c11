"""Reading jobs: views, slices, output ranges, pages and the events stream.

A live job is served from memory (``LiveJob.view_dict``); once saved as ended, from the store: its encoded view
(``service.views.render.EncodedView``) is kept in a byte-bounded cache, or read back (once for concurrent readers, one
view indexed at a time, off the event loop). Every job a caller names goes through ``live`` or ``final``:
another owner's job answers exactly like one that does not exist (its existence is not revealed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from service import files
from service.errors import InvalidField, JobNotFound, NoSuchFile
from service.jobs import shared
from service.jobs.live import SLICE_BYTES, STREAMS, LiveJob, LiveJobs, unless_ending, wait_for_end_or_client
from service.jobs.model import FINAL
from service.output import OutputRange, decode_slice, read_range
from service.replicas.notify import Elsewhere
from service.sandbox.backend import Stream
from service.schemas.job_models import JobSummary
from service.store import JobQuery, JobStore
from service.tenancy import Caller
from service.views import render, resume
from service.views.render import FULL, Body, EncodedView, Selection, render_head, snapshot, summary_record

log = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
PARKED_POLL_S = 1.0  # how often a follower of a parked job looks whether it was resumed (s)
"""Seconds without an event after which a follower of a live job gets a ``ping`` (a comment in the stream)."""


class JobViews:
    """Views of live and ended jobs.

    Args:
        store: the job store.
        live: the live jobs (job id -> job).
        output_dir: ``work_dir/output``, one folder of retained output per job.
        cache: ended jobs' encoded views, kept for reading.
        elsewhere: jobs of other replicas (``notify.Elsewhere``): 503 while running, ``wait`` on notifications.
    """

    def __init__(
        self,
        store: JobStore,
        live: LiveJobs,
        output_dir: Path,
        cache: render.ViewCache,
        elsewhere: Elsewhere | None = None,
    ) -> None:
        self._store = store
        self._live = live
        self._output_dir = output_dir
        self._views, self._elsewhere = cache, elsewhere
        self._loading: dict[str, asyncio.Future[EncodedView]] = {}  # ended views being read back from the store
        self._scanning = asyncio.Lock()  # one stored view indexed at a time

    def live(self, job_id: str, caller: Caller) -> LiveJob | None:
        """The job if it has not been saved as ended yet; raises JobNotFound when it is another owner's (answered
        like a job that does not exist: see the module's docstring)."""
        job = self._live.get(job_id)
        if job is not None and not caller.may_access(job.owner):
            raise JobNotFound(job_id)
        return job

    async def stored_view(self, job_id: str, caller: Caller) -> bytes:
        """The saved view (JSON bytes) of a job that is not live; raises JobNotFound (another owner's too)."""
        return (await self.final(job_id, caller)).body

    async def final(self, job_id: str, caller: Caller) -> EncodedView:
        """The encoded view of a job that is not live: kept since it ended, or read back from the store (once
        for concurrent readers, one view indexed at a time, off the event loop).

        Raises:
            JobNotFound: no such job, or another owner's (the same answer: existence is not revealed).
        """
        encoded = await self.encoded(job_id)
        if not caller.may_access(encoded.head.get("owner")):  # None: saved before owners were (admin only)
            raise JobNotFound(job_id)
        if encoded.head.get("ended_at") is None and self._elsewhere is not None:  # saved running, not live here
            await self._elsewhere.check(job_id, caller)  # OwnerElsewhere: another replica runs it
        return encoded

    async def encoded(self, job_id: str) -> EncodedView:
        """``final`` without the owner check, for the service's own reads (webhooks); raises JobNotFound."""
        cached = self._views.get(job_id)
        if cached is not None:
            return cached
        loading = self._loading.get(job_id)
        if loading is None:
            loading = self._loading[job_id] = asyncio.ensure_future(self._load(job_id))
            loading.add_done_callback(lambda _: self._loading.pop(job_id, None))
        return await asyncio.shield(loading)

    async def _load(self, job_id: str) -> EncodedView:
        stored = await self._store.jobs.get(job_id)
        if stored is None:
            raise JobNotFound(job_id)
        summaries: list[bytes] = []
        async with self._scanning:
            head, spans = await asyncio.to_thread(render.scan, stored.view, summaries)
        encoded = EncodedView(head, stored.view, spans, summaries, render.head_end(stored.view, spans))
        if job_id not in self._live and stored.ended_at is not None:  # a running view would go stale: not kept
            self._views.put(job_id, encoded)
        return encoded

    async def summaries(self, final: EncodedView) -> list[bytes]:
        """The summaries of an ended view's records: kept beside it, or made once (decoding one record at a time,
        off the event loop) for a view encoded from records that were already JSON (a callback's re-save)."""
        if final.summaries is None:
            body = final.body

            def summarize() -> list[bytes]:
                return [summary_record(orjson.loads(body[start:end])) for start, end in final.spans]

            async with self._scanning:
                if final.summaries is None:
                    final.summaries = await asyncio.to_thread(summarize)
        return final.summaries

    def live_view(self, job: LiveJob, selection: Selection = FULL) -> Body:
        """A live job's view, rendered a batch of records at a time as it is sent."""
        return self._render(job.view_dict(), selection)

    @staticmethod
    def _render(view: dict[str, Any], selection: Selection) -> Body:
        head = render_head(view, selection)
        pending = view.get("pending_calls", []) if selection.wants("pending_calls") else None
        mode = selection.records
        if mode == "none":
            return render.join(head, pending, None)
        if mode == "summary":
            return render.join(head, pending, [summary_record(record) for record in view["calls"]])
        return render.stream(head, pending, snapshot(view["calls"]))

    async def _ended(self, final: EncodedView, selection: Selection, head: dict[str, Any] | None = None) -> Body:
        """An ended job's view as ``selection`` says; ``head``: fields that replace the saved head (a slice)."""
        if head is None and selection.full:
            return final.body
        cut = final.head_bytes() if head is None and selection.fields is None else None
        rendered = cut if cut is not None else render_head(final.head if head is None else head, selection)
        wants = selection.wants("pending_calls")  # stored only for a parked job (``service.jobs.parking``)
        pending: list[dict[str, Any]] | None = (final.head.get("pending_calls") or []) if wants else None
        mode = selection.records
        if mode == "none":
            return render.join(rendered, pending, None)
        if mode == "summary":
            return render.join(rendered, pending, await self.summaries(final))
        return render.stream(rendered, pending, final.records())

    async def view(
        self,
        job_id: str,
        caller: Caller,
        offsets: dict[Stream, int | None] | None = None,
        selection: Selection = FULL,
    ) -> Body:
        """The job's view (JSON bytes, or pieces of them); with ``offsets``, a stream's text holds its bytes from
        that offset; ``selection``: which fields and how call records are shown.

        Raises:
            JobNotFound: no such job, or another owner's.
        """
        job = await unless_ending(self.live(job_id, caller))  # a final status is served once saved
        wanted = {stream: offset for stream, offset in (offsets or {}).items() if offset is not None}
        if job is not None:
            view = job.view_dict()
            for stream, offset in wanted.items():
                await self._slice(view, stream, offset)
            return self._render(view, selection)
        final = await self.final(job_id, caller)
        if not wanted:
            return await self._ended(final, selection)
        head = dict(final.head)
        for stream, offset in wanted.items():
            await self._slice(head, stream, offset)
        return await self._ended(final, selection, head)

    async def _slice(self, view: dict[str, Any], stream: Stream, offset: int) -> None:
        """Put the stream's retained bytes from ``offset`` (at most ``SLICE_BYTES``) into ``view``.

        ``<stream>_truncated`` then says whether retained bytes follow the slice.
        """
        data = await self._read(view["job_id"], stream, offset, SLICE_BYTES)
        at_end = view["status"] in FINAL and offset + len(data) >= view[f"{stream}_retained_bytes"]
        text, consumed, invalid = decode_slice(data, final=at_end)
        view[stream] = text
        view[f"{stream}_offset"] = offset
        view[f"{stream}_next_offset"] = offset + consumed
        view[f"{stream}_invalid_utf8"] = invalid
        view[f"{stream}_truncated"] = offset + consumed < view[f"{stream}_retained_bytes"]

    async def output_file(self, job_id: str, caller: Caller, path: str) -> tuple[Path | OutputRange, dict[str, Any]]:
        """(host file, or its range in the shared store, entry of the view's ``files``) of the output file
        ``path`` of the job.

        Raises:
            JobNotFound: no such job (another owner's too).
            NoSuchFile: the job has no output file at ``path`` (or it is not collected yet).
        """
        job = self.live(job_id, caller)
        listed = job.files_view()["files"] if job is not None else (await self.final(job_id, caller)).head.get("files")
        found: tuple[Path | OutputRange, dict[str, Any]] | None
        found = await asyncio.to_thread(files.find, self._output_dir / job_id, listed or [], path)
        if found is None and job is None and await shared.in_store(self._store, self._output_dir, job_id):
            found = await shared.stored_file(self._store, job_id, listed or [], path)
        if found is None:
            raise NoSuchFile(f"job {job_id} has no output file {path[:200]!r}")
        return found

    async def _read(self, job_id: str, stream: Stream, offset: int, length: int) -> bytes:
        """Up to ``length`` retained bytes of a stream from ``offset``: from this replica's disk, or for an ended
        job another replica ran, from the shared store (b"" past the end or without any)."""
        if job_id not in self._live and await shared.in_store(self._store, self._output_dir, job_id):
            return await self._store.blobs.read(job_id, stream, offset, length) or b""
        return await asyncio.to_thread(read_range, self._output_dir / job_id / stream, offset, length)

    async def read_output(self, job_id: str, caller: Caller, stream: Stream, offset: int, length: int) -> bytes:
        """Raw retained bytes of a stream, at most ``min(length, SLICE_BYTES)`` of them (bounded in memory:
        ``output_range`` serves longer reads); raises JobNotFound (for another owner's job too)."""
        if self.live(job_id, caller) is None:
            await self.stored_view(job_id, caller)
        return await self._read(job_id, stream, offset, min(length, SLICE_BYTES))

    async def output_range(self, job_id: str, caller: Caller, stream: Stream, offset: int, length: int) -> OutputRange:
        """The retained bytes of a stream from ``offset``, up to ``length`` (those retained now), as an open
        ``OutputRange`` to read a slice at a time and close (``GET /jobs/{id}/output/{stream}``).

        Raises:
            JobNotFound: no such job, or another owner's.
        """
        if self.live(job_id, caller) is None:
            await self.stored_view(job_id, caller)
            if await shared.in_store(self._store, self._output_dir, job_id):
                return await shared.stored_range(self._store, job_id, stream, offset, length)
        return await asyncio.to_thread(OutputRange.open, self._output_dir / job_id / stream, offset, length)

    async def wait(self, job_id: str, caller: Caller, timeout_s: float, selection: Selection = FULL) -> Body:
        """Block until the job ends, waits for the client (a client-executed call), or ``timeout_s`` passes.

        Returns its view then. Raises JobNotFound (for another owner's job too, at once).
        """
        job = self.live(job_id, caller)
        if job is not None:
            await wait_for_end_or_client(job, timeout_s)
        elif self._elsewhere is not None:  # woken by the store's notifications
            await self._elsewhere.wait(job_id, caller, timeout_s)  # OwnerElsewhere: still running there
        return await self.view(job_id, caller, selection=selection)

    async def page(self, query: JobQuery) -> tuple[list[JobSummary], str | None]:
        """A page of jobs (newest first; only ``query.owner``'s unless it is None) and the next cursor; the stored
        summaries (up to the metadata's size each) parsed in a thread. Raises InvalidCursor."""
        stored, cursor = await self._store.jobs.page(query)
        kept = [row.summary if row.job_id not in self._live else "" for row in stored]
        parsed = await asyncio.to_thread(lambda: [JobSummary.model_validate_json(s) if s else None for s in kept])
        summaries = []
        for row, summary in zip(stored, parsed, strict=True):
            live = await unless_ending(self._live.get(row.job_id))  # an ending job: its saved view, once saved
            if live is not None:
                view = live.view_dict()
                summaries.append(JobSummary.model_validate({**view, "calls": len(view["calls"])}))
            elif summary is not None:
                summaries.append(summary)
            else:  # saved before summaries were kept (or no longer held here since it was read)
                final = await self.encoded(row.job_id)
                summaries.append(JobSummary.model_validate({**final.head, "calls": len(final.spans)}))
        return summaries, cursor

    async def count(self) -> int:
        """Jobs in the store."""
        return await self._store.jobs.count()

    async def resume_point(self, job_id: str, caller: Caller, event_id: str, loc: tuple[str, ...]) -> resume.Position:
        """Where a follower that last received the event ``event_id`` of this job's stream resumes (clamped if lost).
        Raises:
            JobNotFound: no such job, or another owner's (before the id is looked at).
            InvalidField: ``event_id`` is not an event id of this job's stream, or claims more than the job has
                (``loc`` names where it came from: the header or the query parameter).
        """
        job = self.live(job_id, caller)
        if job is not None:
            head, records = job.view_dict(), len(job.calls)
        else:
            final = await self.final(job_id, caller)
            head, records = final.head, len(final.spans)
        clamp = head["status"] == "lost"  # kept as of its last progress save: a follower may have seen more of it
        try:
            position = resume.parse(event_id, job_id, records, clamp)
            position.check(records, {stream: head[f"{stream}_retained_bytes"] for stream in STREAMS}, clamp)
        except resume.InvalidPosition as exc:
            raise InvalidField(f"not an event id of this job's stream: {exc}", loc) from None
        return position

    async def events(
        self, job_id: str, caller: Caller, selection: Selection = FULL, start: resume.Position | None = None
    ) -> AsyncIterator[tuple[str, Any, str]]:
        """Follow a job: yields ``(event, data, id)`` triples, in order, until the job has ended.

        Events: ``status`` ``{"status"}`` on each change; ``stdout``/``stderr``
        ``{"offset", "text"}`` for each new piece of output (retained bytes);
        ``call`` with each call record (JSON bytes, or a view of a stored view's; its summary with
        ``calls=summary``, none with ``calls=none``) once it has its outcome; finally ``end`` with the final view
        (a ``render.Body``: the stored bytes themselves, or pieces rendered as they are sent; as ``selection``
        says); ``ping`` (data None, id "") after ``HEARTBEAT_S`` without a change of a live job. Nothing is
        copied whole per follower beyond one call record: the sender slices what it sends. A follower that
        joins late first gets everything so far. ``id`` is the stream's position after the event
        (``resume``); ``start``: resume after such a position (only what was not sent, a status only if it
        changed). A parked job (``service.jobs.parking``) is followed on: it is looked at again every
        ``PARKED_POLL_S`` until an answer resumes it. Any other job that is no longer live has ended: if its final
        save failed, the store holds an earlier status, and ``end`` carries that saved view. Raises JobNotFound (for
        another owner's job too).
        """
        job = self.live(job_id, caller)
        final = await self.final(job_id, caller) if job is None else None
        at = start if start is not None else resume.Position()
        looked = 0  # records before this index were each sent, or are in ``pending``
        pending: list[int] = []  # indices of records that were pending (not sent) when last looked at
        sent_calls: set[str] = set()  # the call ids of the records this stream sent, and where (index -> call id)
        sent_at: dict[int, str] = {}
        last_runs = -1  # the job's resumes when last looked at (-1: not yet)
        loop = asyncio.get_running_loop()
        last_progress: tuple[Any, ...] = ()
        quiet_since = loop.time()  # when an event was last sent (or the stream began)
        calls = selection.calls
        while True:
            changed = job.changed() if job is not None else None
            records: list[Any]
            head: dict[str, Any]
            if job is not None:  # what a wake needs, not the view (it counts every record, renders the output)
                head = {
                    "status": job.status.value,
                    "stdout_retained_bytes": job.stdout.retained_bytes,
                    "stderr_retained_bytes": job.stderr.retained_bytes,
                    "resumes": job.resumes,
                }
                records = job.calls
            elif final is not None:
                head = final.head
                records = list(final.records())
            else:  # not reachable: a job that is not live has its saved view
                raise JobNotFound(job_id)
            # a parked job (not live, saved unfinished with parked_at) has not ended: an answer resumes it
            parked = job is None and head.get("parked_at") is not None and head.get("ended_at") is None
            if head["status"] != at.status:
                at.status = head["status"]
                yield "status", {"status": at.status}, at.token(job_id)
            if calls != "none":
                summaries = await self.summaries(final) if final is not None and calls == "summary" else None
                # the records still pending at the last look, then the new ones (each record is looked at once
                # more per wake only while it is pending: not the whole list each time, O(n^2) over a job)
                # A resume's replay makes the records again, from none, perhaps in another order: all are looked at
                # again then (a record is known by its call id), and those past the ones made so far wait their turn.
                count, runs = len(records), len(head.get("resumes") or ())
                floor = at.low if runs == last_runs else 0
                looked, last_runs = (looked, runs) if runs == last_runs else (0, runs)
                candidates = sorted({*pending, *range(max(min(looked, count), floor), count)})
                pending, looked = [index for index in candidates if index >= count], count
                for index in candidates:
                    if index >= count:
                        continue
                    record = records[index]
                    call = resume.record_call_id(record)
                    if call in sent_calls:  # sent at another place: a replay may make concurrent calls in another order
                        at.mark(index + 1)  # this place's record is sent too (``low`` keeps up)
                        continue
                    if at.sent(index + 1) and sent_at.get(index, call) == call:  # this one, or before this stream began
                        continue
                    # sent once it has its outcome (a job being parked: its waits' records are cancelled, then pending)
                    if (job is not None and job.parking) or (
                        (job is not None or parked) and resume.record_status(record) == "pending"
                    ):
                        pending.append(index)
                        continue
                    at.mark(index + 1)
                    sent_calls.add(call)
                    sent_at[index] = call
                    if summaries is not None:
                        data = summaries[index]
                    elif calls == "summary":
                        data = summary_record(record)
                    else:
                        data = render.encode_record(record) if isinstance(record, dict) else record
                    yield "call", data, at.token(job_id)
            ended = (job is None and not parked) or (job is not None and head["status"] in FINAL and job.done.is_set())
            for stream in STREAMS:
                retained = head[f"{stream}_retained_bytes"]
                offset = at.stdout if stream == "stdout" else at.stderr
                while offset < retained:
                    data = await self.read_output(job_id, caller, stream, offset, 64 * 1024)
                    text, consumed, _ = decode_slice(data, final=ended and offset + len(data) >= retained)
                    if not consumed:
                        break
                    piece = {"offset": offset, "text": text}
                    offset += consumed
                    if stream == "stdout":
                        at.stdout = offset
                    else:
                        at.stderr = offset
                    yield stream, piece, at.token(job_id)
            if ended:
                end = final if final is not None else await self.final(job_id, caller)
                at.ended = True
                yield "end", await self._ended(end, selection), at.token(job_id)
                return
            if parked:  # looked at again each PARKED_POLL_S, a ping after HEARTBEAT_S, until it is resumed
                if loop.time() - quiet_since >= HEARTBEAT_S:
                    quiet_since = loop.time()
                    yield "ping", None, ""
                await asyncio.sleep(PARKED_POLL_S)
                job = self._live.get(job_id)
                final = None if job is not None else await self._load(job_id)
                continue
            if changed is not None:
                # a ping after HEARTBEAT_S without an event, though the job changed meanwhile (output past its
                # retention sends nothing): a proxy's idle timeout must not cut a stream that is alive
                progress = (at.status, at.stdout, at.stderr, at.low, len(at.after))
                if progress != last_progress:
                    last_progress, quiet_since = progress, loop.time()
                elif loop.time() - quiet_since >= HEARTBEAT_S:
                    quiet_since = loop.time()
                    yield "ping", None, ""
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), max(0.0, quiet_since + HEARTBEAT_S - loop.time()))
            if job is not None and job.done.is_set() and job_id not in self._live:
                job = None  # saved as ended: read the final view from the store
                final = await self.encoded(job_id)
