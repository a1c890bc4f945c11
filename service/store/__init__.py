"""The job store: where jobs live once created, and where ended jobs outlive the process.

One small interface per resource (``base.JobStore`` lists them), each with its SQLite (``sqlite_*``) and
PostgreSQL (``pg_*``) implementation beside it; the tables (``schema``) and their migrations (``migrate``,
``migrations/``) are shared by both, and so is the fenced write (``fenced_write``). ``job_store`` is the one place
that chooses the store. The package exports the interfaces and the rows they take and give; the backends are
imported from their modules (``service.store.sqlite``, ``service.store.pg``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.store.base import JobStore
from service.store.blobs import JobBlobs
from service.store.call_log import CallLog, LoggedCall
from service.store.job_records import InvalidCursor, JobQuery, JobRecords, StoredJob
from service.store.keys import IdempotencyRecord, KeyBindings, KeyClaim, key_digest
from service.store.ledger import CallbackClaim, CallbackLedger, CallbackRow
from service.store.manifests import ToolsetManifests
from service.store.registry import Incarnation, Registration, Replica, ReplicaRegistry
from service.store.session_records import SessionRecords, StoredSession

if TYPE_CHECKING:
    from service.settings import Settings

__all__ = [
    "CallLog",
    "CallbackClaim",
    "CallbackLedger",
    "CallbackRow",
    "IdempotencyRecord",
    "Incarnation",
    "InvalidCursor",
    "JobBlobs",
    "JobQuery",
    "JobRecords",
    "JobStore",
    "KeyBindings",
    "KeyClaim",
    "LoggedCall",
    "Registration",
    "Replica",
    "ReplicaRegistry",
    "SessionRecords",
    "StoredJob",
    "StoredSession",
    "ToolsetManifests",
    "job_store",
    "key_digest",
]


def job_store(settings: Settings) -> JobStore:
    """The store ``settings`` choose, unopened: PostgreSQL with ``PTC_STORE_URL``, else SQLite at
    ``job_store_path()``."""
    if settings.store_url is not None:
        from service.store.pg import PostgresJobStore

        return PostgresJobStore(settings.store_url.get_secret_value(), timeout_s=settings.store_timeout_s)
    from service.store.sqlite import SQLiteJobStore

    return SQLiteJobStore(settings.job_store_path())
