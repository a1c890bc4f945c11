"""``ReplicaRegistry`` on SQLite (``sqlite_db``): a file serves one replica, so a second live instance id is
refused and nothing is ever expired."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta

from service.errors import InstanceIdInUse
from service.store.registry import LIVE_STATES, Incarnation, Registration, Replica, ReplicaRegistry, in_use_message
from service.store.sqlite_db import SQLiteDatabase, transaction


class SQLiteReplicaRegistry(ReplicaRegistry):
    """``ReplicaRegistry`` in one SQLite file (lease times: ISO text of the service's UTC clock).

    Args:
        db: the store's database.
    """

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def register(self, registration: Registration) -> int:
        def register(db: sqlite3.Connection) -> int:
            now = datetime.now(UTC)
            lease = (now + timedelta(seconds=registration.lease_s)).isoformat()
            with transaction(db, immediate=True):  # the file's write lock: one registration at a time
                for other, state, until in db.execute(
                    "SELECT instance_id, state, lease_until FROM replicas WHERE instance_id != ?",
                    (registration.instance_id,),
                ):
                    if state in LIVE_STATES and datetime.fromisoformat(until) > now:
                        raise InstanceIdInUse(
                            f"instance {other} is live on this SQLite store, which serves one replica; give this "
                            "one its own PTC_WORK_DIR, or PostgreSQL (PTC_STORE_URL)"
                        )
                row = db.execute(
                    "SELECT epoch, work_dir_token, state, lease_until FROM replicas WHERE instance_id = ?",
                    (registration.instance_id,),
                ).fetchone()
                if row is not None:
                    epoch, token, state, until = row
                    holding = state in LIVE_STATES and datetime.fromisoformat(until) > now
                    if holding and token != registration.work_dir_token:
                        raise InstanceIdInUse(in_use_message(registration.instance_id))
                epoch = 1 if row is None else int(row[0]) + 1
                db.execute(
                    "INSERT OR REPLACE INTO replicas (instance_id, epoch, internal_url, work_dir_token, version, "
                    "state, started_at, heartbeat_at, lease_until, ended_at, expired_by) "
                    "VALUES (?, ?, ?, ?, ?, 'live', ?, ?, ?, NULL, NULL)",
                    (
                        registration.instance_id,
                        epoch,
                        registration.internal_url,
                        registration.work_dir_token,
                        registration.version,
                        now.isoformat(),
                        now.isoformat(),
                        lease,
                    ),
                )
            return epoch

        return await self._db.run(register)

    async def renew(self, incarnation: Incarnation, lease_s: float) -> bool:
        now = datetime.now(UTC)
        until = (now + timedelta(seconds=lease_s)).isoformat()
        return await self._db.changed(
            "UPDATE replicas SET heartbeat_at = ?, lease_until = ? "
            "WHERE instance_id = ? AND epoch = ? AND state IN ('live', 'draining')",
            (now.isoformat(), until, incarnation.instance_id, incarnation.epoch),
        )

    async def set_state(self, incarnation: Incarnation, state: str) -> bool:
        ended = datetime.now(UTC).isoformat() if state == "left" else None
        return await self._db.changed(
            "UPDATE replicas SET state = ?, ended_at = ? "
            "WHERE instance_id = ? AND epoch = ? AND state IN ('live', 'draining')",
            (state, ended, incarnation.instance_id, incarnation.epoch),
        )

    async def all(self) -> list[Replica]:
        rows = await self._db.run(
            lambda db: db.execute(
                "SELECT instance_id, epoch, internal_url, version, state, lease_until FROM replicas"
            ).fetchall()
        )
        now = datetime.now(UTC)
        return [
            Replica(i, int(e), url, v, state, (datetime.fromisoformat(until) - now).total_seconds())
            for i, e, url, v, state, until in rows
        ]

    async def expire(self, by: str) -> dict[Incarnation, float]:
        return {}  # one replica: no other to expire
