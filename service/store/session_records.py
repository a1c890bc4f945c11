"""Session records (table ``sessions``; docs/scaling.md, Sessions): each session's owning incarnation and its view
(JSON) as last saved, at its creation and at its end.

``SessionRecords`` is the resource's interface; ``sqlite_sessions`` and ``pg_sessions`` implement it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from service.store.registry import Incarnation


@dataclass(frozen=True)
class StoredSession:
    """One session's row: where it lives and its view as last saved.

    Attributes:
        session_id / owner: its id and the key name that created it.
        instance_id / instance_epoch: the incarnation holding its sandbox.
        status: its status when saved (``ready`` while open; ``closed``, ``expired``, ``broken`` once ended).
        created_at / ended_at / ends_by: UTC times; ``ends_by``: the end of its lifetime (``max_lifetime_s``).
        view: its view (``schemas.session_models.SessionView``) as JSON bytes.
    """

    session_id: str
    owner: str
    instance_id: str
    instance_epoch: int
    status: str
    created_at: datetime
    ended_at: datetime | None
    ends_by: datetime
    view: bytes


SESSION_BROKEN = "the replica holding its sandbox stopped"
"""The error message of a session marked ``broken`` because its incarnation died (``SessionRecords.mark_broken``)."""


def broken_view(view: bytes, ended_at: datetime, reason: str = SESSION_BROKEN) -> bytes:
    """A stored session view (JSON bytes) as ``broken`` at ``ended_at``: no script runs or waits there any more."""
    data = json.loads(view)
    data.update(
        status="broken",
        ended_at=ended_at.isoformat(),
        expires_at=None,
        current_job_id=None,
        queued=0,
        error={"type": "session_broken", "message": reason},
    )
    return json.dumps(data, separators=(",", ":")).encode()


def session_row(
    session_id: str,
    owner: str,
    instance_id: str,
    instance_epoch: int,
    status: str,
    created_at: str,
    ended_at: str | None,
    ends_by: str,
    view: bytes | str,
) -> StoredSession:
    """A row of ``sessions`` (times as ISO text, as both stores keep them) as a ``StoredSession``."""
    return StoredSession(
        str(session_id),
        str(owner),
        str(instance_id),
        int(instance_epoch),
        str(status),
        datetime.fromisoformat(created_at),
        datetime.fromisoformat(ended_at) if ended_at else None,
        datetime.fromisoformat(ends_by),
        view.encode() if isinstance(view, str) else bytes(view),
    )


class SessionRecords(Protocol):
    """Sessions as stored. Coroutines, safe to call concurrently."""

    async def save(self, session: StoredSession, incarnation: Incarnation) -> bool:
        """Save a session ``incarnation`` holds (at its creation and at its end), fenced like a job's
        (``fenced_write``): inserted only while the incarnation is ``live`` or ``draining``, replaced only while
        the row is still its and not ended. Returns whether a row was written (False: fenced)."""
        ...

    async def get(self, session_id: str) -> StoredSession | None:
        """One session's row, or None."""
        ...

    async def unended(self, owner: str | None) -> list[StoredSession]:
        """The sessions not ended (of ``owner``; None: every owner's), oldest first."""
        ...

    async def mark_broken(self, incarnation: Incarnation, reason: str = SESSION_BROKEN) -> list[str]:
        """Mark every session of ``incarnation`` that has not ended ``broken`` (its view too: ``broken_view``),
        each only if it is still not ended (a racing end by its owner wins); returns their ids. For the reaper of
        a dead incarnation (docs/scaling.md, Lost jobs and broken sessions)."""
        ...

    async def orphan_holders(self) -> list[Incarnation]:
        """The incarnations that hold sessions not ended and are not live or draining (expired by a replica that
        stopped before it marked their sessions ``broken``, or replaced by a later epoch): for ``mark_broken``.
        ``[]`` on SQLite (one replica)."""
        ...
