"""``ToolsetManifests`` on SQLite (``sqlite_db``)."""

from __future__ import annotations

import sqlite3

from service.store.job_records import storable
from service.store.manifests import ToolsetManifests
from service.store.sqlite_db import SQLiteDatabase, transaction


class SQLiteToolsetManifests(ToolsetManifests):
    """``ToolsetManifests`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def put(self, toolset_id: str, manifest: bytes, owner: str) -> None:
        def insert(db: sqlite3.Connection) -> None:
            with transaction(db):  # one transaction: never a toolset without its owner
                db.execute(
                    "INSERT OR IGNORE INTO toolsets (toolset_id, manifest) VALUES (?, ?)", (toolset_id, manifest)
                )
                db.execute(
                    "INSERT OR IGNORE INTO toolset_owners (toolset_id, owner) VALUES (?, ?)", (toolset_id, owner)
                )

        await self._db.run(insert)

    async def get(self, toolset_id: str, owner: str | None) -> bytes | None:
        if not storable(toolset_id):
            return None
        params: tuple[str, ...]
        if owner is None:
            sql, params = "SELECT manifest FROM toolsets WHERE toolset_id = ?", (toolset_id,)
        else:
            sql = (
                "SELECT manifest FROM toolsets JOIN toolset_owners USING (toolset_id) "
                "WHERE toolset_id = ? AND owner = ?"
            )
            params = (toolset_id, owner)
        row = await self._db.run(lambda db: db.execute(sql, params).fetchone())
        return bytes(row[0]) if row else None
