"""Marks on a job's output folder: whose output budget its bytes count against and what the job keeps in the store.

A job's output folder (``work_dir/output/<job_id>``, see ``service.jobs.live``) carries its owner from admission on
and, once the job has ended, the bytes the job keeps in the store (its call records' arguments and results, its
stored view and summary), so that a restart counts both against the owner again (``recovery``). They are extended
attributes of the folder (``OWNER_ATTR``, ``STORED_ATTR``): no file is made for them, and a new file costs the file
system far more than an attribute (docs/performance.md). Where the file system keeps no user attributes (tmpfs
before Linux 6.6, some network file systems), they go in ``OWNER_FILE``: the owner's name on its first line, the
stored bytes appended as its second. Folders written before these marks have that file, and the stored bytes in
``RECORDS_FILE``. Every function here blocks (file system calls): run them off the event loop, except ``mark_stored``
(one attribute, or one append, on a folder the service made).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

OWNER_ATTR = "user.ptc.owner"  # the owner's name (UTF-8)
STORED_ATTR = "user.ptc.stored"  # the bytes the ended job keeps in the store (decimal)
OWNER_FILE = "owner"  # where attributes cannot be kept: the owner's name, then (ended) the stored bytes
RECORDS_FILE = "record_bytes"  # in folders of older versions: the stored bytes (decimal)


def mark_owner(folder: Path, owner: str) -> None:
    """Record ``owner`` on ``folder`` (an attribute, else ``OWNER_FILE``). Raises OSError when neither can be
    written."""
    try:
        os.setxattr(folder, OWNER_ATTR, owner.encode())
    except OSError:
        (folder / OWNER_FILE).write_text(owner + "\n")  # a line: the stored bytes follow at the job's end


def mark_stored(folder: Path, stored: int) -> None:
    """Record the bytes the ended job keeps in the store on ``folder`` (an attribute, else appended to
    ``OWNER_FILE``: appended, never rewritten, so the owner's line survives any crash). Raises OSError when neither
    can be written."""
    try:
        os.setxattr(folder, STORED_ATTR, str(stored).encode())
        return
    except OSError:
        pass
    owner = _attribute(folder, OWNER_ATTR)  # its owner an attribute, but no room for this one: the file holds both
    if owner is not None:
        with contextlib.suppress(FileExistsError):
            fd = os.open(folder / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (owner + "\n").encode())
            finally:
                os.close(fd)
    fd = os.open(folder / OWNER_FILE, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)  # never made with no owner line
    try:
        os.write(fd, f"{stored}\n".encode())
    finally:
        os.close(fd)


def read_marks(folder: Path) -> tuple[str | None, int | None]:
    """(owner, stored bytes) of ``folder``: None for what it does not say (a folder from before owners were recorded,
    a job that has not ended, a mark that cannot be read)."""
    owner, stored = _attribute(folder, OWNER_ATTR), _attribute(folder, STORED_ATTR)
    if owner is None or stored is None:
        lines: list[str] = []
        with contextlib.suppress(OSError, UnicodeDecodeError):
            lines = (folder / OWNER_FILE).read_text().split("\n")
        if owner is None and lines:
            owner = lines[0]
        if stored is None and len(lines) > 1 and lines[1]:
            stored = lines[1]
        elif stored is None:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                stored = (folder / RECORDS_FILE).read_text()
    try:
        return owner, max(int(stored), 0) if stored is not None else None
    except ValueError:
        return owner, None


def _attribute(folder: Path, name: str) -> str | None:
    try:
        return os.getxattr(folder, name).decode()
    except (OSError, UnicodeDecodeError):
        return None
