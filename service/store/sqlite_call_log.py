"""``CallLog`` on SQLite (``sqlite_db``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from service.store.call_log import CallLog, LoggedCall
from service.store.sqlite_db import SQLiteDatabase, transaction


class SQLiteCallLog(CallLog):
    """``CallLog`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def put_spec(self, job_id: str, spec: bytes) -> None:
        await self._db.run(
            lambda db: db.execute("INSERT OR REPLACE INTO job_runs (job_id, spec) VALUES (?, ?)", (job_id, spec))
        )

    async def spec(self, job_id: str) -> bytes | None:
        row = await self._db.run(
            lambda db: db.execute("SELECT spec FROM job_runs WHERE job_id = ?", (job_id,)).fetchone()
        )
        return bytes(row[0]) if row else None

    async def write(self, job_id: str, calls: Sequence[LoggedCall]) -> None:
        if not calls:
            return
        rows = [(job_id, c.seq, c.call_id, c.tool, c.args, c.outcome) for c in calls]

        def insert(db: sqlite3.Connection) -> None:  # the cursor stays on the store's thread (sqlite_blobs)
            with transaction(db):
                db.executemany(
                    "INSERT OR REPLACE INTO job_calls (job_id, seq, call_id, tool, args, outcome) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    rows,
                ).close()

        await self._db.run(insert)

    async def calls(self, job_id: str) -> list[LoggedCall]:
        rows = await self._db.run(
            lambda db: db.execute(
                "SELECT seq, call_id, tool, args, outcome FROM job_calls WHERE job_id = ? ORDER BY seq", (job_id,)
            ).fetchall()
        )
        return [
            LoggedCall(seq, call_id, tool, bytes(args), None if outcome is None else bytes(outcome))
            for seq, call_id, tool, args, outcome in rows
        ]

    async def settle(self, job_id: str, call_id: str, outcome: bytes, over: bytes | None) -> bool:
        replaceable = "outcome IS NULL" if over is None else "(outcome IS NULL OR substr(outcome, 1, ?) = ?)"
        params: tuple[object, ...] = (outcome, job_id, call_id, *(() if over is None else (len(over), over)))

        def update(db: sqlite3.Connection) -> bool:
            with transaction(db):
                cursor = db.execute(
                    f"UPDATE job_calls SET outcome = ? WHERE job_id = ? AND call_id = ? AND {replaceable}", params
                )
                changed = cursor.rowcount > 0
                cursor.close()
                return changed

        return await self._db.run(update)

    async def settled(self, job_id: str, prefix: bytes) -> set[str]:
        rows = await self._db.run(
            lambda db: db.execute(
                "SELECT call_id FROM job_calls WHERE job_id = ? AND substr(outcome, 1, ?) = ?",
                (job_id, len(prefix), prefix),
            ).fetchall()
        )
        return {call_id for (call_id,) in rows}

    async def forget(self, job_id: str) -> None:
        def delete(db: sqlite3.Connection) -> None:
            with transaction(db):  # one transaction: never a call log without its run spec
                db.execute("DELETE FROM job_calls WHERE job_id = ?", (job_id,))
                db.execute("DELETE FROM job_runs WHERE job_id = ?", (job_id,))

        await self._db.run(delete)
