"""``SessionRecords`` on SQLite (``sqlite_db``)."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime

from service.store.fenced_write import FENCED_SESSION_SAVE
from service.store.job_records import storable
from service.store.registry import Incarnation
from service.store.session_records import SESSION_BROKEN, SessionRecords, StoredSession, broken_view, session_row
from service.store.sqlite_db import SQLiteDatabase
from service.store.tables import iso

_COLUMNS = "session_id, owner, instance_id, instance_epoch, status, created_at, ended_at, ends_by, view"


class SQLiteSessionRecords(SessionRecords):
    """``SessionRecords`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def save(self, session: StoredSession, incarnation: Incarnation) -> bool:
        values = {
            "session_id": session.session_id,
            "owner": session.owner,
            "instance_id": incarnation.instance_id,
            "instance_epoch": incarnation.epoch,
            "status": session.status,
            "created_at": iso(session.created_at),
            "ended_at": iso(session.ended_at),
            "ends_by": iso(session.ends_by),
            "view": session.view,
        }
        return await self._db.run(lambda db: bool(db.execute(FENCED_SESSION_SAVE, values).fetchall()))

    async def get(self, session_id: str) -> StoredSession | None:
        if not storable(session_id):
            return None
        row = await self._db.run(
            lambda db: db.execute(f"SELECT {_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        )
        return session_row(*row) if row else None

    async def unended(self, owner: str | None) -> list[StoredSession]:
        where, params = ("AND owner = ?", (owner,)) if owner is not None else ("", ())
        sql = f"SELECT {_COLUMNS} FROM sessions WHERE ended_at IS NULL {where} ORDER BY created_at, session_id"
        rows = await self._db.run(lambda db: db.execute(sql, params).fetchall())
        return [session_row(*row) for row in rows]

    async def mark_broken(self, incarnation: Incarnation, reason: str = SESSION_BROKEN) -> list[str]:
        def mark(db: sqlite3.Connection) -> list[str]:
            now = datetime.now(UTC)
            broken = []
            rows = db.execute(
                "SELECT session_id, view FROM sessions WHERE instance_id = ? AND instance_epoch = ? "
                "AND ended_at IS NULL",
                (incarnation.instance_id, incarnation.epoch),
            ).fetchall()
            for session_id, view in rows:
                cursor = db.execute(
                    "UPDATE sessions SET status = 'broken', ended_at = ?, view = ? "
                    "WHERE session_id = ? AND ended_at IS NULL",
                    (now.isoformat(), broken_view(bytes(view), now, reason), session_id),
                )
                if cursor.rowcount:
                    broken.append(str(session_id))
            return broken

        return await self._db.run(mark)

    async def orphan_holders(self) -> list[Incarnation]:
        return []  # one replica
