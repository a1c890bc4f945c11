"""Ended jobs' retained output and output files in a shared job store (``JobStore.shares_output``: PostgreSQL).

When a job ends, the runner copies what ``PTC_WORK_DIR/output/<job_id>/`` retained (``stdout``, ``stderr``, each at
most ``PTC_OUTPUT_RETENTION_BYTES``, and the output files, at most ``PTC_MAX_OUTPUT_FILES_BYTES`` in all) into the
store's ``job_blobs`` before it saves the final view, so a replica that does not have the folder serves them from
the store (``JobViews``). The folder stays the first source: the replica that ran the job reads its own disk.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from service.files import FILES_FOLDER
from service.jobs.live import STREAMS, LiveJob
from service.output import StoredRange
from service.store import JobStore

log = logging.getLogger(__name__)


def file_blob(index: int) -> str:
    """The blob name of the output file at ``index`` of a view's ``files``."""
    return f"{FILES_FOLDER}/{index}"


SHARE_AT_ONCE = 4
"""Blobs being copied into the store at once, across all jobs of this replica: the bytes held for copying stay
below this many blobs (each at most ``PTC_OUTPUT_RETENTION_BYTES`` or ``PTC_MAX_OUTPUT_FILES_BYTES``), however many
jobs end together."""


async def share(
    store: JobStore, folder: Path, listed: list[dict[str, Any]], job_id: str, slots: asyncio.Semaphore
) -> None:
    """Copy an ended job's retained streams and each output file its view lists from ``folder`` into the store,
    one blob at a time under one of ``slots`` (``SHARE_AT_ONCE`` of the runner), read off the event loop.

    Missing files are left out (a stream never written, a file not collected). The first refusal ends the copy.

    Raises:
        StoreUnavailable: the store did not take a blob (the rest are not tried).
    """
    for name in [*STREAMS, *(file_blob(i) for i in range(len(listed)))]:
        async with slots:
            try:
                data = await asyncio.to_thread((folder / name).read_bytes)
            except OSError:
                continue
            await store.blobs.put(job_id, {name: data})
            del data


async def keep_output(store: JobStore, job: LiveJob, slots: asyncio.Semaphore) -> None:
    """``share`` an ended job's output; never raises: a store that fails leaves it on this replica's disk only."""
    try:
        await share(store, job.output_dir, job.files_view()["files"], job.id, slots)
    except Exception:
        log.exception("job %s: could not keep its output in the shared store", job.id)


async def in_store(store: JobStore, output_dir: Path, job_id: str) -> bool:
    """Whether an ended job's output is read from the shared store: the store keeps it and this replica does not
    hold the job's folder ``output_dir/<job_id>`` (another replica ran it)."""
    return store.shares_output and not await asyncio.to_thread((output_dir / job_id).is_dir)


async def stored_range(store: JobStore, job_id: str, name: str, offset: int, length: int) -> StoredRange:
    """Up to ``length`` bytes from ``offset`` of a job's blob in the shared store, as a range read a slice at a
    time (empty past its end or without the blob)."""
    size = (await store.blobs.sizes(job_id)).get(name, 0)
    return StoredRange(
        lambda position, most: store.blobs.read(job_id, name, position, most),
        offset,
        max(0, min(length, size - offset)),
    )


async def stored_file(
    store: JobStore, job_id: str, listed: list[dict[str, Any]], path: str
) -> tuple[StoredRange, dict[str, Any]] | None:
    """(range of the whole file, entry) of the output file ``path`` among an ended job's ``files`` (its view's),
    from the shared store, or None."""
    for index, entry in enumerate(listed):
        if entry.get("path") == path:
            name = file_blob(index)
            sizes = await store.blobs.sizes(job_id)
            if name not in sizes:
                return None
            return await stored_range(store, job_id, name, 0, sizes[name]), entry
    return None
