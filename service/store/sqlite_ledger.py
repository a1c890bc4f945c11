"""``CallbackLedger`` on SQLite (``sqlite_db``), and the rows a job's end writes in its own transaction."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime

from service.store.job_records import storable
from service.store.ledger import CLAIM_SCAN, CallbackClaim, CallbackLedger, CallbackRow, choose_claims
from service.store.registry import Incarnation
from service.store.sqlite_db import SQLiteDatabase, is_live, transaction

_CLAIMABLE = """SELECT c.job_id, j.owner, c.attempts, c.state FROM callbacks c JOIN jobs j ON j.job_id = c.job_id
WHERE (c.state = 'pending' AND c.next_attempt_at <= ?) OR (c.state = 'delivering' AND NOT EXISTS (
    SELECT 1 FROM replicas r WHERE r.instance_id = c.claimed_by AND r.epoch = c.claimed_epoch
        AND r.state IN ('live', 'draining')))
ORDER BY c.next_attempt_at, c.job_id LIMIT ?"""
"""Due callbacks (``CallbackLedger.claim``): pending and due, or claimed by an incarnation that is not live."""


def add_delivering(db: sqlite3.Connection, job_id: str, incarnation: Incarnation) -> None:
    """In the caller's transaction: the ``callbacks`` row of a job its owner just ended, ``delivering``, claimed
    by ``incarnation`` (``JobRecords.save``); nothing when the row exists."""
    db.execute(
        "INSERT OR IGNORE INTO callbacks (job_id, state, claimed_by, claimed_epoch, attempts, next_attempt_at) "
        "VALUES (?, 'delivering', ?, ?, 0, ?)",
        (job_id, incarnation.instance_id, incarnation.epoch, datetime.now(UTC).isoformat()),
    )


def add_pending(db: sqlite3.Connection, job_id: str) -> None:
    """In the caller's transaction: the ``callbacks`` row of a job ended by someone other than its owner (marked
    lost: ``JobRecords.save_lost``), ``pending`` and due now; nothing when the row exists."""
    db.execute(
        "INSERT OR IGNORE INTO callbacks (job_id, state, attempts, next_attempt_at) VALUES (?, 'pending', 0, ?)",
        (job_id, datetime.now(UTC).isoformat()),
    )


class SQLiteCallbackLedger(CallbackLedger):
    """``CallbackLedger`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def claim(
        self, incarnation: Incarnation, limit: int, room: Callable[[str | None], int]
    ) -> list[CallbackClaim]:
        if limit <= 0:
            return []

        def claim(db: sqlite3.Connection) -> list[CallbackClaim]:
            if not db.execute(_CLAIMABLE, (datetime.now(UTC).isoformat(), 1)).fetchall():
                return []  # the usual answer of a scan: no write lock taken for it
            with transaction(db, immediate=True):  # the file's write lock: one claim at a time
                if not is_live(db, incarnation):
                    chosen: list[CallbackClaim] = []
                else:
                    rows = db.execute(_CLAIMABLE, (datetime.now(UTC).isoformat(), limit * CLAIM_SCAN)).fetchall()
                    chosen = choose_claims(rows, limit, room)
                    db.executemany(
                        "UPDATE callbacks SET state = 'delivering', claimed_by = ?, claimed_epoch = ? WHERE job_id = ?",
                        [(incarnation.instance_id, incarnation.epoch, c.job_id) for c in chosen],
                    ).close()
            return chosen

        return await self._db.run(claim)

    async def end(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        return await self._db.changed(
            "UPDATE callbacks SET state = ?, attempts = ? WHERE job_id = ? AND claimed_by = ? "
            "AND claimed_epoch = ? AND state = 'delivering'",
            (state, attempts, job_id, incarnation.instance_id, incarnation.epoch),
        )

    async def get(self, job_id: str) -> CallbackRow | None:
        if not storable(job_id):
            return None
        row = await self._db.run(
            lambda db: db.execute(
                "SELECT state, claimed_by, claimed_epoch, attempts FROM callbacks WHERE job_id = ?", (job_id,)
            ).fetchone()
        )
        if row is None:
            return None
        state, by, epoch, attempts = row
        return CallbackRow(job_id, state, Incarnation(by, int(epoch)) if by is not None else None, int(attempts))
