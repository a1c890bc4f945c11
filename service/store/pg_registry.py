"""``ReplicaRegistry`` on PostgreSQL (``pg_db``): leases on the database's clock, changes notified on
``ptc_replicas``."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from service.errors import InstanceIdInUse
from service.store.pg_db import REPLICAS_CHANNEL, PostgresDatabase, notify, seconds
from service.store.registry import LIVE_STATES, Incarnation, Registration, Replica, ReplicaRegistry, in_use_message
from service.store.tables import replicas

r = replicas.c


class PostgresReplicaRegistry(ReplicaRegistry):
    """``ReplicaRegistry`` in a PostgreSQL database (lease times: ``timestamptz`` of the database's ``now()``).

    Args:
        db: the store's database.
    """

    def __init__(self, db: PostgresDatabase) -> None:
        self._db = db

    async def register(self, registration: Registration) -> int:
        lease = sa.func.now() + seconds(registration.lease_s)
        placeholder = (
            insert(replicas)
            .values(
                instance_id=registration.instance_id,
                epoch=0,
                internal_url=registration.internal_url,
                work_dir_token=registration.work_dir_token,
                version=registration.version,
                state="left",
                started_at=sa.func.now(),
                heartbeat_at=sa.func.now(),
                lease_until=sa.func.now(),
            )
            .on_conflict_do_nothing(index_elements=[r.instance_id])
        )
        locked = (
            sa.select(r.epoch, r.work_dir_token, r.state, (r.lease_until > sa.func.now()).label("holding"))
            .where(r.instance_id == registration.instance_id)
            .with_for_update()
        )

        async def run(conn: AsyncConnection) -> int:
            await conn.execute(placeholder)  # a first start: a row to lock (racing starts meet on it)
            row = (await conn.execute(locked)).one()
            if row.state in LIVE_STATES and row.holding and row.work_dir_token != registration.work_dir_token:
                raise InstanceIdInUse(in_use_message(registration.instance_id))
            epoch = int(row.epoch) + 1
            await conn.execute(
                sa.update(replicas)
                .where(r.instance_id == registration.instance_id)
                .values(
                    epoch=epoch,
                    internal_url=registration.internal_url,
                    work_dir_token=registration.work_dir_token,
                    version=registration.version,
                    state="live",
                    started_at=sa.func.now(),
                    heartbeat_at=sa.func.now(),
                    lease_until=lease,
                    ended_at=None,
                    expired_by=None,
                )
            )
            await notify(conn, REPLICAS_CHANNEL, f"{registration.instance_id} live")
            return epoch

        return await self._db.call("register", run, write=True)

    async def renew(self, incarnation: Incarnation, lease_s: float) -> bool:
        statement = (
            sa.update(replicas)
            .where(r.instance_id == incarnation.instance_id, r.epoch == incarnation.epoch, r.state.in_(LIVE_STATES))
            .values(heartbeat_at=sa.func.now(), lease_until=sa.func.now() + seconds(lease_s))
        )

        async def run(conn: AsyncConnection) -> bool:
            return bool((await conn.execute(statement)).rowcount)

        return await self._db.call("renew", run, write=True)

    async def set_state(self, incarnation: Incarnation, state: str) -> bool:
        statement = (
            sa.update(replicas)
            .where(r.instance_id == incarnation.instance_id, r.epoch == incarnation.epoch, r.state.in_(LIVE_STATES))
            .values(state=state, ended_at=sa.func.now() if state == "left" else None)
        )

        async def run(conn: AsyncConnection) -> bool:
            if not (await conn.execute(statement)).rowcount:
                return False
            await notify(conn, REPLICAS_CHANNEL, f"{incarnation.instance_id} {state}")
            return True

        return await self._db.call("set_replica_state", run, write=True)

    async def all(self) -> list[Replica]:
        left = sa.func.extract("epoch", r.lease_until - sa.func.now()).label("left")
        statement = sa.select(r.instance_id, r.epoch, r.internal_url, r.version, r.state, left)

        async def run(conn: AsyncConnection) -> list[Replica]:
            return [
                Replica(row.instance_id, int(row.epoch), row.internal_url, row.version, row.state, float(row.left))
                for row in await conn.execute(statement)
            ]

        return await self._db.call("replicas", run)

    async def expire(self, by: str) -> dict[Incarnation, float]:
        passed = sa.and_(r.state.in_(LIVE_STATES), r.lease_until < sa.func.now())
        locked = sa.select(r.instance_id).where(passed).with_for_update(skip_locked=True)
        statement = (
            sa.update(replicas)
            .where(r.instance_id.in_(locked), passed)
            .values(state="expired", ended_at=sa.func.now(), expired_by=by)
            .returning(r.instance_id, r.epoch, sa.extract("epoch", r.ended_at - r.heartbeat_at).label("silent_s"))
        )

        async def run(conn: AsyncConnection) -> dict[Incarnation, float]:
            expired = {
                Incarnation(row.instance_id, int(row.epoch)): float(row.silent_s or 0.0)
                for row in await conn.execute(statement)
            }
            for incarnation in expired:
                await notify(conn, REPLICAS_CHANNEL, f"{incarnation.instance_id} expired")
            return expired

        return await self._db.call("expire_replicas", run, write=True)
