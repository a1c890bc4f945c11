"""The work dir's lock: one running instance per ``work_dir``, held for the life of the process.

The lock is an exclusive ``flock`` on ``work_dir/.lock`` (whose text is the holder's pid). The kernel drops it
when the process exits in any way, so a crash never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from service.errors import WorkDirBusy

LOCK_NAME = ".lock"


def lock(work_dir: Path) -> IO[str]:
    """Take the lock of ``work_dir`` (created if missing) and return its open file: keep it open to hold the lock.

    Raises:
        WorkDirBusy: another running instance holds it.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    held = open(work_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        raise WorkDirBusy(work_dir) from None
    held.seek(0)
    held.truncate()
    held.write(f"{os.getpid()}\n")
    held.flush()
    return held


def check_free(work_dir: Path) -> None:
    """Raise WorkDirBusy when another instance holds the lock of ``work_dir`` (taken and given back at once:
    a clean refusal before the server starts; the job service takes it for good at start-up)."""
    path = work_dir / LOCK_NAME
    if not path.exists():
        return
    with open(path, "a+") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkDirBusy(work_dir) from None
        fcntl.flock(probe, fcntl.LOCK_UN)
