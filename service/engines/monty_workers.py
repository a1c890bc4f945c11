"""The Monty engine's workers: ``monty`` interpreter processes (pydantic-monty's worker pools), one pool per API key,
each worker confined by the operating system as well as by the interpreter.

Monty's interpreter has no file system, network or process access beyond what its host grants, but it is native code
fed hostile input. So each worker process is started through a launcher (``worker``, written at ``start`` into the
engine's folder) that gives it, before it runs any script:

- its own user id (``nobody``, by ``setpriv``) and no capabilities, in new user, PID, network, IPC, UTS and cgroup
  namespaces (``bwrap --unshare-all``): no network at all (not even loopback to the host), no other process to see;
- a read-only view of the file system holding only the ``monty`` binary and the shared libraries it links (``bwrap``
  binds; no ``/proc``, no home, no ``/tmp``), and a new session (no terminal to inject input into);
- a seccomp filter (libseccomp, by ``pyseccomp``) refusing with ``EPERM`` every system call that would make a
  socket, a new process (``clone`` without ``CLONE_THREAD``, ``fork``), a namespace or a mount, trace or read
  another process, load code into the kernel or reach the keyring;
- rlimits (``prlimit``): an address space of ``PTC_MONTY_WORKER_ADDRESS_SPACE_MB``, 64 open files, no core dumps;
- its end with the service (``--die-with-parent``).

A pool belongs to one API key (``owner``): a worker never runs another key's script, and a crashed worker is replaced
by its pool (pydantic-monty's ``MontyCrashedError``). Pools idle for ``PTC_MONTY_POOL_IDLE_S`` are closed; at most
``PTC_MONTY_MAX_POOLS`` are open, the least recently used idle one closed for a new key (a key whose pool is busy
waits for nothing: its checkout waits for its own workers only).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from service.errors import SandboxError

log = logging.getLogger(__name__)

WORKER_UID = 65534  # nobody
BLOCKED_SYSCALLS = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4", "sendmsg", "recvmsg", "ptrace",
    "process_vm_readv", "process_vm_writev", "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "bpf",
    "keyctl", "add_key", "request_key", "fork", "vfork", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "perf_event_open", "userfaultfd", "io_uring_setup", "personality", "swapon",
    "swapoff", "reboot", "acct", "open_by_handle_at", "name_to_handle_at", "setuid", "setgid", "setreuid",
    "setregid", "setresuid", "setresgid", "setgroups", "execveat",
)  # fmt: skip
"""System calls a worker is refused (``EPERM``); ``clone`` without ``CLONE_THREAD`` and ``clone3`` are refused too."""
CLONE_THREAD = 0x00010000
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


class WorkersUnavailable(Exception):
    """The engine cannot start confined workers here (what is missing is the message)."""


class WorkersBusy(SandboxError):
    """``PTC_MONTY_MAX_POOLS`` pools are open and all busy: no pool for another key now."""


def monty_binary() -> str:
    """The ``monty`` interpreter binary pydantic-monty installs (``pydantic_monty._binary``). Raises
    WorkersUnavailable when pydantic-monty or its binary is missing."""
    try:
        from pydantic_monty._binary import find_monty_binary
    except ImportError as exc:
        raise WorkersUnavailable(f"pydantic-monty is not installed ({exc})") from exc
    try:
        return find_monty_binary()
    except FileNotFoundError as exc:
        raise WorkersUnavailable(str(exc)) from exc


def write_seccomp_filter(path: Path) -> None:
    """Write the workers' seccomp filter (a cBPF program for this machine's architecture) to ``path``. Raises
    WorkersUnavailable when libseccomp cannot be loaded."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as exc:
        raise WorkersUnavailable(f"libseccomp is not usable ({exc})") from exc
    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in BLOCKED_SYSCALLS:
        with contextlib.suppress(Exception):  # a call this architecture lacks (fork on aarch64)
            rules.add_rule(refuse, name)
    rules.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags are in memory: glibc falls back to clone
    with open(path, "wb") as out:
        rules.export_bpf(out)


def write_launcher(binary: str, address_space_mb: int) -> Path:
    """Make the workers' folder (a new one under the system's temporary folder, mode 0755, owned by this user: the
    workers' user can reach it, nobody else can change it) with the seccomp filter, the launcher (``worker``, a shell
    script that execs ``binary`` confined as the module docstring says) and, when the workers' user could not run
    ``binary`` where it is (``_reachable_by_all``), a copy of it for them; returns the
    launcher's path (its folder is removed with ``remove_launcher``). Raises WorkersUnavailable when a tool it needs
    (``bwrap``, ``setpriv``, ``prlimit``) or libseccomp is missing, OSError when the folder cannot be written."""
    tools = {name: shutil.which(name) for name in ("bwrap", "setpriv", "prlimit")}
    missing = sorted(name for name, found in tools.items() if found is None)
    if missing:
        raise WorkersUnavailable(f"{', '.join(missing)} not found (Debian: bubblewrap, util-linux)")
    folder = Path(tempfile.mkdtemp(prefix="ptc-monty-"))
    try:
        folder.chmod(0o755)
        copy = Path(binary) if _reachable_by_all(Path(binary)) else folder / "monty"
        if copy != Path(binary):  # the workers' user could not reach it where it is
            shutil.copyfile(binary, copy)
            copy.chmod(0o755)
        filter_path = folder / "seccomp.bpf"
        write_seccomp_filter(filter_path)
        binds = [arg for lib in LIBRARY_DIRS if os.path.isdir(lib) for arg in ("--ro-bind", lib, lib)]
        command = [
            tools["prlimit"], f"--as={address_space_mb * 1024 * 1024}", "--nofile=64", "--core=0", "--",
            tools["setpriv"], f"--reuid={WORKER_UID}", f"--regid={WORKER_UID}", "--clear-groups", "--",
            tools["bwrap"], "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
            "--ro-bind", str(copy), "/monty", *binds, "--chdir", "/", "--seccomp", "9", "/monty",
        ]  # fmt: skip
        launcher = folder / "worker"
        launcher.write_text(
            "#!/bin/sh\n# A Monty worker, confined (service/engines/monty_workers.py).\n"
            f"exec 9<{shlex.quote(str(filter_path))}\n"
            f'exec {" ".join(shlex.quote(str(part)) for part in command)} "$@"\n'
        )
        launcher.chmod(0o755)
    except BaseException:
        remove_launcher(folder / "worker")
        raise
    return launcher


def _reachable_by_all(path: Path) -> bool:
    """Whether every user can run ``path``: each folder above it searchable by others, the file readable and
    executable by others, none writable by others (a path another user could change is not used)."""
    try:
        resolved = path.resolve(strict=True)
        for part in [resolved, *resolved.parents]:
            mode = part.stat().st_mode
            if mode & stat.S_IWOTH and not (part.is_dir() and mode & stat.S_ISVTX):
                return False
            if not mode & stat.S_IXOTH or (part == resolved and not mode & stat.S_IROTH):
                return False
    except OSError:
        return False
    return True


def remove_launcher(launcher: Path) -> None:
    """Remove the workers' folder ``write_launcher`` made (nothing when it is gone)."""
    shutil.rmtree(launcher.parent, ignore_errors=True)


class WorkerPools:
    """The workers of every API key (module docstring): ``checkout(owner, ...)`` gives a Monty session of one of the
    key's workers for one script (or a session's scripts).

    Args:
        launcher: the confined launcher (``write_launcher``).
        per_key: workers a key's pool runs at once (its scripts beyond wait for one).
        max_pools: pools open at once.
        idle_s: a pool unused this long is closed (its workers end).
        request_timeout_s: the pools' watchdog: a worker that does not answer one turn within this is killed.
    """

    def __init__(self, launcher: Path, per_key: int, max_pools: int, idle_s: float, request_timeout_s: float) -> None:
        self._launcher = launcher
        self._per_key = per_key
        self._max_pools = max_pools
        self._idle_s = idle_s
        self._request_timeout_s = request_timeout_s
        self._pools: dict[str, Any] = {}  # owner -> entered AsyncMonty
        self._used: dict[str, float] = {}  # owner -> when last checked out (monotonic)
        self._busy: dict[str, int] = {}  # owner -> sessions checked out now
        self._opening: dict[str, asyncio.Future[Any]] = {}
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start closing idle pools in the background."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="monty pools reaper")

    def pools(self) -> int:
        """Pools open now."""
        return len(self._pools)

    @contextlib.asynccontextmanager
    async def checkout(self, owner: str, **options: Any) -> AsyncIterator[Any]:
        """A Monty session (``AsyncMontySession``, entered) of one of ``owner``'s workers, checked out with
        ``options`` (``AsyncMonty.checkout``'s: limits, external modules); given back when the block ends. Raises
        what the pool raises (MontyCrashedError: a worker could not be started)."""
        pool = await self._pool(owner)
        self._busy[owner] = self._busy.get(owner, 0) + 1
        try:
            async with pool.checkout(**options) as session:
                yield session
        finally:
            self._busy[owner] = self._busy.get(owner, 1) - 1
            self._used[owner] = time.monotonic()

    async def _pool(self, owner: str) -> Any:
        self._used[owner] = time.monotonic()
        pool = self._pools.get(owner)
        if pool is not None:
            return pool
        opening = self._opening.get(owner)
        if opening is None:
            opening = self._opening[owner] = asyncio.ensure_future(self._open(owner))
            opening.add_done_callback(lambda _: self._opening.pop(owner, None))
        return await asyncio.shield(opening)

    async def _open(self, owner: str) -> Any:
        from pydantic_monty import AsyncMonty

        while len(self._pools) >= self._max_pools:
            if not await self._close_least_used():
                raise WorkersBusy(f"all {self._max_pools} Monty worker pools are busy (PTC_MONTY_MAX_POOLS)")
        pool = AsyncMonty(
            binary_path=self._launcher,
            min_processes=1,
            max_processes=self._per_key,
            request_timeout=self._request_timeout_s,
        )
        await pool.__aenter__()
        self._pools[owner] = pool
        log.info("monty pool opened for a key (%d open)", len(self._pools))
        return pool

    async def _close_least_used(self) -> bool:
        """Close the least recently used idle pool; whether there was one."""
        idle = [owner for owner in self._pools if not self._busy.get(owner)]
        if not idle:
            return False
        await self._close(min(idle, key=lambda owner: self._used.get(owner, 0.0)))
        return True

    async def _close(self, owner: str) -> None:
        pool = self._pools.pop(owner, None)
        self._used.pop(owner, None)
        self._busy.pop(owner, None)
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.__aexit__(None, None, None)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(max(self._idle_s / 4, 0.5))
            now = time.monotonic()
            for owner in [
                o for o in self._pools if not self._busy.get(o) and now - self._used.get(o, now) > self._idle_s
            ]:
                await self._close(owner)

    async def close(self) -> None:
        """Close every pool (their workers end)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for owner in list(self._pools):
            await self._close(owner)
