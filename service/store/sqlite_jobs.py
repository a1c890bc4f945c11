"""``JobRecords`` on SQLite (``sqlite_db``): one replica's jobs."""

from __future__ import annotations

import sqlite3
from datetime import datetime

from service.store.fenced_write import FENCED_JOB_SAVE
from service.store.job_records import JobQuery, JobRecords, StoredJob, decode_cursor, next_cursor, storable
from service.store.registry import Incarnation
from service.store.sqlite_db import SQLiteDatabase, transaction
from service.store.sqlite_ledger import add_delivering, add_pending
from service.store.tables import iso

_COLUMNS = "job_id, status, instance_id, created_at, ended_at, view, summary, callback_pending, owner"
_READ_COLUMNS = _COLUMNS + ", instance_epoch"
_SUMMARY_COLUMNS = (
    "job_id, status, instance_id, created_at, ended_at, x'', summary, callback_pending, owner, instance_epoch"
)


def _row(row: tuple[str, str, str, str, str | None, bytes, bytes, int, str | None, int | None]) -> StoredJob:
    job_id, status, instance_id, created, ended, view, summary, pending, owner, epoch = row
    return StoredJob(
        job_id,
        status,
        instance_id,
        datetime.fromisoformat(created),
        datetime.fromisoformat(ended) if ended else None,
        bytes(view),
        bytes(summary),
        bool(pending),
        owner,
        epoch,
    )


class SQLiteJobRecords(JobRecords):
    """``JobRecords`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def put(self, job: StoredJob) -> None:
        values = (job.job_id, job.status, job.instance_id, iso(job.created_at), iso(job.ended_at))
        await self._db.run(
            lambda db: db.execute(
                f"INSERT OR REPLACE INTO jobs ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*values, job.view, job.summary, int(job.callback_pending), job.owner),
            ).close()
        )

    async def get(self, job_id: str) -> StoredJob | None:
        if not storable(job_id):
            return None
        row = await self._db.run(
            lambda db: db.execute(f"SELECT {_READ_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        )
        return _row(row) if row else None

    async def page(self, query: JobQuery) -> tuple[list[StoredJob], str | None]:
        where: list[str] = []
        params: list[object] = []
        if query.owner is not None:
            where.append("owner = ?")
            params.append(query.owner)
        if query.statuses:
            where.append(f"status IN ({', '.join('?' * len(query.statuses))})")
            params += list(query.statuses)
        if query.created_after is not None:
            where.append("created_at > ?")
            params.append(query.created_after.isoformat())
        if query.created_before is not None:
            where.append("created_at < ?")
            params.append(query.created_before.isoformat())
        if query.cursor:
            created, job_id = decode_cursor(query.cursor)
            where.append("(created_at, job_id) < (?, ?)")
            params += [created, job_id]
        sql = f"SELECT {_SUMMARY_COLUMNS} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, job_id DESC LIMIT ?"
        params.append(query.limit + 1)
        rows = await self._db.run(lambda db: db.execute(sql, params).fetchall())
        return next_cursor([_row(r) for r in rows], query.limit)

    async def unfinished(self, instance_id: str) -> list[StoredJob]:
        rows = await self._db.run(
            lambda db: db.execute(
                f"SELECT {_READ_COLUMNS} FROM jobs WHERE instance_id = ? AND ended_at IS NULL", (instance_id,)
            ).fetchall()
        )
        return [_row(r) for r in rows]

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
        delivering = job.ended_at is not None and job.callback_pending

        def save(db: sqlite3.Connection) -> bool:
            with transaction(db):  # one transaction: the end and its callback's row, claimed by the owner
                written = bool(db.execute(FENCED_JOB_SAVE, values).fetchall())
                if written and delivering:
                    add_delivering(db, job.job_id, incarnation)
            return written

        return await self._db.run(save)

    async def save_lost(self, job: StoredJob) -> bool:
        def end(db: sqlite3.Connection) -> bool:
            with transaction(db):  # one transaction: never an ended job without its callback's row
                ended = db.execute(
                    "UPDATE jobs SET status = ?, ended_at = ?, view = ?, summary = ?, callback_pending = ? "
                    "WHERE job_id = ? AND ended_at IS NULL",
                    (job.status, iso(job.ended_at), job.view, job.summary, int(job.callback_pending), job.job_id),
                ).rowcount
                if ended and job.callback_pending:
                    add_pending(db, job.job_id)
            return ended > 0

        return await self._db.run(end)

    async def adopt(self, job_id: str, previous: tuple[str, int | None], owner: tuple[str, int]) -> bool:
        def take(db: sqlite3.Connection) -> bool:
            with transaction(db):
                return (
                    db.execute(
                        "UPDATE jobs SET instance_id = ?, instance_epoch = ? WHERE job_id = ? AND ended_at IS NULL "
                        "AND instance_id = ? AND instance_epoch IS ?",
                        (*owner, job_id, *previous),
                    ).rowcount
                    > 0
                )

        return await self._db.run(take)

    async def purge(self, ended_before: datetime, instance_id: str | None = None) -> list[str]:
        def delete(db: sqlite3.Connection) -> list[str]:
            cutoff = ended_before.isoformat()
            expired = "SELECT job_id FROM jobs WHERE ended_at < ? AND (? IS NULL OR instance_id = ?)"
            given = (cutoff, instance_id, instance_id)
            with transaction(db):  # one transaction: a job never goes without its idempotency key, nor the reverse
                ids = [r[0] for r in db.execute(expired, given)]
                db.execute(f"DELETE FROM idempotency_keys WHERE kind = 'job' AND resource_id IN ({expired})", given)
                db.execute(f"DELETE FROM job_blobs WHERE job_id IN ({expired})", given)
                db.execute(f"DELETE FROM job_calls WHERE job_id IN ({expired})", given)
                db.execute(f"DELETE FROM job_runs WHERE job_id IN ({expired})", given)
                db.execute(f"DELETE FROM callbacks WHERE job_id IN ({expired})", given)  # no foreign keys here
                db.execute(f"DELETE FROM jobs WHERE job_id IN ({expired})", given)
                db.execute("DELETE FROM idempotency_keys WHERE kind = 'session' AND ends_by < ?", (cutoff,))
                db.execute("DELETE FROM idempotency_keys WHERE state = 'claimed' AND created_at < ?", (cutoff,))
                db.execute(
                    "DELETE FROM idempotency_keys WHERE kind = 'job' AND created_at < ? AND NOT EXISTS "
                    "(SELECT 1 FROM jobs WHERE jobs.job_id = idempotency_keys.resource_id)",
                    (cutoff,),
                )
            return ids

        return await self._db.run(delete)

    async def count(self) -> int:
        row = await self._db.run(lambda db: db.execute("SELECT COUNT(*) FROM jobs").fetchone())
        return int(row[0])

    async def orphans(self, limit: int) -> list[StoredJob]:
        return []  # one replica, whose own leftovers its start-up marks
