"""The jobs resource: ``POST /execute`` and ``/jobs`` (list, view, output, wait, client calls, approvals, stop,
events)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Annotated

import orjson
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import BeforeValidator
from sse_starlette import EventSourceResponse

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppSettings, Idempotency, Jobs, Key, Reads, Who
from service.api.idempotent import KEY_DESCRIPTION, KEY_HEADER, claim_key, replay
from service.api.problems import ENGINE_UNAVAILABLE
from service.api.reads import LIST_BATCH, holding
from service.api.responses import event_pieces, output_slices, view_response
from service.errors import InvalidField, RequestLimitError
from service.files import DOWNLOAD_HEADERS
from service.jobs.live import LiveJob, wait_for_end_or_client
from service.limits import check_execute
from service.observability import stages
from service.output import OutputRange
from service.sandbox.backend import Stream
from service.schemas.job_models import (
    ApprovalDecision,
    ClientAnswer,
    ExecuteRequest,
    JobList,
    JobStatusValue,
    JobSummary,
    JobView,
    JobViewSelection,
)
from service.store import IdempotencyRecord, InvalidCursor, JobQuery
from service.views.render import CallsMode, Selection, select

router = APIRouter(route_class=ParsedOffLoop)

_SSE_EVENT = {  # one event of GET /jobs/{id}/events; data is JSON text
    "type": "object",
    "properties": {
        "id": {"type": "string", "description": "Opaque: send it back as Last-Event-ID to resume after this event."},
        "event": {"type": "string", "enum": ["status", "stdout", "stderr", "call", "end"]},
        "data": {"type": "string"},
    },
    "required": ["data"],
}


_LOCATION = {
    "Location": {"schema": {"type": "string"}, "description": "The job's URL path: /jobs/{job_id}."},
}


async def view_selection(
    calls: Annotated[
        CallsMode,
        Query(
            description="How the view shows call records: full (every field, the default), summary (seq, call_id, "
            "tool, status, error, duration_ms: no arguments or results), none (no records; calls_total and "
            "calls_by_status stay). pending_calls keep their args (the caller must answer them)."
        ),
    ] = "full",
    fields: Annotated[
        str | None,
        Query(
            description="Comma-separated top-level fields of the view to send (job_id and status are always "
            "sent); an unknown name is a 422 that lists the allowed ones.",
            max_length=4096,
        ),
    ] = None,
) -> Selection:
    """The view selection of ``?calls=`` and ``?fields=``; raises InvalidField for an unknown field."""
    return select(calls, fields)


ViewSelection = Annotated[Selection, Depends(view_selection)]
ViewAnswer = JobView | JobViewSelection
"""A view answer, as documented: the whole ``JobView``, or the parts ``?calls=`` and ``?fields=`` selected."""


def _iso8601(value: object) -> object:
    """Only ISO 8601 text is a date-time here (pydantic alone would also take numbers as unix seconds)."""
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("not an ISO 8601 date-time") from None
    return value


IsoDateTime = Annotated[datetime, BeforeValidator(_iso8601)]


def utc(value: datetime | None, name: str) -> datetime | None:
    """A query datetime in UTC (naive ones are taken as UTC).

    Args:
        value: the parsed query parameter, or None when absent.
        name: the parameter's name (``created_after`` or ``created_before``), for the error's ``loc``.

    Raises:
        InvalidField: ``value`` has no UTC equivalent (e.g. year 9999 at -05:00), naming ``("query", name)``.
    """
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise InvalidField(f"{value.isoformat()} is outside the range of UTC datetimes", ("query", name)) from None


@router.post(
    "/execute",
    response_model=ViewAnswer,
    responses={202: {"model": ViewAnswer, "headers": _LOCATION}, 404: {}, 409: {}, 422: {}, 429: {}, 503: {}},
)
async def execute(
    body: ExecuteRequest,
    request: Request,
    jobs: Jobs,
    who: Who,
    settings: AppSettings,
    key: Key,
    idempotency: Idempotency,
    selection: ViewSelection,
    idempotency_key: Annotated[str | None, Header(alias=KEY_HEADER, description=KEY_DESCRIPTION)] = None,
) -> Response:
    """Run ``body.script`` in a new sandbox (or, with ``session_id``, in that session's sandbox).

    Answers 200 with the final view if the job ends within ``wait_s``, else 202
    with the view so far (the job runs on until it ends or hits ``timeout_s``) and ``Location: /jobs/{id}``.
    A job that could not start because the engine is unreachable answers 503.
    With an ``Idempotency-Key`` already bound to a job of the same request, nothing runs: the answer is that
    job's, as this request would get it now (``Idempotent-Replayed: true``).
    """
    stages.mark("body-parsed")
    check_execute(body, settings, key)
    claim = await claim_key(request, idempotency, who.owner, idempotency_key, "job", body)
    if isinstance(claim, IdempotencyRecord):
        job_id = request.state.job_id = claim.resource_id
        return await replay(request, lambda: job_answer(job_id, jobs, who, selection))
    try:
        job = await jobs.submit(body, who.owner, admin=who.admin, internal=who.internal)
    except BaseException:
        if claim is not None:
            claim.release()  # nothing was created: a retry with this key may succeed
        raise
    stages.mark("admitted-and-saved")
    request.state.job_id = job.id  # for the request's log event
    if claim is not None:
        await claim.bind("job", job.id, job.created_at)
    return await job_answer(job.id, jobs, who, selection, job)


async def job_answer(job_id: str, jobs: Jobs, who: Who, selection: Selection, job: LiveJob | None = None) -> Response:
    """What ``POST /execute`` answers for a job now: its final view once it has ended within its ``wait_s``
    (503 if the engine was unreachable), else 202 with its view so far and ``Location: /jobs/{id}``; both in
    ``selection``.

    Args:
        job: the live job just submitted; None to look it up (a replay: live, or ended and saved).

    Raises:
        JobNotFound: no such job (purged), or another owner's.
    """
    if job is None:
        job = jobs.views.live(job_id, who)
    if job is not None:
        await wait_for_end_or_client(job, job.limits.wait_s)  # a client call or an approval needs the caller
        stages.mark("end-seen")
        if job.ended:
            await job.done.wait()  # its final status is told once its final view is saved (Runner._cleanup)
        if not job.done.is_set():
            return view_response(jobs.views.live_view(job, selection), 202, {"Location": f"/jobs/{job_id}"})
    final = await jobs.views.final(job_id, who)  # saved as served
    error = final.head.get("error") or {}
    if error.get("type") == "engine_unavailable":
        return ENGINE_UNAVAILABLE.response(str(error.get("message", "")), job_id=job_id)
    answer = view_response(await jobs.views.view(job_id, who, selection=selection))
    stages.mark("view-rendered")
    return answer


@router.get("/jobs", response_model=JobList, responses={422: {}, 429: {}})
async def list_jobs(
    jobs: Jobs,
    who: Who,
    reads: Reads,
    status: Annotated[list[JobStatusValue] | None, Query(description="Keep only these statuses.")] = None,
    created_after: Annotated[IsoDateTime | None, Query(description="ISO 8601; exclusive.")] = None,
    created_before: Annotated[IsoDateTime | None, Query(description="ISO 8601; exclusive.")] = None,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> Response:
    """The caller's jobs (the admin role: every owner's), newest first, a page at a time.

    The page is read from the store ``LIST_BATCH`` rows at a time and each batch sent before the next is read
    (``api.reads``); one of the key's ``max_reads_per_key`` answers under way (past them: 429)."""
    query = JobQuery(
        owner=who.only_owner,
        statuses=tuple(status or ()),
        created_after=utc(created_after, "created_after"),
        created_before=utc(created_before, "created_before"),
        cursor=cursor,
        limit=min(limit, LIST_BATCH),
    )
    release = reads.take(who.owner)
    try:
        first = await jobs.views.page(query)
    except BaseException as exc:
        release()
        if isinstance(exc, InvalidCursor):
            raise InvalidField(str(exc), ("query", "cursor")) from exc
        raise
    return StreamingResponse(holding(_job_list(jobs, query, limit, first), release), media_type="application/json")


async def _job_list(
    jobs: Jobs, query: JobQuery, limit: int, first: tuple[list[JobSummary], str | None]
) -> AsyncIterator[bytes]:
    """A ``JobList`` of up to ``limit`` jobs as JSON pieces: ``first`` (a batch of ``query``), then the next
    batches from the store by their cursors (keyset pages: the same rows and ``next_cursor`` as one page of
    ``limit``), each encoded in a thread."""
    page, cursor = first
    sent = 0
    yield b'{"jobs":['
    while True:
        if page:
            yield (b"," if sent else b"") + await asyncio.to_thread(_encoded, page)
            sent += len(page)
        if cursor is None or sent >= limit:
            break
        page, cursor = await jobs.views.page(replace(query, cursor=cursor, limit=min(LIST_BATCH, limit - sent)))
    yield b'],"next_cursor":' + orjson.dumps(cursor) + b"}"


def _encoded(page: list[JobSummary]) -> bytes:
    """Summaries as JSON, comma-separated (blocking: run it in a thread)."""
    return b",".join(JobSummary.__pydantic_serializer__.to_json(summary) for summary in page)


@router.get("/jobs/{job_id}", response_model=ViewAnswer, responses={404: {}})
async def get_job(
    job_id: str,
    jobs: Jobs,
    who: Who,
    stdout_offset: Annotated[int | None, Query(ge=0, description="Return stdout from this byte offset.")] = None,
    stderr_offset: Annotated[int | None, Query(ge=0, description="Return stderr from this byte offset.")] = None,
    *,
    selection: ViewSelection,
) -> Response:
    """The job's view: live while it runs, final after."""
    offsets: dict[Stream, int | None] = {"stdout": stdout_offset, "stderr": stderr_offset}
    return view_response(await jobs.views.view(job_id, who, offsets, selection))


@router.get(
    "/jobs/{job_id}/output/{stream}",
    response_class=Response,
    responses={
        200: {
            "description": "The bytes; header X-Offset: where they start.",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        404: {},
    },
)
async def get_output(
    job_id: str,
    stream: Stream,
    jobs: Jobs,
    who: Who,
    offset: Annotated[int, Query(ge=0)] = 0,
    length: Annotated[int, Query(ge=1, le=16 * 1024 * 1024)] = 1024 * 1024,
) -> Response:
    """Raw retained bytes of ``stdout`` or ``stderr`` from ``offset`` (``application/octet-stream``)."""
    retained = await jobs.views.output_range(job_id, who, stream, offset, length)
    return StreamingResponse(
        output_slices(retained),
        media_type="application/octet-stream",
        headers={"X-Offset": str(offset), "content-length": str(retained.length)},
    )


@router.get(
    "/jobs/{job_id}/files/{path:path}",
    response_class=Response,
    responses={
        200: {
            "description": "The file's bytes (content type: the view's content_type).",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        404: {},
    },
)
async def get_output_file(job_id: str, path: str, jobs: Jobs, who: Who) -> Response:
    """An output file of the job (one its view lists in ``files``: what the script left in ``outputs/``), as it was
    collected when the script ended; kept as long as the job. 404 for an unknown job or path."""
    host, entry = await jobs.views.output_file(job_id, who, path)
    media_type = str(entry.get("content_type") or "application/octet-stream")
    headers = {"X-Content-SHA256": str(entry.get("sha256", "")), **DOWNLOAD_HEADERS}
    if isinstance(host, OutputRange):  # an ended job another replica ran: from the shared store, a slice at a time
        headers["content-length"] = str(host.length)
        return StreamingResponse(output_slices(host), media_type=media_type, headers=headers)
    return FileResponse(host, media_type=media_type, headers=headers)


@router.post("/jobs/{job_id}/wait", response_model=ViewAnswer, responses={404: {}})
async def wait_job(
    job_id: str,
    jobs: Jobs,
    who: Who,
    settings: AppSettings,
    timeout_s: Annotated[float | None, Query(ge=0, description="Seconds; default PTC_DEFAULT_WAIT_S.")] = None,
    *,
    selection: ViewSelection,
) -> Response:
    """Block until the job ends or ``timeout_s`` passes; answers the view then."""
    if timeout_s is None:
        timeout_s = settings.default_wait_s
    if timeout_s > settings.max_wait_s:
        raise RequestLimitError(
            f"{timeout_s} exceeds the server maximum of {settings.max_wait_s}", ("query", "timeout_s")
        )
    return view_response(await jobs.views.wait(job_id, who, timeout_s, selection))


@router.post("/jobs/{job_id}/calls/{call_id}", response_model=ViewAnswer, responses={404: {}, 409: {}, 422: {}})
async def answer_call(
    job_id: str, call_id: str, body: ClientAnswer, jobs: Jobs, who: Who, selection: ViewSelection
) -> Response:
    """Answer a client-executed tool call: ``{"result": ...}`` or ``{"error": {"type", "message"}}``."""
    has_result, has_error = "result" in body.model_fields_set, body.error is not None
    if has_result == has_error:
        raise InvalidField("give exactly one of result or error", ("body",))
    if has_error:
        assert body.error is not None
        ok, value = False, body.error.model_dump()
    else:
        ok, value = True, body.result
    return view_response(await jobs.answer_call(job_id, who, call_id, ok, value, selection))


@router.post("/jobs/{job_id}/calls/{call_id}/approve", response_model=ViewAnswer, responses={404: {}, 409: {}, 422: {}})
async def approve_call(
    job_id: str, call_id: str, jobs: Jobs, who: Who, selection: ViewSelection, body: ApprovalDecision | None = None
) -> Response:
    """Approve a call awaiting approval: the broker sends it to its tool's endpoint. Body optional:
    ``{"reason": ...}``, kept in the call record's ``approval``."""
    reason = body.reason if body is not None else None
    return view_response(await jobs.decide_approval(job_id, who, call_id, True, reason, selection))


@router.post("/jobs/{job_id}/calls/{call_id}/deny", response_model=ViewAnswer, responses={404: {}, 409: {}, 422: {}})
async def deny_call(
    job_id: str, call_id: str, jobs: Jobs, who: Who, selection: ViewSelection, body: ApprovalDecision | None = None
) -> Response:
    """Deny a call awaiting approval: the script gets a ToolError of type ``denied`` with the reason, and the
    endpoint never sees the call. Body optional: ``{"reason": ...}``."""
    reason = body.reason if body is not None else None
    return view_response(await jobs.decide_approval(job_id, who, call_id, False, reason, selection))


@router.post("/jobs/{job_id}/stop", response_model=ViewAnswer, responses={404: {}})
async def stop_job(job_id: str, jobs: Jobs, who: Who, selection: ViewSelection) -> Response:
    """End the job: SIGTERM to the script's processes, SIGKILL after the grace; a script that exited by itself
    first keeps its own status. Answers with the final view. Idempotent."""
    return view_response(await jobs.stop(job_id, who, selection))


@router.get(
    "/jobs/{job_id}/events",
    response_class=EventSourceResponse,
    responses={
        200: {"description": "An event stream.", "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
        204: {"description": "The event id given is that of the stream's end event: nothing follows."},
        404: {},
    },
)
async def job_events(
    job_id: str,
    jobs: Jobs,
    who: Who,
    selection: ViewSelection,
    last_event_id: Annotated[
        str | None,
        Query(description="For clients that cannot set headers: as the Last-Event-ID header (which wins)."),
    ] = None,
    last_event_id_header: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            description="The id of the last event received: the stream resumes right after it.",
        ),
    ] = None,
) -> Response:
    """Server-Sent Events: ``status``, ``stdout``/``stderr``, ``call`` and a final ``end``, each with an ``id``.

    Reconnecting with ``Last-Event-ID`` (or ``?last_event_id=``) resumes right after that event: output from the
    offset after the last piece received, each call record not yet sent (once), a status only if it changed;
    after ``end``, 204.
    """
    if last_event_id_header:
        start = await jobs.views.resume_point(job_id, who, last_event_id_header, ("header", "Last-Event-ID"))
    elif last_event_id:
        start = await jobs.views.resume_point(job_id, who, last_event_id, ("query", "last_event_id"))
    else:
        start = None
        if jobs.views.live(job_id, who) is None:
            await jobs.views.stored_view(job_id, who)  # 404 before the stream starts
    if start is not None and start.ended:
        return Response(status_code=204)

    async def stream() -> AsyncIterator[bytes]:
        async for event, data, event_id in jobs.views.events(job_id, who, selection, start):
            if event == "ping":
                yield b": ping\r\n\r\n"
                continue
            head = b"id: " + event_id.encode() + b"\r\nevent: " + event.encode() + b"\r\ndata: "
            async for piece in event_pieces(head, orjson.dumps(data) if isinstance(data, dict) else data):
                yield piece

    # pings come from the stream itself (``ping`` events), between events: one of the library's could land
    # between the pieces of a large event and break it
    return EventSourceResponse(stream(), ping=0)
