"""``SQLiteJobStore``: the embedded job store, every resource in one SQLite file (``sqlite_db``)."""

from __future__ import annotations

from pathlib import Path

from service.store.base import JobStore
from service.store.sqlite_blobs import SQLiteJobBlobs
from service.store.sqlite_call_log import SQLiteCallLog
from service.store.sqlite_db import SQLiteDatabase
from service.store.sqlite_jobs import SQLiteJobRecords
from service.store.sqlite_keys import SQLiteKeyBindings
from service.store.sqlite_ledger import SQLiteCallbackLedger
from service.store.sqlite_manifests import SQLiteToolsetManifests
from service.store.sqlite_registry import SQLiteReplicaRegistry
from service.store.sqlite_sessions import SQLiteSessionRecords


class SQLiteJobStore(JobStore):
    """The embedded store: one SQLite file, for one replica. Output bytes are files beside it
    (``service.output``); ``blobs`` is there for a store that shares them, and unused here.

    Args:
        path: the database file (created with its folder when missing).
    """

    def __init__(self, path: Path) -> None:
        self._db = SQLiteDatabase(path)
        self.jobs = SQLiteJobRecords(self._db)
        self.blobs = SQLiteJobBlobs(self._db)
        self.toolsets = SQLiteToolsetManifests(self._db)
        self.keys = SQLiteKeyBindings(self._db)
        self.callbacks = SQLiteCallbackLedger(self._db)
        self.replicas = SQLiteReplicaRegistry(self._db)
        self.sessions = SQLiteSessionRecords(self._db)
        self.runs = SQLiteCallLog(self._db)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._db.path

    async def open(self) -> None:
        await self._db.open()

    async def close(self) -> None:
        await self._db.close()

    def describe(self) -> str:
        return f"sqlite {self._db.path}"
