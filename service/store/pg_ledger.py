"""``CallbackLedger`` on PostgreSQL (``pg_db``), and the rows a job's end writes in its own transaction."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.job_records import storable
from service.store.ledger import CLAIM_SCAN, CallbackClaim, CallbackLedger, CallbackRow, choose_claims
from service.store.pg_db import CALLBACKS_CHANNEL, PostgresDatabase, is_live, notify
from service.store.registry import LIVE_STATES, Incarnation
from service.store.tables import callbacks, jobs, replicas


async def add_delivering(conn: AsyncConnection, job_id: str, incarnation: Incarnation) -> None:
    """In ``conn``'s transaction: the ``callbacks`` row of a job its owner just ended, ``delivering``, claimed by
    ``incarnation`` (``JobRecords.save``); nothing when the row exists."""
    await conn.execute(
        insert(callbacks)
        .values(
            job_id=job_id,
            state="delivering",
            claimed_by=incarnation.instance_id,
            claimed_epoch=incarnation.epoch,
            attempts=0,
            next_attempt_at=sa.func.now(),
        )
        .on_conflict_do_nothing(index_elements=[callbacks.c.job_id])
    )


async def add_pending(conn: AsyncConnection, job_id: str) -> None:
    """In ``conn``'s transaction: the ``callbacks`` row of a job just ended by someone other than its owner (marked
    lost: ``JobRecords.save_lost``), ``pending`` and due now, and a ``ptc_callbacks`` notification (sent at
    commit) that wakes every replica's callback worker; nothing when the row exists."""
    await conn.execute(
        insert(callbacks)
        .values(job_id=job_id, state="pending", attempts=0, next_attempt_at=sa.func.now())
        .on_conflict_do_nothing(index_elements=[callbacks.c.job_id])
    )
    await notify(conn, CALLBACKS_CHANNEL, job_id)


class PostgresCallbackLedger(CallbackLedger):
    """``CallbackLedger`` in a PostgreSQL database (``next_attempt_at``: the database's ``now()``).

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def claim(
        self, incarnation: Incarnation, limit: int, room: Callable[[str | None], int]
    ) -> list[CallbackClaim]:
        if limit <= 0:
            return []
        c, r = callbacks.c, replicas.c
        claimer_live = sa.exists().where(
            r.instance_id == c.claimed_by, r.epoch == c.claimed_epoch, r.state.in_(LIVE_STATES)
        )
        candidates = (
            sa.select(c.job_id, jobs.c.owner, c.attempts, c.state)
            .join(jobs, jobs.c.job_id == c.job_id)
            .where(
                sa.or_(
                    sa.and_(c.state == "pending", c.next_attempt_at <= sa.func.now()),
                    sa.and_(c.state == "delivering", ~claimer_live),
                ),
                is_live(incarnation),
            )
            .order_by(c.next_attempt_at, c.job_id)
            .limit(limit * CLAIM_SCAN)
            .with_for_update(of=callbacks, skip_locked=True)
        )

        async def run(conn: AsyncConnection) -> list[CallbackClaim]:
            rows = [(row.job_id, row.owner, row.attempts, row.state) for row in await conn.execute(candidates)]
            chosen = choose_claims(rows, limit, room)
            if chosen:  # the rows are locked by this transaction: nobody else claims them meanwhile
                await conn.execute(
                    sa.update(callbacks)
                    .where(c.job_id.in_([claim.job_id for claim in chosen]))
                    .values(state="delivering", claimed_by=incarnation.instance_id, claimed_epoch=incarnation.epoch)
                )
            return chosen

        return await self._db.call("claim_callbacks", run, write=True)

    async def end(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        c = callbacks.c
        statement = (
            sa.update(callbacks)
            .where(
                c.job_id == job_id,
                c.claimed_by == incarnation.instance_id,
                c.claimed_epoch == incarnation.epoch,
                c.state == "delivering",
            )
            .values(state=state, attempts=attempts)
        )

        async def run(conn: AsyncConnection) -> bool:
            return bool((await conn.execute(statement)).rowcount)

        return await self._db.call("end_callback", run, write=True)

    async def get(self, job_id: str) -> CallbackRow | None:
        if not storable(job_id):
            return None
        c = callbacks.c
        statement = sa.select(c.state, c.claimed_by, c.claimed_epoch, c.attempts).where(c.job_id == job_id)

        async def run(conn: AsyncConnection) -> CallbackRow | None:
            row = (await conn.execute(statement)).first()
            if row is None:
                return None
            by = Incarnation(row.claimed_by, int(row.claimed_epoch)) if row.claimed_by is not None else None
            return CallbackRow(job_id, row.state, by, int(row.attempts))

        return await self._db.call("callback", run)
