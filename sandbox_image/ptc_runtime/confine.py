"""What a script's process does to itself before the script runs: the user it runs as, the system calls it may
not make, and the import path its Python subprocesses start with.

The sandbox starts as root (uid 0) holding only ``CAP_SETUID``, ``CAP_SETGID`` and ``CAP_KILL`` (the service
grants no other, and ``no-new-privileges`` is set), when the image says it can (its label
``io.ptc-sandbox.runtime`` lists ``privsep``). The resident interpreter stays root: a script, running as
the sandbox user 10001 with no capability at all, can then neither signal nor ptrace it nor open its
``/proc`` files, under runc and under gVisor alike (gVisor does not shield a namespace's init from signals
and ignores ``PR_SET_DUMPABLE`` for ``/proc/<pid>/fd``; it does check the user). An image run as 10001 (an
older service) runs the script as that user, unchanged.

``drop(...)``, in the script's process (the forked child of the interpreter, or the one-shot runtime
itself, before the script runs):

- ``setsid``: its own session and process group, so that it cannot even send SIGCONT to the interpreter;
- supplementary groups cleared, then gid and uid (real, effective, saved) set to the sandbox's own (``script_ids``:
  the uid the service gave this sandbox in ``PTC_SCRIPT_UID``, unique among the host's live sandboxes, so that no
  two tenants share the kernel's per-user limits; ``SCRIPT_UID`` when absent): every capability is gone (the
  kernel clears them when the last uid 0 goes), ``no-new-privileges`` keeps them so;
- dumpable again (a change of user clears it), and the OOM killer's first choice (``oom_score_adj`` 1000);
- a seccomp filter that refuses new user namespaces (``clone``/``unshare`` with ``CLONE_NEWUSER``: EPERM;
  ``clone3``, whose flags a filter cannot read: ENOSYS, on which the C library falls back to ``clone``; the
  x32 and any other ABI, e.g. i386 through ``int 0x80``: ENOSYS). The engine's profile refuses them under
  runc already; gVisor applies no profile. A session's interpreter installs it on itself (``install_filter``)
  and its forks inherit it: ``drop`` is then given no program;
- ``PYTHONSAFEPATH=1`` and ``PYTHONNOUSERSITE=1`` in its environment (``script_env``; set by a session's
  interpreter before it forks): a ``python3`` it starts puts neither
  the working directory (``-c``, ``-m``) nor the script's folder nor ``~/.local`` (HOME is ``/tmp``) on
  ``sys.path``, so no ``tools`` package, module or ``.pth`` file a session's earlier script left in ``/tmp``
  runs there (Python >= 3.11 reads ``PYTHONSAFEPATH``; the image's Python is 3.11 or 3.12).
"""

from __future__ import annotations

import os
import platform
import struct
from typing import Any, Dict, Optional, Tuple

SCRIPT_UID = 10001
SCRIPT_GID = 10001
SCRIPT_UID_ENV = "PTC_SCRIPT_UID"  # ptc_runtime.protocol.SCRIPT_UID_ENV (confine imports nothing of the runtime)
CLEAN_IMPORT_ENV = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
CLONE_NEWUSER = 0x10000000
EPERM = 1
ENOSYS = 38
X32_SYSCALL_BIT = 0x40000000
# audit arch -> (clone, unshare, clone3) system call numbers
SYSCALLS = {
    0xC000003E: (56, 272, 435),  # x86_64
    0xC00000B7: (220, 97, 435),  # aarch64
}
ARCHES = {"x86_64": 0xC000003E, "amd64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}

# classic BPF
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def no_user_namespaces_filter() -> Optional[bytes]:
    """The seccomp program (struct sock_filter array) described in the module docstring, or None on an
    architecture it does not know (the filter is then not installed)."""
    arch = ARCHES.get(platform.machine().lower())
    if arch is None:
        return None
    clone, unshare, clone3 = SYSCALLS[arch]
    program = [
        _insn(_LD_W_ABS, 0, 0, 4),  # 0: A = arch
        _insn(_JEQ_K, 0, 9, arch),  # 1: ours -> 2, another ABI (i386 through int 0x80) -> 11
        _insn(_LD_W_ABS, 0, 0, 0),  # 2: A = nr
        _insn(_JGE_K, 7, 0, X32_SYSCALL_BIT),  # 3: x32 ABI -> 11
        _insn(_JEQ_K, 6, 0, clone3),  # 4: -> 11
        _insn(_JEQ_K, 1, 0, clone),  # 5: -> 7
        _insn(_JEQ_K, 0, 2, unshare),  # 6: -> 7, anything else -> 9
        _insn(_LD_W_ABS, 0, 0, 16),  # 7: A = args[0], low 32 bits (little-endian)
        _insn(_JSET_K, 1, 0, CLONE_NEWUSER),  # 8: -> 10, else -> 9
        _insn(_RET_K, 0, 0, _ALLOW),  # 9
        _insn(_RET_K, 0, 0, _ERRNO | EPERM),  # 10
        _insn(_RET_K, 0, 0, _ERRNO | ENOSYS),  # 11
    ]
    return b"".join(program)


def script_ids() -> Tuple[int, int]:
    """(uid, gid) every script of this sandbox runs as: ``PTC_SCRIPT_UID`` of the sandbox's environment (the
    service's, read once by the interpreter before any script runs), else (``SCRIPT_UID``, ``SCRIPT_GID``). Raises
    ValueError for a value that is not a uid a script may have (0, negative, past 2**31 - 2)."""
    if "ids" not in _prepared:
        raw = os.environ.get(SCRIPT_UID_ENV)
        if raw is None:
            _prepared["ids"] = (SCRIPT_UID, SCRIPT_GID)
        else:
            uid = int(raw)
            if not 0 < uid < 2**31 - 1:
                raise ValueError("%s=%s is not a uid a script may run as" % (SCRIPT_UID_ENV, raw[:20]))
            _prepared["ids"] = (uid, uid)
    ids: Tuple[int, int] = _prepared["ids"]
    return ids


_prepared: Dict[str, Any] = {}  # ctypes objects made once, in the interpreter, and inherited by each fork


def _libc() -> Any:
    if "libc" not in _prepared:
        import ctypes

        _prepared["libc"] = ctypes.CDLL(None, use_errno=True)
    return _prepared["libc"]


def prepare(program: Optional[bytes]) -> None:
    """Make the C library handle and ``program``'s ``struct sock_fprog`` now, so that a forked child only calls
    prctl (the resident interpreter calls this once; ``install_filter`` prepares on first use otherwise)."""
    if program is None or _prepared.get("program") == program:
        return
    try:
        import ctypes

        class _Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = _Prog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
        _prepared.update(program=program, buffer=buffer, fprog=fprog, ref=ctypes.byref(fprog))
        _libc()
    except (ImportError, OSError, AttributeError):
        pass


def install_filter(program: Optional[bytes]) -> bool:
    """prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, program) in this process (and all it starts); False when the
    kernel (or ctypes) refused. Needs ``no_new_privs``, which the sandbox has."""
    if program is None:
        return False
    prepare(program)
    if _prepared.get("program") != program:
        return False
    try:
        return int(_libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, _prepared["ref"], 0, 0)) == 0
    except (ImportError, OSError, AttributeError):
        return False


def set_env(changes: Dict[str, str], removed: Tuple[str, ...] = ()) -> None:
    """Set ``changes`` in ``os.environ`` and take out ``removed``, touching only what differs: each change writes
    the process's memory, which in a forked script's process means pages copied from the interpreter's."""
    for name in removed:
        if name in os.environ:
            del os.environ[name]
    for name, value in changes.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def script_env() -> None:
    """The environment a script's process gets from ``drop``: ``SCRIPT_UID_ENV`` gone (the script sees the
    environment it always saw), ``CLEAN_IMPORT_ENV`` set. A session's interpreter sets it once, after reading
    ``script_ids``, so that its forks find it done."""
    set_env(CLEAN_IMPORT_ENV, (SCRIPT_UID_ENV,))


def set_dumpable(dumpable: bool) -> None:
    """prctl(PR_SET_DUMPABLE). Best effort: without ctypes or prctl the process stays as it is."""
    try:
        _libc().prctl(PR_SET_DUMPABLE, 1 if dumpable else 0, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


def drop(program: Optional[bytes], own_session: bool = True, env: bool = True) -> None:
    """Make this process a script's (see the module docstring); ``own_session`` False keeps the session (the
    one-shot runtime is the sandbox's init already); ``env`` False: the environment is the script's already (a
    session's interpreter set it before forking: ``script_env``). Raises OSError when the user cannot be changed:
    a script must never run as root."""
    uid, gid = script_ids()
    if own_session:
        os.setsid()
    if os.getuid() == 0 or os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if 0 in os.getresuid() or 0 in os.getresgid():
            raise OSError("the script's process is still root")
    set_dumpable(True)
    try:  # the script, not the interpreter, is the one the OOM killer takes when the sandbox runs out of memory
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")
        finally:
            os.close(fd)
    except OSError:
        pass
    install_filter(program)
    if env:
        script_env()
