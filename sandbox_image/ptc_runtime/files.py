"""Files in and out of the sandbox's working directory (``/tmp``), never following a symlink a script made.

Standard library only; the service imports ``check_path`` (its rules, once) and the fake backend uses the rest.

Every path is relative to the working directory and checked by ``check_path``: relative, at most ``MAX_DEPTH``
components of at most ``MAX_NAME_BYTES`` bytes each (``MAX_PATH_BYTES`` in all), no NUL, no ``..``; ``.`` and empty
components are dropped (``a//./b`` is ``a/b``). Every open walks from a descriptor of the working directory one
component at a time with ``O_NOFOLLOW`` (``O_DIRECTORY`` for the folders), each open checked by ``open_at`` to have
opened the entry itself (gVisor follows a folder symlink despite the flag): a symlink anywhere on the way (``/tmp/x ->
/etc``, ``/tmp/x -> /run/ptc``) makes the open fail (``ELOOP``/``ENOTDIR``); a file that is not a regular file (a
fifo, a device) is refused once opened (``O_NONBLOCK``: opening a fifo never waits). The resident interpreter does
this as the sandbox user (``as_sandbox_user``: the effective uid and gid of its scripts), so nothing it writes or
reads is more than a script could, and only while no script's process exists.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Tuple

from ptc_runtime.confine import script_ids

MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255
MAX_DEPTH = 16
OUTPUTS = "outputs"
"""The outputs folder under the working directory: what a script writes there is collected when it ends."""
CHUNK_BYTES = 64 * 1024
CLEAR_DEPTH = 100
MAX_DIR_ENTRIES = 2048
"""Most names of one folder a walk holds (and sorts) at once: a script can leave hundreds of thousands of files
(their inodes fill the sandbox's memory, not its tmpfs), whose names listed at once would run the resident
interpreter out of the memory that is left (measured: 180,000 files of 200-byte names in ``outputs/``, 256 MiB, the
collection OOM-killed and the job reported ``oom_killed`` though the script exited 0). Past it the walk takes the
first ``MAX_DIR_ENTRIES`` the folder lists (in name order) and counts the rest (``TOO_MANY``)."""
TOO_MANY = "too many entries"
"""A walk's reason for the entries of a folder past ``MAX_DIR_ENTRIES`` (its size field: how many)."""
SKIPPED_FRAMES = 100  # entries left out of the outputs are all counted (``files_omitted``), the first these sent

NOT_FOUND = "not_found"
NOT_A_FILE = "not_a_file"
TOO_LARGE = "too_large"
INVALID_PATH = "invalid_path"
NO_SPACE = "no_space"
FAILED = "failed"
ERRORS = (NOT_FOUND, NOT_A_FILE, TOO_LARGE, INVALID_PATH, NO_SPACE, FAILED)
"""The error codes of a file operation (``done`` frames' ``error``, ``skipped`` frames' ``reason``)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class FileOpError(Exception):
    """A file operation failed; ``code`` is one of ``ERRORS``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_path(path: object, outputs: bool = False) -> str:
    """``path`` normalized (components joined by ``/``), or ValueError saying why it is refused.

    ``outputs`` False refuses paths under ``OUTPUTS`` (files in go elsewhere: the outputs folder is the script's).
    """
    if not isinstance(path, str):
        raise ValueError("a path is a string")
    if "\0" in path:
        raise ValueError("a path must not contain NUL")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in path):
        raise ValueError("a path must not contain control characters (a newline, a tab, ...)")
    if path.startswith("/"):
        raise ValueError("a path must be relative (to the working directory /tmp)")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a path must be UTF-8 text") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise ValueError("a path is at most %d bytes" % MAX_PATH_BYTES)
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not parts:
        raise ValueError("a path must name a file")
    if ".." in parts:
        raise ValueError("a path must not contain '..'")
    if len(parts) > MAX_DEPTH:
        raise ValueError("a path has at most %d components" % MAX_DEPTH)
    if any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in parts):
        raise ValueError("a path's component is at most %d bytes" % MAX_NAME_BYTES)
    if not outputs and parts[0] == OUTPUTS:
        raise ValueError("the outputs/ folder is the script's: files in go elsewhere")
    return "/".join(parts)


@contextlib.contextmanager
def as_sandbox_user(real: bool = False) -> Iterator[None]:
    """Run the block with the effective uid and gid of the sandbox's scripts (``confine.script_ids``) when this
    process is root (the privsep interpreter; its effective capabilities are gone meanwhile and come back after, from
    the permitted set); unchanged otherwise.

    ``real``: the real ids too (root stays the saved ids, to come back through): what checks the real user
    (``os.access``, as matplotlib does of its config folder) then sees the sandbox user as well. Only while no
    script process exists (the preload): a process of the scripts' uid may signal one whose real uid is its own."""
    if os.geteuid() != 0:
        yield
        return
    uid, gid = script_ids()
    real_uid, real_gid = (uid, gid) if real else (-1, -1)
    os.setresgid(real_gid, gid, -1)
    try:
        os.setresuid(real_uid, uid, -1)
        try:
            yield
        finally:
            os.setresuid(0, 0, -1)
    finally:
        os.setresgid(0, 0, -1)


def _errno_error(exc: OSError, path: str) -> FileOpError:
    import errno

    if exc.errno == errno.ENOENT:
        return FileOpError(NOT_FOUND, "%s: no such file" % path)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EEXIST):
        return FileOpError(NOT_A_FILE, "%s: not a regular file (a symlink or a folder on the way?)" % path)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return FileOpError(NO_SPACE, "%s: no space left in the working directory (its tmpfs is full)" % path)
    return FileOpError(FAILED, "%s: %s" % (path, os.strerror(exc.errno or 0)))


def open_at(name: str, flags: int, dir_fd: int, mode: int = 0o644) -> int:
    """``os.open(name, flags | O_NOFOLLOW, dir_fd=dir_fd)``, and a check that what was opened is the entry itself,
    not what a symlink points to: its device and inode must be those ``lstat`` gave before the open. Needed under
    gVisor, whose ``openat`` follows a symlink to a folder despite ``O_NOFOLLOW`` when ``O_DIRECTORY`` is set
    (measured: runsc of Debian bookworm). Raises OSError (``ELOOP`` for a symlink, ``ENOENT`` when missing)."""
    import errno

    try:
        before: Optional[os.stat_result] = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
        before = None  # created by this open: checked below against a new lstat
    if before is not None and stat.S_ISLNK(before.st_mode):
        raise OSError(errno.ELOOP, "a symlink")
    fd = os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    try:
        opened = os.fstat(fd)
        if before is None:
            before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise OSError(errno.ELOOP, "not the entry itself")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk(root: int, parts: List[str], create: bool) -> int:
    """A new descriptor of the folder ``parts`` under ``root``, each component opened with ``O_NOFOLLOW``;
    ``create`` makes missing folders (mode 0755)."""
    fd = os.dup(root)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            next_fd = open_at(part, _DIR_FLAGS, fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_root(workdir: str) -> int:
    """A descriptor of the working directory (itself opened without following a symlink)."""
    return os.open(workdir, _DIR_FLAGS)


def write_file(root: int, path: str, source: IO[bytes]) -> int:
    """Write what ``source`` holds to ``path`` (already checked) under ``root``, replacing a regular file there;
    returns the bytes written. Raises FileOpError."""
    parts = path.split("/")
    try:
        folder = _walk(root, parts[:-1], create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            fd = open_at(parts[-1], flags, folder)
        finally:
            os.close(folder)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileOpError(NOT_A_FILE, "%s: not a regular file" % path)
            os.ftruncate(fd, 0)
            return _copy(source, fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _errno_error(exc, path) from None


def _copy(source: IO[bytes], fd: int) -> int:
    """Copy what is left of ``source`` to ``fd``; returns the bytes copied. A file is copied by the kernel
    (``sendfile``): its bytes never enter this process's memory, which every later script of a session inherits
    (``ptc_runtime.session``); anything else (or a kernel that refuses) is copied through a buffer."""
    import errno

    written = 0
    try:
        source_fd: Optional[int] = source.fileno()
    except (AttributeError, OSError, ValueError):
        source_fd = None
    while source_fd is not None:
        try:
            n = os.sendfile(fd, source_fd, None, 1 << 30)
        except OSError as exc:
            if written or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            break
        if not n:
            return written
        written += n
    while True:
        data = source.read(CHUNK_BYTES)
        if not data:
            return written
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
            written += n


def open_file(root: int, path: str) -> Tuple[int, int]:
    """(descriptor, size) of the regular file ``path`` (already checked) under ``root``. Raises FileOpError."""
    parts = path.split("/")
    try:
        folder = _walk(root, parts[:-1], create=False)
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            fd = open_at(parts[-1], flags, folder)
        finally:
            os.close(folder)
    except OSError as exc:
        raise _errno_error(exc, path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise FileOpError(NOT_A_FILE, "%s: not a regular file" % path)
    return fd, info.st_size


def chunks(fd: int, size: int) -> Iterator[bytes]:
    """At most ``size`` bytes of ``fd`` from its start, in chunks of at most ``CHUNK_BYTES``."""
    left = size
    while left > 0:
        data = os.read(fd, min(CHUNK_BYTES, left))
        if not data:
            return
        left -= len(data)
        yield data


def _names(fd: int, most: int) -> Tuple[List[str], int]:
    """(at most ``most`` names of the folder ``fd`` in name order, how many more it holds), read as a stream: never
    more than ``most`` names in memory, however large the folder."""
    names: List[str] = []
    more = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            if len(names) < most:
                names.append(entry.name)
            else:
                more += 1
    names.sort()
    return names, more


def _is_empty(fd: int) -> bool:
    """Whether the folder ``fd`` holds nothing (one entry read at most, however large it is)."""
    with os.scandir(fd) as entries:
        return next(entries, None) is None


def walk(root: int, prefix: str = "", depth: int = 0) -> Iterator[Tuple[str, Optional[int], Optional[str]]]:
    """Every entry below ``root`` that is not a folder, depth first in name order: (path, size, None) for a
    regular file, (path, None, reason) for anything else (a symlink, a fifo, a device, a folder too deep or one
    that cannot be opened). Symlinks are never followed. A folder of more than ``MAX_DIR_ENTRIES`` entries: the
    first that many it lists, then (folder's path, how many more, ``TOO_MANY``)."""
    try:
        names, more = _names(root, MAX_DIR_ENTRIES)
    except OSError:
        return
    for name in names:
        path = prefix + name
        try:
            info = os.stat(name, dir_fd=root, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            if depth + 1 >= MAX_DEPTH:
                yield path, None, "too deep"
                continue
            try:
                fd = open_at(name, _DIR_FLAGS, root)
            except OSError:
                yield path, None, "cannot be opened"
                continue
            try:
                yield from walk(fd, path + "/", depth + 1)
            finally:
                os.close(fd)
        elif stat.S_ISREG(info.st_mode):
            yield path, info.st_size, None
        elif stat.S_ISLNK(info.st_mode):
            yield path, None, "symlink"
        else:
            yield path, None, "not a regular file"
    if more:
        yield prefix.rstrip("/") or ".", more, TOO_MANY


def _unlock(root: int, name: str, info: os.stat_result, mode: int = 0o700) -> None:
    """Give the folder ``name`` under ``root`` (``info``: its ``lstat``) the mode ``mode`` when a script changed it
    (0555, 0000, sticky): the sandbox user owns every folder a script makes, so that it can always be emptied
    whatever mode the script left it. Only while no script's process exists (nothing can swap the folder for a
    symlink between the ``lstat`` and the ``chmod``); best effort."""
    if stat.S_IMODE(info.st_mode) != mode:
        with contextlib.suppress(OSError):
            os.chmod(name, mode, dir_fd=root)


def clear(root: int, name: str, depth: int = 0) -> None:
    """Remove ``name`` under ``root`` and everything in it, never following a symlink, whatever modes a script
    left on the folders (``_unlock``; best effort: folders nested deeper than ``CLEAR_DEPTH`` stay)."""
    if depth > CLEAR_DEPTH:
        return
    try:
        info = os.stat(name, dir_fd=root, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(info.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=root)
        return
    _unlock(root, name, info)
    try:
        fd = open_at(name, _DIR_FLAGS, root)
    except OSError:
        return
    try:
        _clear_all(fd, depth + 1)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=root)


def _clear_all(fd: int, depth: int) -> None:
    """Remove everything in the folder ``fd`` as its entries are read: one pass over a stream (never all its names
    in memory; linear in the entries, whatever cannot be removed, e.g. a folder nested deeper than
    ``CLEAR_DEPTH``, which stays). Removing entries already read does not hide the others from the stream (tmpfs,
    Linux's and gVisor's)."""
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                clear(fd, entry.name, depth)
    except OSError:
        return


Send = Callable[..., None]
"""``send(message, payload=b"")``: one control frame (``ptc_runtime.protocol``)."""


def _user(switch_user: bool) -> Any:
    return as_sandbox_user() if switch_user else contextlib.nullcontext()


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def serve_request(request: Dict[str, Any], send: Send, workdir: str, run_dir: str, switch_user: bool) -> None:
    """Answer one ``put``, ``get`` or ``list`` request of the control protocol (``ptc_runtime.protocol``): the
    working directory is ``workdir``, a ``put``'s sources are in ``run_dir``'s ``FILES_DIR``; ``switch_user``:
    do it as the sandbox user (``as_sandbox_user``)."""
    from ptc_runtime import protocol

    op, rid = request.get(protocol.FIELD_OP), str(request.get("id"))
    done: Dict[str, Any] = {protocol.FIELD_OP: protocol.DONE, "id": rid, "error": None, "message": ""}
    try:
        with _user(switch_user):
            root = open_root(workdir)
            try:
                if op == protocol.PUT:
                    _put(root, request, run_dir, done)
                elif op == protocol.GET:
                    _get(root, request, send, rid, done)
                else:
                    _list(root, request, send, rid, done)
            finally:
                os.close(root)
    except FileOpError as exc:
        done.update(error=exc.code, message=str(exc)[:500])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        done.update(error=FAILED, message=("%s: %s" % (type(exc).__name__, exc))[:500])
    send(done)


def _put(root: int, request: Dict[str, Any], run_dir: str, done: Dict[str, Any]) -> None:
    from ptc_runtime import protocol

    sources = os.path.join(run_dir, protocol.FILES_DIR)
    for index, item in enumerate(request.get("files") or []):
        done["index"] = index
        try:
            path = check_path(item["path"])
        except ValueError as exc:
            raise FileOpError(INVALID_PATH, str(exc)) from None
        source = str(item["source"])
        if "/" in source or source in ("", ".", ".."):
            raise FileOpError(INVALID_PATH, "a source is a name in the run folder's files/")
        with open(os.path.join(sources, source), "rb") as f:
            write_file(root, path, f)
    done.pop("index", None)


def _get(root: int, request: Dict[str, Any], send: Send, rid: str, done: Dict[str, Any]) -> None:
    from ptc_runtime import protocol

    try:
        path = check_path(request.get("path"), outputs=True)
    except ValueError as exc:
        raise FileOpError(INVALID_PATH, str(exc)) from None
    fd, size = open_file(root, path)
    try:
        most = _int(request.get("max_bytes"), 0)
        if size > most:
            raise FileOpError(TOO_LARGE, "%s: %d bytes, more than the %d allowed" % (path, size, most))
        total = 0
        for data in chunks(fd, size):
            send({protocol.FIELD_OP: protocol.DATA, "id": rid, "n": len(data)}, data)
            total += len(data)
        done["bytes"] = total
    finally:
        os.close(fd)


def _list(root: int, request: Dict[str, Any], send: Send, rid: str, done: Dict[str, Any]) -> None:
    from ptc_runtime import protocol

    most = _int(request.get("max_entries"), 0)
    count = 0
    done["truncated"] = False
    for path, size, reason in walk(root):
        if count >= most:
            done["truncated"] = True
            break
        shown = _shown(path)
        if reason == TOO_MANY:
            size, reason = None, "%s: %d more not listed" % (TOO_MANY, size or 0)
        elif shown != path:
            size, reason = None, "name not UTF-8 or too long"
        send({protocol.FIELD_OP: protocol.ENTRY, "id": rid, "path": shown, "bytes": size, "skipped": reason})
        count += 1


def send_outputs(job_id: str, caps: Dict[str, Any], send: Send, workdir: str, switch_user: bool) -> int:
    """Send what is under ``OUTPUTS`` in ``workdir`` (``file``/``data``/``skipped`` frames), at most
    ``caps["max_files"]`` files and ``caps["max_bytes"]`` bytes in all, then empty the folder (if it held anything:
    the next run's ``prepare_outputs`` makes it writable again whatever a script did to it); returns how many
    entries were left out (past a cap, or not regular files; a ``skipped`` frame for the first ``SKIPPED_FRAMES``
    of them). Never raises: an error ends the collection."""
    from ptc_runtime import protocol

    max_files, max_bytes = _int(caps.get("max_files"), 0), _int(caps.get("max_bytes"), 0)
    omitted = files = total = 0
    try:
        with _user(switch_user):
            root = open_root(workdir)
            try:
                try:
                    outputs = open_at(OUTPUTS, _DIR_FLAGS, root)
                except OSError:
                    return 0
                try:
                    if _is_empty(outputs):  # nothing to send or empty (its mode: ``prepare_outputs`` resets it)
                        return 0
                    for path, size, reason in walk(outputs):
                        path = OUTPUTS + "/" + path
                        shown = _shown(path)
                        if reason == TOO_MANY:  # size: how many entries of that folder were not examined
                            if omitted < SKIPPED_FRAMES:
                                skipped = {protocol.FIELD_OP: protocol.SKIPPED, "id": job_id, "path": shown}
                                send({**skipped, "reason": "%s: %d not collected" % (TOO_MANY, size or 0)})
                            omitted += size or 0
                            continue
                        if shown != path:
                            reason = "name not UTF-8 or too long"
                        elif reason is None and not _sendable(path):
                            reason = "path not allowed (too deep, or control characters)"
                        elif reason is None and (files >= max_files or total + (size or 0) > max_bytes):
                            reason = "cap"
                        if reason is not None:
                            omitted += 1
                            if omitted <= SKIPPED_FRAMES:
                                skipped = {protocol.FIELD_OP: protocol.SKIPPED, "id": job_id, "path": shown}
                                send({**skipped, "reason": reason})
                            continue
                        try:
                            fd, size = open_file(root, path)
                        except FileOpError:
                            omitted += 1
                            continue
                        try:
                            if files >= max_files or total + size > max_bytes:
                                omitted += 1
                                if omitted <= SKIPPED_FRAMES:
                                    skipped = {protocol.FIELD_OP: protocol.SKIPPED, "id": job_id, "path": path}
                                    send({**skipped, "reason": "cap"})
                                continue
                            send({protocol.FIELD_OP: protocol.FILE, "id": job_id, "path": path})
                            files += 1
                            for data in chunks(fd, size):
                                send({protocol.FIELD_OP: protocol.DATA, "id": job_id, "n": len(data)}, data)
                                total += len(data)
                        finally:
                            os.close(fd)
                finally:
                    os.close(outputs)
                _empty(root)
            finally:
                os.close(root)
    except (OSError, ValueError, RecursionError):
        pass
    return omitted


def _empty(root: int) -> None:
    """Empty the outputs folder under ``root`` (kept, mode 0755, so that a script can write into it at once), whatever
    modes its script left there (``clear``). Should anything stay (folders nested past ``CLEAR_DEPTH``), the folder
    is moved aside in the working directory (``.ptc-outputs-left-<n>``) and a new one made: what a script leaves
    there is never a later script's output. Best effort."""
    try:
        info = os.stat(OUTPUTS, dir_fd=root, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(info.st_mode):
        return
    _unlock(root, OUTPUTS, info, 0o755)
    try:
        fd = open_at(OUTPUTS, _DIR_FLAGS, root)
    except OSError:
        return
    try:
        _clear_all(fd, 0)
        left = bool(os.listdir(fd))
    except OSError:
        left = True
    finally:
        os.close(fd)
    if left:
        import time

        with contextlib.suppress(OSError):
            os.rename(OUTPUTS, ".ptc-outputs-left-%d" % time.monotonic_ns(), src_dir_fd=root, dst_dir_fd=root)
            os.mkdir(OUTPUTS, 0o755, dir_fd=root)


def _sendable(path: str) -> bool:
    """Whether ``path`` (under ``OUTPUTS``) passes ``check_path``, as the service checks every ``file`` frame: one
    that does not (17 components: a file 15 folders deep in ``outputs/``; a newline in a name, which no URL of
    ``GET /jobs/{id}/files/{path}`` could name) is skipped, never sent (the service would end the sandbox as broken
    and the finished job would lose its result)."""
    try:
        return check_path(path, outputs=True) == path
    except ValueError:
        return False


def _shown(path: str) -> str:
    """``path`` as it may travel in a frame: valid UTF-8 (undecodable bytes replaced), at most
    ``MAX_PATH_BYTES`` bytes; equal to ``path`` when it needed neither."""
    raw = path.encode("utf-8", "surrogateescape")
    return raw[:MAX_PATH_BYTES].decode("utf-8", "replace")


def prepare_outputs(workdir: str, switch_user: bool) -> None:
    """Make the outputs folder under ``workdir`` (as the sandbox user), empty (``_empty``: a run that sent no
    outputs may have left something there), replacing whatever non-folder a script left in its place (a symlink
    included: never followed). Best effort."""
    try:
        with _user(switch_user):
            root = open_root(workdir)
            try:
                try:
                    info = os.stat(OUTPUTS, dir_fd=root, follow_symlinks=False)
                    if not stat.S_ISDIR(info.st_mode):
                        os.unlink(OUTPUTS, dir_fd=root)
                        os.mkdir(OUTPUTS, 0o755, dir_fd=root)
                    else:
                        _empty(root)
                except FileNotFoundError:
                    os.mkdir(OUTPUTS, 0o755, dir_fd=root)
            finally:
                os.close(root)
    except OSError:
        pass
