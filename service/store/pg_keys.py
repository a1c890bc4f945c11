"""``KeyBindings`` on PostgreSQL (``pg_db``): a bound or released claim notifies ``ptc_keys``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.store.job_records import storable
from service.store.keys import IdempotencyRecord, KeyBindings, KeyClaim, held_key, key_digest
from service.store.pg_db import KEYS_CHANNEL, PostgresDatabase, notify
from service.store.registry import LIVE_STATES
from service.store.tables import idempotency_keys, iso, replicas

k = idempotency_keys.c
_COLUMNS = (
    k.owner,
    k.key,
    k.fingerprint,
    k.kind,
    k.resource_id,
    k.created_at,
    k.ends_by,
    k.state,
    k.claim_token,
    k.claimed_by,
    k.claimed_epoch,
)


def _held(row: Any) -> IdempotencyRecord | KeyClaim:
    return held_key(*row)


def _bound(owner: str, key: str) -> sa.Select[Any]:
    return sa.select(*_COLUMNS).where(k.owner == owner, k.key == key, k.state == "bound")


class PostgresKeyBindings(KeyBindings):
    """``KeyBindings`` in a PostgreSQL database.

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def bind(self, record: IdempotencyRecord) -> IdempotencyRecord:
        statement = (
            insert(idempotency_keys)
            .values(
                owner=record.owner,
                key=record.key,
                fingerprint=record.fingerprint,
                kind=record.kind,
                resource_id=record.resource_id,
                created_at=iso(record.created_at),
                ends_by=iso(record.ends_by),
            )
            .on_conflict_do_nothing(index_elements=[k.owner, k.key])
        )

        async def run(conn: AsyncConnection) -> IdempotencyRecord:
            await conn.execute(statement)
            held = _held((await conn.execute(_bound(record.owner, record.key))).one())
            assert isinstance(held, IdempotencyRecord)
            return held

        return await self._db.call("bind_idempotency_key", run, write=True)

    async def claim(
        self, claim: KeyClaim, created_at: datetime, orphan: str | None = None
    ) -> IdempotencyRecord | KeyClaim:
        claimer = {
            "fingerprint": claim.fingerprint,
            "kind": claim.kind,
            "created_at": created_at.isoformat(),
            "claim_token": claim.claim_token,
            "claimed_by": claim.claimed_by.instance_id,
            "claimed_epoch": claim.claimed_by.epoch,
        }
        new = (
            insert(idempotency_keys)
            .values(owner=claim.owner, key=claim.key, state="claimed", resource_id=None, ends_by=None, **claimer)
            .on_conflict_do_nothing(index_elements=[k.owner, k.key])
            .returning(k.owner)
        )
        live = sa.exists().where(
            replicas.c.instance_id == k.claimed_by,
            replicas.c.epoch == k.claimed_epoch,
            replicas.c.state.in_(LIVE_STATES),
            replicas.c.lease_until > sa.func.now(),
        )
        take_over = (
            sa.update(idempotency_keys)
            .where(
                k.owner == claim.owner,
                k.key == claim.key,
                k.state == "claimed",
                sa.or_(~live, k.claim_token == orphan) if orphan is not None else ~live,
            )
            .values(**claimer)
            .returning(k.owner)
        )
        held = sa.select(*_COLUMNS).where(k.owner == claim.owner, k.key == claim.key)

        async def run(conn: AsyncConnection) -> IdempotencyRecord | KeyClaim:
            while True:  # a row released between the insert and the read: insert again
                if (await conn.execute(new)).first() is not None:  # waits for a racing insert to commit
                    return claim
                if (await conn.execute(take_over)).first() is not None:  # its claimer died
                    return claim
                row = (await conn.execute(held)).first()
                if row is not None:
                    return _held(row)

        return await self._db.call("claim_idempotency_key", run, write=True)

    async def bind_claim(self, record: IdempotencyRecord, claim_token: str) -> bool:
        statement = (
            sa.update(idempotency_keys)
            .where(k.owner == record.owner, k.key == record.key, k.state == "claimed", k.claim_token == claim_token)
            .values(
                state="bound",
                resource_id=record.resource_id,
                created_at=iso(record.created_at),
                ends_by=iso(record.ends_by),
                fingerprint=record.fingerprint,
                kind=record.kind,
            )
            .returning(k.owner)
        )
        return await self._claim_ended("bind_claim", statement, record.owner, record.key)

    async def release(self, owner: str, key: str, claim_token: str) -> bool:
        statement = (
            sa.delete(idempotency_keys)
            .where(k.owner == owner, k.key == key, k.state == "claimed", k.claim_token == claim_token)
            .returning(k.owner)
        )
        return await self._claim_ended("release_claim", statement, owner, key)

    async def _claim_ended(self, operation: str, statement: Any, owner: str, key: str) -> bool:
        """Run ``bind_claim``'s or ``release``'s statement; notify ``ptc_keys`` when it matched a row."""

        async def run(conn: AsyncConnection) -> bool:
            if (await conn.execute(statement)).first() is None:
                return False
            await notify(conn, KEYS_CHANNEL, key_digest(owner, key))  # delivered once the change is committed
            return True

        return await self._db.call(operation, run, write=True)

    async def get(self, owner: str, key: str) -> IdempotencyRecord | None:
        if not storable(owner, key):  # NUL or a lone surrogate: no row holds it (a driver error otherwise)
            return None

        async def run(conn: AsyncConnection) -> IdempotencyRecord | None:
            row = (await conn.execute(_bound(owner, key))).first()
            if row is None:
                return None
            held = _held(row)
            assert isinstance(held, IdempotencyRecord)
            return held

        return await self._db.call("idempotency_key", run)
