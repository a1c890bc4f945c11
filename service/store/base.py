"""``JobStore``: one database and the eight resources kept in it, each behind its own small interface.

    store.jobs       JobRecords        jobs (job_records.py)
    store.blobs      JobBlobs          ended jobs' output and files (blobs.py)
    store.toolsets   ToolsetManifests  registered toolsets (manifests.py)
    store.keys       KeyBindings       idempotency keys (keys.py)
    store.callbacks  CallbackLedger    completion callbacks (ledger.py)
    store.replicas   ReplicaRegistry   the replica registry (registry.py)
    store.sessions   SessionRecords    sessions (session_records.py)
    store.runs       CallLog           durable jobs' run specs and call logs (call_log.py)

``SQLiteJobStore`` (``sqlite.py``) is the embedded default and ``PostgresJobStore`` (``pg.py``) the shared one
(``PTC_STORE_URL``); ``service.store.job_store`` chooses between them.
"""

from __future__ import annotations

import abc

from service.store.blobs import JobBlobs
from service.store.call_log import CallLog
from service.store.job_records import JobRecords
from service.store.keys import KeyBindings
from service.store.ledger import CallbackLedger
from service.store.manifests import ToolsetManifests
from service.store.registry import ReplicaRegistry
from service.store.session_records import SessionRecords


class JobStore(abc.ABC):
    """The job store: opened once, then its resources are used; every method of every resource is a coroutine,
    safe to call concurrently.

    Attributes:
        jobs / blobs / toolsets / keys / callbacks / replicas / sessions / runs: the resources (see the module).
        shares_output: the store keeps each ended job's retained output and output files (``blobs``), for any
            replica to serve when the job's folder is not on its disk (True for PostgreSQL).
    """

    shares_output: bool = False
    jobs: JobRecords
    blobs: JobBlobs
    toolsets: ToolsetManifests
    keys: KeyBindings
    callbacks: CallbackLedger
    replicas: ReplicaRegistry
    sessions: SessionRecords
    runs: CallLog

    @abc.abstractmethod
    async def open(self) -> None:
        """Create or open the store, migrating its tables to the newest revision.

        Raises:
            StoreUnavailable: the database could not be reached (PostgreSQL).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and release the store."""

    async def ping(self) -> None:
        """Check that the store answers (``GET /readyz``).

        Raises:
            StoreUnavailable: it does not, or not in time.
        """
        return None  # an embedded store always answers

    def describe(self) -> str:
        """Where the store is, for logs: never a password."""
        return type(self).__name__
