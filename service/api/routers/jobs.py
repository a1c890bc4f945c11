"""The jobs resource: ``POST /execute`` and ``/jobs`` (list, view, output, wait, client calls, approvals, stop,
events)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated

import orjson
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BeforeValidator
from sse_starlette import EventSourceResponse

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppSettings, Idempotency, Jobs, Key, Who
from service.api.idempotent import KEY_DESCRIPTION, KEY_HEADER, claim_key, replay
from service.api.problems import ENGINE_UNAVAILABLE
from service.api.responses import output_slices, view_response
from service.errors import InvalidField, RequestLimitError
from service.jobs.live import LiveJob, wait_for_end_or_client
from service.limits import check_execute
from service.sandbox.base import Stream
from service.schemas import ApprovalDecision, ClientAnswer, ExecuteRequest, JobList, JobStatus, JobView
from service.store import IdempotencyRecord, InvalidCursor, JobQuery

router = APIRouter(route_class=ParsedOffLoop)

_SSE_EVENT = {  # one event of GET /jobs/{id}/events; data is JSON text
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["status", "stdout", "stderr", "call", "end"]},
        "data": {"type": "string"},
    },
    "required": ["data"],
}


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
    response_model=JobView,
    responses={202: {"model": JobView}, 404: {}, 409: {}, 422: {}, 429: {}, 503: {}},
)
async def execute(
    body: ExecuteRequest,
    request: Request,
    jobs: Jobs,
    who: Who,
    settings: AppSettings,
    key: Key,
    idempotency: Idempotency,
    idempotency_key: Annotated[str | None, Header(alias=KEY_HEADER, description=KEY_DESCRIPTION)] = None,
) -> Response:
    """Run ``body.script`` in a new sandbox (or, with ``session_id``, in that session's sandbox).

    Answers 200 with the final view if the job ends within ``wait_s``, else 202
    with the view so far (the job runs on until it ends or hits ``timeout_s``).
    A job that could not start because the engine is unreachable answers 503.
    With an ``Idempotency-Key`` already bound to a job of the same request, nothing runs: the answer is that
    job's, as this request would get it now (``Idempotent-Replayed: true``).
    """
    check_execute(body, settings, key)
    claim = await claim_key(request, idempotency, who.owner, idempotency_key, "job", body)
    if isinstance(claim, IdempotencyRecord):
        job_id = request.state.job_id = claim.resource_id
        return await replay(request, lambda: job_answer(job_id, jobs, who))
    try:
        job = await jobs.submit(body, who.owner, admin=who.admin)
    except BaseException:
        if claim is not None:
            claim.release()  # nothing was created: a retry with this key may succeed
        raise
    request.state.job_id = job.id  # for the request's log event
    if claim is not None:
        await claim.bind("job", job.id, job.created_at)
    return await job_answer(job.id, jobs, who, job)


async def job_answer(job_id: str, jobs: Jobs, who: Who, job: LiveJob | None = None) -> Response:
    """What ``POST /execute`` answers for a job now: its final view once it has ended within its ``wait_s``
    (503 if the engine was unreachable), else 202 with its view so far.

    Args:
        job: the live job just submitted; None to look it up (a replay: live, or ended and saved).

    Raises:
        JobNotFound: no such job (purged), or another owner's.
    """
    if job is None:
        job = jobs.live(job_id, who)
    if job is not None:
        await wait_for_end_or_client(job, job.limits.wait_s)  # a client call or an approval needs the caller
        if not job.done.is_set():
            return view_response(jobs.live_view(job), 202)
    final = await jobs.final(job_id, who)  # saved as served
    error = final.head.get("error") or {}
    if error.get("type") == "engine_unavailable":
        return ENGINE_UNAVAILABLE.response(str(error.get("message", "")), job_id=job_id)
    return view_response(final.body)


@router.get("/jobs", response_model=JobList, responses={422: {}})
async def list_jobs(
    jobs: Jobs,
    who: Who,
    status: Annotated[list[JobStatus] | None, Query(description="Keep only these statuses.")] = None,
    created_after: Annotated[IsoDateTime | None, Query(description="ISO 8601; exclusive.")] = None,
    created_before: Annotated[IsoDateTime | None, Query(description="ISO 8601; exclusive.")] = None,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobList:
    """The caller's jobs (the admin role: every owner's), newest first, a page at a time."""
    query = JobQuery(
        owner=who.only_owner,
        statuses=tuple(status or ()),
        created_after=utc(created_after, "created_after"),
        created_before=utc(created_before, "created_before"),
        cursor=cursor,
        limit=limit,
    )
    try:
        page, next_cursor = await jobs.page(query)
    except InvalidCursor as exc:
        raise InvalidField(str(exc), ("query", "cursor")) from exc
    return JobList(jobs=page, next_cursor=next_cursor)


@router.get("/jobs/{job_id}", response_model=JobView, responses={404: {}})
async def get_job(
    job_id: str,
    jobs: Jobs,
    who: Who,
    stdout_offset: Annotated[int | None, Query(ge=0, description="Return stdout from this byte offset.")] = None,
    stderr_offset: Annotated[int | None, Query(ge=0, description="Return stderr from this byte offset.")] = None,
) -> Response:
    """The job's view: live while it runs, final after."""
    offsets: dict[Stream, int | None] = {"stdout": stdout_offset, "stderr": stderr_offset}
    return view_response(await jobs.view(job_id, who, offsets))


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
    retained = await jobs.output_range(job_id, who, stream, offset, length)
    return StreamingResponse(
        output_slices(retained),
        media_type="application/octet-stream",
        headers={"X-Offset": str(offset), "content-length": str(retained.length)},
    )


@router.post("/jobs/{job_id}/wait", response_model=JobView, responses={404: {}})
async def wait_job(
    job_id: str,
    jobs: Jobs,
    who: Who,
    settings: AppSettings,
    timeout_s: Annotated[float | None, Query(ge=0, description="Seconds; default PTC_DEFAULT_WAIT_S.")] = None,
) -> Response:
    """Block until the job ends or ``timeout_s`` passes; answers the view then."""
    if timeout_s is None:
        timeout_s = settings.default_wait_s
    if timeout_s > settings.max_wait_s:
        raise RequestLimitError(
            f"{timeout_s} exceeds the server maximum of {settings.max_wait_s}", ("query", "timeout_s")
        )
    return view_response(await jobs.wait(job_id, who, timeout_s))


@router.post("/jobs/{job_id}/calls/{call_id}", response_model=JobView, responses={404: {}, 409: {}, 422: {}})
async def answer_call(job_id: str, call_id: str, body: ClientAnswer, jobs: Jobs, who: Who) -> Response:
    """Answer a client-executed tool call: ``{"result": ...}`` or ``{"error": {"type", "message"}}``."""
    has_result, has_error = "result" in body.model_fields_set, body.error is not None
    if has_result == has_error:
        raise InvalidField("give exactly one of result or error", ("body",))
    if has_error:
        assert body.error is not None
        ok, value = False, body.error.model_dump()
    else:
        ok, value = True, body.result
    return view_response(await jobs.answer_call(job_id, who, call_id, ok, value))


@router.post("/jobs/{job_id}/calls/{call_id}/approve", response_model=JobView, responses={404: {}, 409: {}, 422: {}})
async def approve_call(
    job_id: str, call_id: str, jobs: Jobs, who: Who, body: ApprovalDecision | None = None
) -> Response:
    """Approve a call awaiting approval: the broker sends it to its tool's endpoint. Body optional:
    ``{"reason": ...}``, kept in the call record's ``approval``."""
    reason = body.reason if body is not None else None
    return view_response(await jobs.decide_approval(job_id, who, call_id, True, reason))


@router.post("/jobs/{job_id}/calls/{call_id}/deny", response_model=JobView, responses={404: {}, 409: {}, 422: {}})
async def deny_call(job_id: str, call_id: str, jobs: Jobs, who: Who, body: ApprovalDecision | None = None) -> Response:
    """Deny a call awaiting approval: the script gets a ToolError of type ``denied`` with the reason, and the
    endpoint never sees the call. Body optional: ``{"reason": ...}``."""
    reason = body.reason if body is not None else None
    return view_response(await jobs.decide_approval(job_id, who, call_id, False, reason))


@router.post("/jobs/{job_id}/stop", response_model=JobView, responses={404: {}})
async def stop_job(job_id: str, jobs: Jobs, who: Who) -> Response:
    """End the job: SIGTERM to the script's processes, SIGKILL after the grace; a script that exited by itself
    first keeps its own status. Answers with the final view. Idempotent."""
    return view_response(await jobs.stop(job_id, who))


@router.get(
    "/jobs/{job_id}/events",
    response_class=EventSourceResponse,
    responses={
        200: {"description": "An event stream.", "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
        404: {},
    },
)
async def job_events(job_id: str, jobs: Jobs, who: Who) -> EventSourceResponse:
    """Server-Sent Events: ``status``, ``stdout``/``stderr``, ``call`` and a final ``end``."""
    if jobs.live(job_id, who) is None:
        await jobs.stored_view(job_id, who)  # 404 before the stream starts

    async def stream() -> AsyncIterator[bytes]:
        async for event, data in jobs.events(job_id, who):  # "call" and "end" come as JSON bytes
            payload = data if isinstance(data, bytes) else orjson.dumps(data)
            yield b"event: " + event.encode() + b"\r\ndata: " + payload + b"\r\n\r\n"

    return EventSourceResponse(stream(), ping=15)
