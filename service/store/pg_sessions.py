"""``SessionRecords`` on PostgreSQL (``pg_db``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.fenced_write import FENCED_SESSION_SAVE
from service.store.job_records import storable
from service.store.pg_db import PostgresDatabase, typed_text
from service.store.registry import LIVE_STATES, Incarnation
from service.store.session_records import SESSION_BROKEN, SessionRecords, StoredSession, broken_view, session_row
from service.store.tables import iso, replicas, sessions

s = sessions.c
_FENCED_SAVE = typed_text(FENCED_SESSION_SAVE, sessions)


def _session(row: Any) -> StoredSession:
    return session_row(
        row.session_id,
        row.owner,
        row.instance_id,
        row.instance_epoch,
        row.status,
        row.created_at,
        row.ended_at,
        row.ends_by,
        row.view,
    )


class PostgresSessionRecords(SessionRecords):
    """``SessionRecords`` in a PostgreSQL database.

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
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

        async def run(conn: AsyncConnection) -> bool:
            return (await conn.execute(_FENCED_SAVE, values)).first() is not None

        return await self._db.call("save_session", run, write=True)

    async def get(self, session_id: str) -> StoredSession | None:
        if not storable(session_id):
            return None

        async def run(conn: AsyncConnection) -> StoredSession | None:
            row = (await conn.execute(sa.select(sessions).where(s.session_id == session_id))).first()
            return _session(row) if row else None

        return await self._db.call("get_session", run)

    async def unended(self, owner: str | None) -> list[StoredSession]:
        statement = sa.select(sessions).where(s.ended_at.is_(None))
        if owner is not None:
            statement = statement.where(s.owner == owner)
        statement = statement.order_by(s.created_at, s.session_id)

        async def run(conn: AsyncConnection) -> list[StoredSession]:
            return [_session(row) for row in await conn.execute(statement)]

        return await self._db.call("open_sessions", run)

    async def mark_broken(self, incarnation: Incarnation, reason: str = SESSION_BROKEN) -> list[str]:
        select = (
            sa.select(s.session_id, s.view)
            .where(s.instance_id == incarnation.instance_id, s.instance_epoch == incarnation.epoch)
            .where(s.ended_at.is_(None))
            .with_for_update(skip_locked=True)
        )

        async def run(conn: AsyncConnection) -> list[str]:
            now = datetime.now(UTC)
            broken = []
            for row in (await conn.execute(select)).all():
                update = (
                    sa.update(sessions)
                    .where(s.session_id == row.session_id, s.ended_at.is_(None))
                    .values(status="broken", ended_at=now.isoformat(), view=broken_view(bytes(row.view), now, reason))
                )
                if (await conn.execute(update)).rowcount:
                    broken.append(str(row.session_id))
            return broken

        return await self._db.call("break_sessions", run, write=True)

    async def orphan_holders(self) -> list[Incarnation]:
        r = replicas.c
        alive = sa.exists().where(r.instance_id == s.instance_id, r.epoch == s.instance_epoch, r.state.in_(LIVE_STATES))
        statement = sa.select(s.instance_id, s.instance_epoch).where(s.ended_at.is_(None), ~alive).distinct()

        async def run(conn: AsyncConnection) -> list[Incarnation]:
            return [Incarnation(row.instance_id, int(row.instance_epoch)) for row in await conn.execute(statement)]

        return await self._db.call("orphan_sessions", run)
