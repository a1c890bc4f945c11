"""The files of a resident sandbox other than a run's script and stubs: ``ResidentSandbox``'s own.

A run's env file (``_write_env``, ``_drop_env``: see ``ResidentSandbox.run``), and the file requests.

Between runs the service asks the sandbox's runtime for file I/O under its ``/tmp`` (docs/files.md,
``ptc_runtime.files``): a request goes out on the control connection with an id (``f<n>``), its ``data`` and
``entry`` frames come back, then its ``done``. ``SandboxFiles`` is mixed into ``ResidentSandbox``
(``service.sandbox.resident``), which reads the frames and hands a request's to ``_request_data`` and
``_request_frame``; the frames of a run's outputs stay there. Nothing the sandbox says is trusted: a frame
outside the protocol raises ValueError, which ends the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import IO, Any

from ptc_runtime import protocol

from service.errors import FileRefused, NoSuchFile, SandboxError

FILE_OP_TIMEOUT_S = 60.0  # how long a file request may take in the sandbox before the sandbox is given up
_FILE_ERRORS = frozenset(("not_found", "not_a_file", "too_large", "invalid_path", "no_space", "failed"))


class FileRequest:
    """A file request (``put``/``get``/``list``) waiting for its ``done``: its data and entries so far."""

    def __init__(self, max_bytes: int = 0, max_entries: int = 0, into: IO[bytes] | None = None) -> None:
        self.done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.into = into  # where a get's bytes go, a frame at a time
        self.received = 0
        self.max_bytes = max_bytes
        self.entries: list[dict[str, Any]] = []
        self.max_entries = max_entries


class SandboxFiles:
    """File requests to a resident sandbox, mixed into ``ResidentSandbox``, which provides the attributes below,
    ``send`` and ``destroy``."""

    folder: Path
    features: frozenset[str]
    broken: str | None
    _requests: dict[str, FileRequest]
    _request_ids: int

    async def send(self, message: dict[str, Any]) -> None:
        """Send one control frame (``ResidentSandbox.send``)."""
        raise NotImplementedError

    async def destroy(self, reason: str | None = None) -> None:
        """Remove the sandbox (``ResidentSandbox.destroy``)."""
        raise NotImplementedError

    def _write_env(self, data: bytes) -> None:
        """Write a run's env (JSON) to the folder's ``protocol.ENV_FILE``, readable by the sandbox user.

        Whatever is at that path is removed first and the file is made anew (never opened through a link or an
        existing file), though the folder is read-only to scripts. Raises OSError when it cannot be written.
        """
        path = self.folder / protocol.ENV_FILE
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def _drop_env(self) -> None:
        """Remove the ended run's env file (a later script must not find it in the folder)."""
        with contextlib.suppress(OSError):
            os.unlink(self.folder / protocol.ENV_FILE)

    def _request_data(self, rid: object, data: bytes) -> bool:
        """Take a ``data`` frame's bytes if they are a request's (False: not a request's); raises ValueError past
        what the request asked for."""
        request = self._requests.get(rid) if isinstance(rid, str) else None
        if request is None:
            return False
        if request.into is None or request.received + len(data) > request.max_bytes:
            raise ValueError("more file bytes than asked for")
        request.received += len(data)
        request.into.write(data)  # a frame (MAX_FRAME_BYTES) into a spool file: a page-cache write
        return True

    def _request_frame(self, op: str, rid: object, message: dict[str, Any]) -> None:
        """An ``entry`` or ``done`` frame of a request; raises ValueError for one outside the protocol."""
        request = self._requests.get(rid) if isinstance(rid, str) else None
        if request is None:
            raise ValueError(f"a {op} frame of no request")
        if op == protocol.ENTRY:
            size, skipped = message.get("bytes"), message.get("skipped")
            if len(request.entries) >= request.max_entries or not isinstance(message["path"], str):
                raise ValueError("more entries than asked for")
            if not (size is None or (type(size) is int and size >= 0)):
                raise ValueError("an entry's size")
            entry = {"path": message["path"][:1024], "bytes": size}
            request.entries.append({**entry, "skipped": None if skipped is None else str(skipped)[:100]})
        else:  # done
            error = message.get("error")
            if error is not None and error not in _FILE_ERRORS:
                raise ValueError("an unknown file error")
            assert isinstance(rid, str)
            self._requests.pop(rid, None)
            if not request.done.done():
                request.done.set_result(message)

    async def _file_request(self, message: dict[str, Any], request: FileRequest) -> dict[str, Any]:
        """Send a file request (between runs) and wait for its ``done``; raises SandboxError when the sandbox
        cannot serve it (then it is given up), FileRefused / NoSuchFile for an error it reports."""
        if protocol.FEATURE_FILES not in self.features:
            raise SandboxError(
                "the sandbox image cannot take or give files (an image older than the service? rebuild it with "
                "sandbox_image/build.sh)"
            )
        self._request_ids += 1
        rid = f"f{self._request_ids}"
        self._requests[rid] = request
        try:
            await self.send({**message, "id": rid})
            try:
                done = await asyncio.wait_for(asyncio.shield(request.done), FILE_OP_TIMEOUT_S)
            except TimeoutError:
                await self.destroy(f"the sandbox did not answer a file request within {FILE_OP_TIMEOUT_S:g} s")
                raise SandboxError(self.broken or "the sandbox did not answer") from None
        finally:
            self._requests.pop(rid, None)
        error = done.get("error")
        if error == "not_found":
            raise NoSuchFile(str(done.get("message") or "no such file")[:500])
        if error is not None:
            index = done.get("index")
            raise FileRefused(
                str(error), str(done.get("message") or error)[:500], index if type(index) is int else None
            )
        return done

    async def put_files(self, files: list[tuple[str, bytes]]) -> None:
        """Write ``files`` ((path, bytes): paths already checked) under the sandbox's working directory, as its
        user, never following a symlink. The bytes go through the folder's ``.files-in/`` (read-only in the sandbox),
        emptied after. No script may run meanwhile (the caller holds the sandbox's turn).

        Raises:
            FileRefused: the sandbox could not write one (``index``: which; ``code``: no_space, not_a_file, ...).
            SandboxError: the sandbox is gone, broken or too old.
        """
        if not files:
            return
        sources = self.folder / protocol.FILES_DIR

        def lay_out() -> None:
            sources.mkdir(mode=0o755, exist_ok=True)
            os.chmod(sources, 0o755)
            for index, (_, data) in enumerate(files):
                target = sources / str(index)
                target.write_bytes(data)
                os.chmod(target, 0o644)

        await asyncio.to_thread(lay_out)
        try:
            listed = [{"path": path, "source": str(index)} for index, (path, _) in enumerate(files)]
            await self._file_request({protocol.FIELD_OP: protocol.PUT, "files": listed}, FileRequest())
        finally:
            await asyncio.to_thread(shutil.rmtree, sources, True)

    async def get_file(self, path: str, max_bytes: int) -> bytes:
        """The bytes of the regular file ``path`` (checked) under the working directory, held in memory (small
        files; a download uses ``get_file_into``). Raises as ``get_file_into``."""
        into = io.BytesIO()
        await self.get_file_into(path, max_bytes, into)
        return into.getvalue()

    async def get_file_into(self, path: str, max_bytes: int, into: IO[bytes]) -> int:
        """Write the regular file ``path`` (checked) under the working directory to ``into`` as its frames arrive
        (at most ``protocol.MAX_FRAME_BYTES`` held at a time), read as the sandbox user without following a
        symlink; returns its size (bytes). Raises NoSuchFile, FileRefused (``too_large`` past ``max_bytes``,
        ``not_a_file``), SandboxError."""
        request = FileRequest(max_bytes=max_bytes, into=into)
        await self._file_request({protocol.FIELD_OP: protocol.GET, "path": path, "max_bytes": max_bytes}, request)
        return request.received

    async def list_files(self, max_entries: int) -> tuple[list[dict[str, Any]], bool]:
        """(entries, truncated): what is under the working directory (path, bytes; ``skipped`` says why an entry
        is not a regular file), at most ``max_entries``. Raises SandboxError."""
        request = FileRequest(max_entries=max_entries)
        done = await self._file_request({protocol.FIELD_OP: protocol.LIST, "max_entries": max_entries}, request)
        return request.entries, done.get("truncated") is True
