"""``JobBlobs`` on PostgreSQL (``pg_db``): any replica serves an ended job's output from them."""

from __future__ import annotations

from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.blobs import JobBlobs
from service.store.job_records import storable
from service.store.pg_db import PostgresDatabase
from service.store.tables import job_blobs


class PostgresJobBlobs(JobBlobs):
    """``JobBlobs`` in a PostgreSQL database (``bytea``).

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def put(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        if not blobs:
            return
        statement = insert(job_blobs).values([{"job_id": job_id, "name": n, "data": d} for n, d in blobs.items()])
        statement = statement.on_conflict_do_update(
            index_elements=[job_blobs.c.job_id, job_blobs.c.name], set_={"data": statement.excluded.data}
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)

        await self._db.call("put_blobs", run, write=True)

    async def read(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        if not storable(job_id, name):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None
        part = (
            sa.func.substring(job_blobs.c.data, offset + 1)
            if length is None
            else sa.func.substring(job_blobs.c.data, offset + 1, length)
        )
        statement = sa.select(part.label("data")).where(job_blobs.c.job_id == job_id, job_blobs.c.name == name)

        async def run(conn: AsyncConnection) -> bytes | None:
            value = (await conn.execute(statement)).scalar_one_or_none()
            return bytes(value) if value is not None else None

        return await self._db.call("read_blob", run)

    async def sizes(self, job_id: str) -> dict[str, int]:
        if not storable(job_id):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return {}
        statement = sa.select(job_blobs.c.name, sa.func.length(job_blobs.c.data)).where(job_blobs.c.job_id == job_id)

        async def run(conn: AsyncConnection) -> dict[str, int]:
            return {name: int(size) for name, size in await conn.execute(statement)}

        return await self._db.call("blob_sizes", run)
