"""Job blobs (table ``job_blobs``): an ended job's retained output (``stdout``, ``stderr``) and its output files
(``files/<index>``) kept in the store itself, so that any replica serves them (PostgreSQL; the SQLite store keeps
them as files beside it, ``service.output``). Its rows go with their job (``JobRecords.purge``).

``JobBlobs`` is the resource's interface; ``sqlite_blobs`` and ``pg_blobs`` implement it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class JobBlobs(Protocol):
    """An ended job's bytes under their names. Coroutines, safe to call concurrently."""

    async def put(self, job_id: str, blobs: Mapping[str, bytes]) -> None:
        """Keep an ended job's bytes under their names (``stdout``, ``stderr``, ``files/<index>``), replacing
        earlier ones of the same names; they go with the job (``JobRecords.purge``).

        The caller keeps each within its cap (``PTC_OUTPUT_RETENTION_BYTES`` per stream, the output files' caps).
        """
        ...

    async def read(self, job_id: str, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        """Bytes ``[offset, offset + length)`` of a job's blob (``length`` None: to its end), or None without it."""
        ...

    async def sizes(self, job_id: str) -> dict[str, int]:
        """The names of a job's blobs and their sizes (bytes)."""
        ...
