"""Files in and out of a sandbox: request caps, the outputs a script leaves, and how they are kept with the job.

Files in (``files`` of ``/execute`` and ``POST /sessions``, ``PUT /sessions/{id}/files/{path}``) are checked here
against ``max_files`` and ``max_files_bytes`` (413 before any sandbox starts); their paths by
``ptc_runtime.files.check_path`` (422, in the request model). The sandbox writes them (``ResidentSandbox.put_files``)
as its user, never following a symlink.

Files out: what a script leaves under ``outputs/`` in its working directory arrives, when it ends, as ``file`` and
``data`` frames (``ptc_runtime.protocol``) that ``OutputFiles`` takes, checking each against the caps it sent
(``max_output_files``, ``max_output_files_bytes``): the sandbox is not trusted, a frame past them breaks it. Each
file is kept in the job's output folder (``work_dir/output/<job_id>/files/<n>``, n from 0: the host never sees a
name the sandbox chose) for the job's retention, and listed in the view (``files``: path, bytes, sha256,
content_type). ``GET /jobs/{id}/files/{path}`` serves it (``find``).
"""

from __future__ import annotations

import contextlib
import hashlib
import mimetypes
import os
from pathlib import Path
from typing import IO, Any, Protocol

from ptc_runtime.files import OUTPUTS, check_path

from service.errors import PayloadTooLarge
from service.settings import Settings

FILES_FOLDER = "files"
"""In a job's output folder: its output files, named by their index."""
SKIPPED_SHOWN = 100
"""Most skipped entries a view lists by path (the rest are only counted in ``files_omitted``)."""
DEFAULT_TYPE = "application/octet-stream"
DOWNLOAD_HEADERS = {"Content-Disposition": "attachment", "X-Content-Type-Options": "nosniff"}
"""On every file served: a script's ``outputs/page.html`` is a download, never a page a browser renders from the
service's origin."""


class FileBudget(Protocol):
    """What an owner may still keep on disk (``service.quotas.OutputBudget``): output files count with its
    retained output."""

    def take(self, wanted: int) -> int:
        """Of ``wanted`` bytes, how many may be kept (now counted as used)."""
        ...

    def take_all(self, wanted: int) -> bool:
        """Whether all ``wanted`` bytes may be kept (then counted as used); none are taken when not."""
        ...

    def give_back(self, count: int) -> None:
        """``count`` bytes kept were deleted."""
        ...

    def charge(self, count: int) -> None:
        """Count ``count`` bytes that are kept whatever the quota (an ended job's stored row)."""
        ...


def content_type(path: str) -> str:
    """The media type guessed from ``path``'s extension (``mimetypes``; ``application/octet-stream`` when none)."""
    guessed, _ = mimetypes.guess_type(path, strict=False)
    return guessed or DEFAULT_TYPE


def check_files(files: list[Any], settings: Settings) -> None:
    """Raise PayloadTooLarge (413) when ``files`` (``schemas.common.FileIn``) are more than ``max_files`` or hold more
    than ``max_files_bytes`` decoded bytes in all."""
    if len(files) > settings.max_files:
        raise PayloadTooLarge(
            f"{len(files)} files, more than the limit of {settings.max_files} (PTC_MAX_FILES)",
            ("body", "files"),
            settings.max_files,
        )
    total = sum(item.size() for item in files)
    if total > settings.max_files_bytes:
        raise PayloadTooLarge(
            f"the files hold {total} bytes, more than the limit of {settings.max_files_bytes} (PTC_MAX_FILES_BYTES)",
            ("body", "files"),
            settings.max_files_bytes,
        )


class OutputFiles:
    """The output files of one run as their frames arrive (on the event loop); every frame is checked.

    Args:
        folder: the job's output folder (``files/`` is made in it).
        max_files: most files accepted.
        max_bytes: most bytes accepted, all files together.
        budget: what the job's owner may still keep on disk (None: no owner cap). A file it cannot hold whole is
            not kept: it is counted in ``omitted`` and listed in ``skipped`` (reason ``output quota``).

    Attributes:
        files: one dict per file kept: path, bytes, sha256 (hex), content_type.
        omitted: entries the sandbox left out (past a cap, not regular files); ``skipped`` lists the first
            ``SKIPPED_SHOWN`` of them (path, reason).
    """

    def __init__(self, folder: Path, max_files: int, max_bytes: int, budget: FileBudget | None = None) -> None:
        self.folder = folder / FILES_FOLDER
        self.budget = budget
        self._taken = 0  # bytes of the current file taken from the budget
        self._dropped = False  # the current file did not fit in the budget: its further data is ignored
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.files: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.omitted = 0
        self.total = 0
        self._open: IO[bytes] | None = None
        self._hash: Any = None

    def caps(self) -> dict[str, int]:
        """The caps a ``run`` frame carries (``outputs``)."""
        return {"max_files": self.max_files, "max_bytes": self.max_bytes}

    def begin(self, path: object) -> None:
        """A ``file`` frame: a new file at ``path``. Raises ValueError for a path outside ``outputs/`` or past the
        count cap (the sandbox broke the protocol)."""
        name = check_path(path, outputs=True)
        if not name.startswith(OUTPUTS + "/"):
            raise ValueError("an output file outside outputs/")
        if len(self.files) >= self.max_files:
            raise ValueError("more output files than the cap")
        self.end()
        self._taken, self._dropped = 0, False
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self._open = open(self.folder / str(len(self.files)), "wb")
        self._hash = hashlib.sha256()
        self.files.append({"path": name, "bytes": 0, "sha256": "", "content_type": content_type(name)})

    def add(self, data: bytes) -> None:
        """A ``data`` frame of the current file. Raises ValueError when there is none or past the bytes cap."""
        if self._open is None and not self._dropped:
            raise ValueError("output data outside a file")
        self.total += len(data)
        if self.total > self.max_bytes:
            raise ValueError("more output bytes than the cap")
        if self._open is None:  # dropped: over the owner's quota
            return
        if self.budget is not None:
            granted = self.budget.take(len(data))
            self._taken += granted
            if granted < len(data):
                self._drop()
                return
        self._open.write(data)
        self._hash.update(data)
        self.files[-1]["bytes"] += len(data)

    def _drop(self) -> None:
        """The current file does not fit in the owner's quota: delete it and give its bytes back."""
        if self._open is not None:
            self._open.close()
            self._open = None
        self._dropped = True
        with contextlib.suppress(OSError):
            os.unlink(self.folder / str(len(self.files) - 1))
        if self.budget is not None:
            self.budget.give_back(self._taken)
        entry = self.files.pop()
        self.omitted += 1
        if len(self.skipped) < SKIPPED_SHOWN:
            self.skipped.append({"path": entry["path"], "reason": "output quota"})

    def skip(self, path: object, reason: object) -> None:
        """A ``skipped`` frame."""
        self.end()
        self.omitted += 1
        if len(self.skipped) < SKIPPED_SHOWN:
            self.skipped.append({"path": str(path)[:1024], "reason": str(reason)[:100]})

    def end(self) -> None:
        """Close the current file (at the next file, a skip, or the run's exit)."""
        if self._open is not None:
            self._open.close()
            self._open = None
            self.files[-1]["sha256"] = self._hash.hexdigest()

    def discard(self) -> None:
        """Forget every file (the run broke the protocol mid-way): nothing half-sent is listed."""
        self.end()
        self.files = []


def find(output_dir: Path, files: list[dict[str, Any]], path: str) -> tuple[Path, dict[str, Any]] | None:
    """(host file, its entry) of the output file ``path`` among a job's ``files`` (its view's), or None."""
    for index, entry in enumerate(files):
        if entry.get("path") == path:
            host = output_dir / FILES_FOLDER / str(index)
            if os.path.isfile(host):
                return host, entry
    return None
