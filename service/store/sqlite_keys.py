"""``KeyBindings`` on SQLite (``sqlite_db``)."""

from __future__ import annotations

import sqlite3
from datetime import datetime

from service.store.job_records import storable
from service.store.keys import IdempotencyRecord, KeyBindings, KeyClaim, held_key
from service.store.sqlite_db import SQLiteDatabase, is_live, transaction
from service.store.tables import iso

_COLUMNS = (
    "owner, key, fingerprint, kind, resource_id, created_at, ends_by, state, claim_token, claimed_by, claimed_epoch"
)
_BOUND = f"SELECT {_COLUMNS} FROM idempotency_keys WHERE owner = ? AND key = ? AND state = 'bound'"


def _bound(row: tuple[str, str, str, str, str, str, str | None, str, None, None, None]) -> IdempotencyRecord:
    record = held_key(*row)
    assert isinstance(record, IdempotencyRecord)
    return record


class SQLiteKeyBindings(KeyBindings):
    """``KeyBindings`` in one SQLite file.

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def bind(self, record: IdempotencyRecord) -> IdempotencyRecord:
        def bind(db: sqlite3.Connection) -> IdempotencyRecord:
            db.execute(
                "INSERT OR IGNORE INTO idempotency_keys (owner, key, fingerprint, kind, resource_id, created_at, "
                "ends_by) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.owner,
                    record.key,
                    record.fingerprint,
                    record.kind,
                    record.resource_id,
                    iso(record.created_at),
                    iso(record.ends_by),
                ),
            )
            return _bound(db.execute(_BOUND, (record.owner, record.key)).fetchone())

        return await self._db.run(bind)

    async def claim(
        self, claim: KeyClaim, created_at: datetime, orphan: str | None = None
    ) -> IdempotencyRecord | KeyClaim:
        def take(db: sqlite3.Connection) -> IdempotencyRecord | KeyClaim:
            with transaction(db, immediate=True):  # the file's write lock: the read and the write below are one step
                row = db.execute(
                    f"SELECT {_COLUMNS} FROM idempotency_keys WHERE owner = ? AND key = ?", (claim.owner, claim.key)
                ).fetchone()
                held = None if row is None else held_key(*row)
                claimer = (claim.claim_token, claim.claimed_by.instance_id, claim.claimed_by.epoch)
                if held is None:
                    db.execute(
                        "INSERT INTO idempotency_keys (owner, key, fingerprint, kind, resource_id, created_at, "
                        "ends_by, state, claim_token, claimed_by, claimed_epoch) "
                        "VALUES (?, ?, ?, ?, NULL, ?, NULL, 'claimed', ?, ?, ?)",
                        (claim.owner, claim.key, claim.fingerprint, claim.kind, created_at.isoformat(), *claimer),
                    )
                    held = claim
                elif isinstance(held, KeyClaim) and (held.claim_token == orphan or not is_live(db, held.claimed_by)):
                    db.execute(
                        "UPDATE idempotency_keys SET fingerprint = ?, kind = ?, created_at = ?, claim_token = ?, "
                        "claimed_by = ?, claimed_epoch = ? WHERE owner = ? AND key = ? AND state = 'claimed'",
                        (claim.fingerprint, claim.kind, created_at.isoformat(), *claimer, claim.owner, claim.key),
                    )
                    held = claim
            return held

        return await self._db.run(take)

    async def bind_claim(self, record: IdempotencyRecord, claim_token: str) -> bool:
        values = (
            record.resource_id,
            iso(record.created_at),
            iso(record.ends_by),
            record.fingerprint,
            record.kind,
            record.owner,
            record.key,
            claim_token,
        )
        return await self._db.changed(
            "UPDATE idempotency_keys SET state = 'bound', resource_id = ?, created_at = ?, ends_by = ?, "
            "fingerprint = ?, kind = ? WHERE owner = ? AND key = ? AND state = 'claimed' AND claim_token = ?",
            values,
        )

    async def release(self, owner: str, key: str, claim_token: str) -> bool:
        return await self._db.changed(
            "DELETE FROM idempotency_keys WHERE owner = ? AND key = ? AND state = 'claimed' AND claim_token = ?",
            (owner, key, claim_token),
        )

    async def get(self, owner: str, key: str) -> IdempotencyRecord | None:
        if not storable(owner, key):
            return None
        row = await self._db.run(lambda db: db.execute(_BOUND, (owner, key)).fetchone())
        return _bound(row) if row else None
