"""``PostgresJobStore``: the shared job store (``PTC_STORE_URL``), every resource in one PostgreSQL database
(``pg_db``) that several replicas share (issue 17)."""

from __future__ import annotations

from service.store.base import JobStore
from service.store.pg_blobs import PostgresJobBlobs
from service.store.pg_call_log import PostgresCallLog
from service.store.pg_db import PostgresDatabase
from service.store.pg_jobs import PostgresJobRecords
from service.store.pg_keys import PostgresKeyBindings
from service.store.pg_ledger import PostgresCallbackLedger
from service.store.pg_manifests import PostgresToolsetManifests
from service.store.pg_registry import PostgresReplicaRegistry
from service.store.pg_sessions import PostgresSessionRecords


class PostgresJobStore(JobStore):
    """The shared store: one PostgreSQL database.

    Args:
        url: ``postgresql://user:password@host:port/db``.
        timeout_s: longest wait for one operation (s): connecting, a pooled connection, a statement.
        pool_size: connections kept open (more are opened up to twice this under load).
    """

    shares_output = True

    def __init__(self, url: str, timeout_s: float = 5.0, pool_size: int = 10) -> None:
        self._db = PostgresDatabase(url, timeout_s, pool_size)
        self.jobs = PostgresJobRecords(self._db)
        self.blobs = PostgresJobBlobs(self._db)
        self.toolsets = PostgresToolsetManifests(self._db)
        self.keys = PostgresKeyBindings(self._db)
        self.callbacks = PostgresCallbackLedger(self._db)
        self.replicas = PostgresReplicaRegistry(self._db)
        self.sessions = PostgresSessionRecords(self._db)
        self.runs = PostgresCallLog(self._db)

    @property
    def url(self) -> str:
        """The database's URL, password included: never log it (``describe``)."""
        return self._db.url

    async def open(self) -> None:
        await self._db.open()

    async def close(self) -> None:
        await self._db.close()

    async def ping(self) -> None:
        await self._db.ping()

    def describe(self) -> str:
        return self._db.describe()
