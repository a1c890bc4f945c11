"""``ToolsetManifests`` on PostgreSQL (``pg_db``)."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.job_records import storable
from service.store.manifests import ToolsetManifests
from service.store.pg_db import PostgresDatabase
from service.store.tables import toolset_owners, toolsets


class PostgresToolsetManifests(ToolsetManifests):
    """``ToolsetManifests`` in a PostgreSQL database.

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def put(self, toolset_id: str, manifest: bytes, owner: str) -> None:
        created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"  # as SQLite's default
        add_toolset = (
            insert(toolsets)
            .values(toolset_id=toolset_id, manifest=manifest, created_at=created)
            .on_conflict_do_nothing(index_elements=[toolsets.c.toolset_id])
        )
        add_owner = (
            insert(toolset_owners)
            .values(toolset_id=toolset_id, owner=owner)
            .on_conflict_do_nothing(index_elements=[toolset_owners.c.toolset_id, toolset_owners.c.owner])
        )

        async def run(conn: AsyncConnection) -> None:  # one transaction: never a toolset without its owner
            await conn.execute(add_toolset)
            await conn.execute(add_owner)

        await self._db.call("put_toolset", run, write=True)

    async def get(self, toolset_id: str, owner: str | None) -> bytes | None:
        if not storable(toolset_id):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None
        statement = sa.select(toolsets.c.manifest).where(toolsets.c.toolset_id == toolset_id)
        if owner is not None:
            statement = statement.join(toolset_owners, toolset_owners.c.toolset_id == toolsets.c.toolset_id).where(
                toolset_owners.c.owner == owner
            )

        async def run(conn: AsyncConnection) -> bytes | None:
            value = (await conn.execute(statement)).scalar_one_or_none()
            return bytes(value) if value is not None else None

        return await self._db.call("get_toolset", run)
