"""The sessions resource: ``/sessions`` (create, list, view, delete)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.bodies import ParsedOffLoop
from service.api.deps import AppSettings, Key, Sessions, Who
from service.limits import check_session
from service.schemas import SessionList, SessionRequest, SessionView

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
    responses={201: {"headers": _LOCATION}, 422: {}, 429: {}, 503: {}},
)
async def create_session(
    body: SessionRequest, sessions: Sessions, who: Who, settings: AppSettings, key: Key
) -> Response:
    """Start a session: a sandbox kept for a conversation's scripts (``/execute`` with ``session_id``).

    Answers 201 (``Location: /sessions/{id}``) once the sandbox is ready. Its files under ``/tmp`` persist
    between scripts; it ends after ``idle_timeout_s`` without a script, at ``max_lifetime_s``, or on DELETE.
    """
    check_session(body, settings, key)
    return json_session(await sessions.create_session(body, who.owner, admin=who.admin), 201)


@router.get("/sessions", response_model=SessionList)
async def list_sessions(sessions: Sessions, who: Who) -> Response:
    """The caller's open sessions (the admin role: every owner's), oldest first."""
    body = SessionList.model_validate({"sessions": sessions.sessions(who)}).model_dump_json().encode()
    return Response(body, media_type="application/json")


@router.get("/sessions/{session_id}", response_model=SessionView, responses={404: {}})
async def get_session(session_id: str, sessions: Sessions, who: Who) -> Response:
    """A session's view (ended sessions stay visible for a while, up to the last 1,000)."""
    return json_session(sessions.session_view(session_id, who))


@router.delete("/sessions/{session_id}", response_model=SessionView, responses={404: {}})
async def delete_session(session_id: str, sessions: Sessions, who: Who) -> Response:
    """End a session: its running script is stopped, queued ones end ``stopped``, its sandbox is removed.

    Idempotent: deleting an ended session returns its view unchanged.
    """
    return json_session(await sessions.delete_session(session_id, who))
