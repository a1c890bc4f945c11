"""``JobBlobs`` on SQLite (``sqlite_db``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping

from service.store.blobs import JobBlobs
from service.store.job_records import storable
from service.store.sqlite_db import SQLiteDatabase


class SQLiteJobBlobs(JobBlobs):
    """``JobBlobs`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def put(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        rows = [(job_id, name, data) for name, data in blobs.items()]

        def insert(db: sqlite3.Connection) -> None:  # the cursor stays on the store's thread (see below)
            db.executemany("INSERT OR REPLACE INTO job_blobs VALUES (?, ?, ?)", rows).close()

        # An executemany cursor handed back to the event loop is finalized there, while the store's thread runs the
        # next statement: concurrent calls then failed with "bad parameter or other API misuse".
        await self._db.run(insert)

    async def read(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        if not storable(job_id, name):
            return None
        params: tuple[int, ...]
        if length is None:  # substr counts from 1
            sql, params = "SELECT substr(data, ?) FROM job_blobs WHERE job_id = ? AND name = ?", (offset + 1,)
        else:
            sql, params = "SELECT substr(data, ?, ?) FROM job_blobs WHERE job_id = ? AND name = ?", (offset + 1, length)
        row = await self._db.run(lambda db: db.execute(sql, (*params, job_id, name)).fetchone())
        return bytes(row[0] or b"") if row else None  # substr of an empty blob is NULL

    async def sizes(self, job_id: str) -> dict[str, int]:
        if not storable(job_id):
            return {}
        rows = await self._db.run(
            lambda db: db.execute("SELECT name, length(data) FROM job_blobs WHERE job_id = ?", (job_id,)).fetchall()
        )
        return {name: int(size) for name, size in rows}
