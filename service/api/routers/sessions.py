"""The sessions resource: ``/sessions`` (create, list, view, delete) and a session's files
(``/sessions/{id}/files``: docs/files.md)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response, StreamingResponse
from ptc_runtime.files import check_path

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppSettings, Idempotency, Key, Reads, Sessions, Who
from service.api.idempotent import KEY_DESCRIPTION, KEY_HEADER, claim_key, replay
from service.api.reads import holding
from service.api.responses import output_slices
from service.errors import InvalidField, PayloadTooLarge
from service.files import DOWNLOAD_HEADERS, content_type
from service.limits import check_session
from service.schemas.session_models import SessionFile, SessionFileList, SessionList, SessionRequest, SessionView
from service.store import IdempotencyRecord

router = APIRouter(route_class=ParsedOffLoop)


def json_session(view: dict[str, Any], status_code: int = 200) -> Response:
    """A session's view as ``application/json``, validated by ``SessionView`` (a 201 with its ``Location``)."""
    model = SessionView.model_validate(view)
    headers = {"Location": f"/sessions/{model.session_id}"} if status_code == 201 else None
    return Response(
        model.model_dump_json().encode(), status_code=status_code, media_type="application/json", headers=headers
    )


_LOCATION = {
    "Location": {"schema": {"type": "string"}, "description": "The session's URL path: /sessions/{session_id}."}
}


@router.post(
    "/sessions",
    status_code=201,
    response_model=SessionView,
    responses={201: {"headers": _LOCATION}, 404: {}, 409: {}, 422: {}, 429: {}, 503: {}},
)
async def create_session(
    body: SessionRequest,
    request: Request,
    sessions: Sessions,
    who: Who,
    settings: AppSettings,
    key: Key,
    idempotency: Idempotency,
    idempotency_key: Annotated[str | None, Header(alias=KEY_HEADER, description=KEY_DESCRIPTION)] = None,
) -> Response:
    """Start a session: a sandbox kept for a conversation's scripts (``/execute`` with ``session_id``).

    Answers 201 (``Location: /sessions/{id}``) once the sandbox is ready. Its files under ``/tmp`` persist
    between scripts; it ends after ``idle_timeout_s`` without a script, at ``max_lifetime_s``, or on DELETE.
    With an ``Idempotency-Key`` already bound to a session of the same request, no sandbox starts: the answer is
    that session's view (201 while it is open; once it has ended, what ``GET /sessions/{id}`` answers), with
    ``Idempotent-Replayed: true``.
    """
    check_session(body, settings, key)
    claim = await claim_key(request, idempotency, who.owner, idempotency_key, "session", body)
    if isinstance(claim, IdempotencyRecord):
        session_id = claim.resource_id
        return await replay(request, lambda: session_answer(session_id, sessions, who))
    try:
        view = await sessions.create_session(body, who.owner, admin=who.admin)
    except BaseException:
        if claim is not None:
            claim.release()  # nothing was created: a retry with this key may succeed
        raise
    if claim is not None:
        created_at: datetime = view["created_at"]
        ends_by = created_at + timedelta(seconds=float(view["max_lifetime_s"]))
        await claim.bind("session", view["session_id"], created_at, ends_by)
    return json_session(view, 201)


async def session_answer(session_id: str, sessions: Sessions, who: Who) -> Response:
    """What a repeated ``POST /sessions`` answers: 201 with the session's view while it is open, else what
    ``GET /sessions/{id}`` answers (200 with its ended view; ``SessionNotFound`` once it is forgotten, as after
    a restart)."""
    view = await sessions.session_view(session_id, who)
    return json_session(view, 200 if view["ended_at"] is not None else 201)


@router.get("/sessions", response_model=SessionList)
async def list_sessions(sessions: Sessions, who: Who) -> Response:
    """The caller's open sessions (the admin role: every owner's), oldest first."""
    body = SessionList.model_validate({"sessions": await sessions.sessions(who)}).model_dump_json().encode()
    return Response(body, media_type="application/json")


@router.get("/sessions/{session_id}", response_model=SessionView, responses={404: {}})
async def get_session(session_id: str, sessions: Sessions, who: Who) -> Response:
    """A session's view (ended sessions stay visible for a while, up to the last 1,000)."""
    return json_session(await sessions.session_view(session_id, who))


@router.delete("/sessions/{session_id}", response_model=SessionView, responses={404: {}})
async def delete_session(session_id: str, sessions: Sessions, who: Who) -> Response:
    """End a session: its running script is stopped, queued ones end ``stopped``, its sandbox is removed.

    Idempotent: deleting an ended session returns its view unchanged.
    """
    return json_session(await sessions.delete_session(session_id, who))


def _file_path(path: str, outputs: bool) -> str:
    """The URL's file path checked (``ptc_runtime.files.check_path``); raises InvalidField (422)."""
    try:
        return check_path(path, outputs=outputs)
    except ValueError as exc:
        raise InvalidField(str(exc), ("path", "path")) from None


_RAW = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


@router.put(
    "/sessions/{session_id}/files/{path:path}",
    response_model=SessionFile,
    responses={404: {}, 409: {}, 413: {}, 422: {}, 503: {}},
    openapi_extra={"requestBody": {"required": True, **_RAW}},
)
async def put_session_file(
    session_id: str, path: str, request: Request, sessions: Sessions, who: Who, settings: AppSettings
) -> Response:
    """Write the request body (raw bytes) to ``path`` under the session's /tmp, at the session's turn (after the
    scripts running or queued there). The sandbox writes it as its user and never follows a symlink (a symlink or
    folder in the way: 422 ``file-refused``, code ``not_a_file``; a full tmpfs: code ``no_space``). At most
    ``max_files_bytes`` (413); paths as in ``files`` (422)."""
    name = _file_path(path, outputs=False)
    data = request.state.raw_body = await request.body()  # relayed as it came if the session is elsewhere
    if len(data) > settings.max_files_bytes:
        raise PayloadTooLarge(
            f"the file has {len(data)} bytes, more than the limit of {settings.max_files_bytes} (PTC_MAX_FILES_BYTES)",
            ("body",),
            settings.max_files_bytes,
        )
    written = await sessions.put_file(session_id, who, name, data)
    return Response(SessionFile.model_validate(written).model_dump_json().encode(), media_type="application/json")


@router.get(
    "/sessions/{session_id}/files/{path:path}",
    response_class=Response,
    responses={
        200: {"description": "The file's bytes (content type guessed from its name).", **_RAW},
        404: {},
        409: {},
        422: {},
        503: {},
    },
)
async def get_session_file(session_id: str, path: str, sessions: Sessions, who: Who, reads: Reads) -> Response:
    """The regular file ``path`` under the session's /tmp (a symlink is never followed: 422 ``file-refused``),
    at the session's turn; at most ``max_output_files_bytes`` (422 ``too_large``). Sent a slice at a time from a
    spool file (``api.reads``); one of the key's ``max_reads_per_key`` answers under way (past them: 429)."""
    name = _file_path(path, outputs=True)
    release = reads.take(who.owner)  # from the read in the sandbox to the last slice sent
    try:
        spooled = await sessions.get_file(session_id, who, name)
    except BaseException:
        release()
        raise
    pieces = holding(output_slices(spooled), release, spooled.close)
    headers = {"content-length": str(spooled.length), **DOWNLOAD_HEADERS}
    return StreamingResponse(pieces, media_type=content_type(name), headers=headers)


@router.get("/sessions/{session_id}/files", response_model=SessionFileList, responses={404: {}, 409: {}, 503: {}})
async def list_session_files(session_id: str, sessions: Sessions, who: Who) -> Response:
    """What is under the session's /tmp (at most ``max_files_listed`` entries; folders are walked, symlinks and
    other non-regular entries listed with ``skipped``), at the session's turn."""
    listed = await sessions.list_files(session_id, who)
    return Response(SessionFileList.model_validate(listed).model_dump_json().encode(), media_type="application/json")
