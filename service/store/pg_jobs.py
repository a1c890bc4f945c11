"""``JobRecords`` on PostgreSQL (``pg_db``): the jobs of every replica sharing the database, and their
notifications (``ptc_jobs``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.fenced_write import FENCED_JOB_SAVE
from service.store.job_records import JobQuery, JobRecords, StoredJob, decode_cursor, next_cursor, storable
from service.store.pg_db import JOBS_CHANNEL, PostgresDatabase, notify, typed_text
from service.store.pg_ledger import add_delivering, add_pending
from service.store.registry import LIVE_STATES, Incarnation
from service.store.tables import idempotency_keys, iso, job_blobs, job_calls, job_runs, jobs, replicas

_JOB_COLUMNS = (
    jobs.c.job_id,
    jobs.c.status,
    jobs.c.instance_id,
    jobs.c.created_at,
    jobs.c.ended_at,
    jobs.c.view,
    jobs.c.summary,
    jobs.c.callback_pending,
    jobs.c.owner,
    jobs.c.instance_epoch,
)
_SUMMARY_COLUMNS = tuple(c for c in _JOB_COLUMNS if c is not jobs.c.view)
_FENCED_SAVE = typed_text(FENCED_JOB_SAVE, jobs)


def _job(row: Any, with_view: bool = True) -> StoredJob:
    return StoredJob(
        row.job_id,
        row.status,
        row.instance_id,
        datetime.fromisoformat(row.created_at),
        datetime.fromisoformat(row.ended_at) if row.ended_at else None,
        bytes(row.view) if with_view else b"",
        bytes(row.summary),
        bool(row.callback_pending),
        row.owner,
        row.instance_epoch,
    )


class PostgresJobRecords(JobRecords):
    """``JobRecords`` in a PostgreSQL database.

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def put(self, job: StoredJob) -> None:
        values = {
            "job_id": job.job_id,
            "status": job.status,
            "instance_id": job.instance_id,
            "created_at": iso(job.created_at),
            "ended_at": iso(job.ended_at),
            "view": job.view,
            "summary": job.summary,
            "callback_pending": int(job.callback_pending),
            "owner": job.owner,
        }
        statement = insert(jobs).values(values)
        statement = statement.on_conflict_do_update(
            index_elements=[jobs.c.job_id], set_={k: statement.excluded[k] for k in values if k != "job_id"}
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)
            if job.ended_at is not None:  # an ended job re-saved (marked lost, a callback's state): caches drop it
                await notify(conn, JOBS_CHANNEL, f"{job.job_id} saved")

        await self._db.call("put", run, write=True)

    async def get(self, job_id: str) -> StoredJob | None:
        if not storable(job_id):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None

        async def run(conn: AsyncConnection) -> StoredJob | None:
            row = (await conn.execute(sa.select(*_JOB_COLUMNS).where(jobs.c.job_id == job_id))).first()
            return _job(row) if row else None

        return await self._db.call("get", run)

    async def page(self, query: JobQuery) -> tuple[list[StoredJob], str | None]:
        statement = sa.select(*_SUMMARY_COLUMNS)
        if query.owner is not None:
            statement = statement.where(jobs.c.owner == query.owner)
        if query.statuses:
            statement = statement.where(jobs.c.status.in_(list(query.statuses)))
        if query.created_after is not None:
            statement = statement.where(jobs.c.created_at > query.created_after.isoformat())
        if query.created_before is not None:
            statement = statement.where(jobs.c.created_at < query.created_before.isoformat())
        if query.cursor:
            created, job_id = decode_cursor(query.cursor)
            after = sa.tuple_(sa.literal(created), sa.literal(job_id))
            statement = statement.where(sa.tuple_(jobs.c.created_at, jobs.c.job_id) < after)
        statement = statement.order_by(jobs.c.created_at.desc(), jobs.c.job_id.desc()).limit(query.limit + 1)

        async def run(conn: AsyncConnection) -> list[StoredJob]:
            return [_job(row, with_view=False) for row in await conn.execute(statement)]

        return next_cursor(await self._db.call("page", run), query.limit)

    async def _jobs(self, operation: str, statement: sa.Select[Any]) -> list[StoredJob]:
        async def run(conn: AsyncConnection) -> list[StoredJob]:
            return [_job(row) for row in await conn.execute(statement)]

        return await self._db.call(operation, run)

    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        where = sa.and_(jobs.c.instance_id == instance_id, jobs.c.ended_at.is_(None))
        return await self._jobs("unfinished", sa.select(*_JOB_COLUMNS).where(where))

    async def orphans(self, limit: int) -> list[StoredJob]:
        r = replicas.c
        alive = sa.exists().where(
            r.instance_id == jobs.c.instance_id, r.epoch == jobs.c.instance_epoch, r.state.in_(LIVE_STATES)
        )
        return await self._jobs(
            "orphans", sa.select(*_JOB_COLUMNS).where(jobs.c.ended_at.is_(None), ~alive).limit(limit)
        )

    async def save(self, job: StoredJob, incarnation: Incarnation) -> bool:
        values = {
            "job_id": job.job_id,
            "status": job.status,
            "instance_id": incarnation.instance_id,  # the owner's, whatever ``job`` says
            "created_at": iso(job.created_at),
            "ended_at": iso(job.ended_at),
            "view": job.view,
            "summary": job.summary,
            "callback_pending": int(job.callback_pending),
            "owner": job.owner,
            "instance_epoch": incarnation.epoch,
        }
        word = "ended" if job.ended_at is not None else "waiting" if job.status == "waiting" else None
        delivering = job.ended_at is not None and job.callback_pending

        async def run(conn: AsyncConnection) -> bool:
            if (await conn.execute(_FENCED_SAVE, values)).first() is None:  # fenced: nothing written
                return False
            if word is not None:  # in the transaction: delivered only once the row is committed
                await notify(conn, JOBS_CHANNEL, f"{job.job_id} {word}")
            if delivering:  # the end and its callback's row, claimed by the owner, in one transaction
                await add_delivering(conn, job.job_id, incarnation)
            return True

        return await self._db.call("save", run, write=True)

    async def save_lost(self, job: StoredJob) -> bool:
        end = (
            sa.update(jobs)
            .where(jobs.c.job_id == job.job_id, jobs.c.ended_at.is_(None))
            .values(
                status=job.status,
                ended_at=iso(job.ended_at),
                view=job.view,
                summary=job.summary,
                callback_pending=int(job.callback_pending),
            )
        )

        async def run(conn: AsyncConnection) -> bool:
            if not (await conn.execute(end)).rowcount:
                return False
            if job.callback_pending:
                await add_pending(conn, job.job_id)
            await notify(conn, JOBS_CHANNEL, f"{job.job_id} ended")
            return True

        return await self._db.call("save_lost", run, write=True)

    async def adopt(self, job_id: str, previous: tuple[str, int | None], owner: tuple[str, int]) -> bool:
        epoch = jobs.c.instance_epoch.is_(None) if previous[1] is None else jobs.c.instance_epoch == previous[1]
        take = (
            sa.update(jobs)
            .where(jobs.c.job_id == job_id, jobs.c.ended_at.is_(None), jobs.c.instance_id == previous[0], epoch)
            .values(instance_id=owner[0], instance_epoch=owner[1])
        )

        async def run(conn: AsyncConnection) -> bool:
            return bool((await conn.execute(take)).rowcount)

        return await self._db.call("adopt", run, write=True)

    async def purge(self, ended_before: datetime, instance_id: str | None = None) -> list[str]:
        cutoff = ended_before.isoformat()
        expired = sa.select(jobs.c.job_id).where(jobs.c.ended_at < cutoff)
        if instance_id is not None:  # each replica its own (see JobRecords.purge)
            expired = expired.where(jobs.c.instance_id == instance_id)

        async def run(
            conn: AsyncConnection,
        ) -> list[str]:  # one transaction, as in SQLite; callbacks: ON DELETE CASCADE
            ids = [row.job_id for row in await conn.execute(expired)]
            keys = idempotency_keys.c
            await conn.execute(sa.delete(idempotency_keys).where(keys.kind == "job", keys.resource_id.in_(expired)))
            await conn.execute(sa.delete(job_blobs).where(job_blobs.c.job_id.in_(expired)))
            await conn.execute(sa.delete(job_calls).where(job_calls.c.job_id.in_(expired)))
            await conn.execute(sa.delete(job_runs).where(job_runs.c.job_id.in_(expired)))
            await conn.execute(sa.delete(jobs).where(jobs.c.job_id.in_(expired)))
            await conn.execute(sa.delete(idempotency_keys).where(keys.kind == "session", keys.ends_by < cutoff))
            await conn.execute(sa.delete(idempotency_keys).where(keys.state == "claimed", keys.created_at < cutoff))
            await conn.execute(
                sa.delete(idempotency_keys).where(
                    keys.kind == "job",
                    keys.created_at < cutoff,
                    ~sa.exists().where(jobs.c.job_id == keys.resource_id),
                )
            )
            return ids

        return await self._db.call("purge", run, write=True)

    async def count(self) -> int:
        async def run(conn: AsyncConnection) -> int:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(jobs))).scalar_one())

        return await self._db.call("count", run)
