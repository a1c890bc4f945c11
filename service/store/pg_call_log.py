"""``CallLog`` on PostgreSQL (``pg_db``): any replica resumes a durable job from it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.call_log import CallLog, LoggedCall
from service.store.pg_db import PostgresDatabase
from service.store.tables import job_calls, job_runs


class PostgresCallLog(CallLog):
    """``CallLog`` in a PostgreSQL database (``bytea``).

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def put_spec(self, job_id: str, spec: bytes) -> None:
        statement = insert(job_runs).values(job_id=job_id, spec=spec)
        statement = statement.on_conflict_do_update(
            index_elements=[job_runs.c.job_id], set_={"spec": statement.excluded.spec}
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)

        await self._db.call("put_spec", run, write=True)

    async def spec(self, job_id: str) -> bytes | None:
        statement = sa.select(job_runs.c.spec).where(job_runs.c.job_id == job_id)

        async def run(conn: AsyncConnection) -> bytes | None:
            value = (await conn.execute(statement)).scalar_one_or_none()
            return bytes(value) if value is not None else None

        return await self._db.call("get_spec", run)

    async def write(self, job_id: str, calls: Sequence[LoggedCall]) -> None:
        if not calls:
            return
        last = {c.seq: c for c in calls}  # a seq given twice: its last, as on SQLite (one statement updates a row once)
        statement = insert(job_calls).values([{"job_id": job_id, **dataclasses.asdict(c)} for c in last.values()])
        statement = statement.on_conflict_do_update(
            index_elements=[job_calls.c.job_id, job_calls.c.seq],
            set_={name: statement.excluded[name] for name in ("call_id", "tool", "args", "outcome")},
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)

        await self._db.call("write_calls", run, write=True)

    async def calls(self, job_id: str) -> list[LoggedCall]:
        c = job_calls.c
        statement = sa.select(c.seq, c.call_id, c.tool, c.args, c.outcome).where(c.job_id == job_id).order_by(c.seq)

        async def run(conn: AsyncConnection) -> list[LoggedCall]:
            return [
                LoggedCall(
                    row.seq, row.call_id, row.tool, bytes(row.args), None if row.outcome is None else bytes(row.outcome)
                )
                for row in await conn.execute(statement)
            ]

        return await self._db.call("read_calls", run)

    async def settle(self, job_id: str, call_id: str, outcome: bytes, over: bytes | None) -> bool:
        c = job_calls.c
        replaceable: sa.ColumnElement[bool] = c.outcome.is_(None)
        if over is not None:
            replaceable = sa.or_(replaceable, sa.func.substr(c.outcome, 1, len(over)) == over)
        statement = (
            sa.update(job_calls)
            .where(c.job_id == job_id, c.call_id == call_id, replaceable)
            .values(outcome=outcome)
            .returning(c.seq)
        )

        async def run(conn: AsyncConnection) -> bool:
            return (await conn.execute(statement)).first() is not None

        return await self._db.call("settle_call", run, write=True)

    async def settled(self, job_id: str, prefix: bytes) -> set[str]:
        c = job_calls.c
        statement = sa.select(c.call_id).where(c.job_id == job_id, sa.func.substr(c.outcome, 1, len(prefix)) == prefix)

        async def run(conn: AsyncConnection) -> set[str]:
            return {row.call_id for row in await conn.execute(statement)}

        return await self._db.call("settled_calls", run)

    async def forget(self, job_id: str) -> None:
        async def run(conn: AsyncConnection) -> None:  # one transaction: never a call log without its run spec
            await conn.execute(sa.delete(job_calls).where(job_calls.c.job_id == job_id))
            await conn.execute(sa.delete(job_runs).where(job_runs.c.job_id == job_id))

        await self._db.call("forget_run", run, write=True)
