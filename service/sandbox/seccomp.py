"""The sandboxes' seccomp profile: the engine's default profile minus the system calls a script never needs.

Docker's default profile (moby ``profiles/seccomp/default.json``; the copy this is derived from is
``deploy/seccomp/moby-default-v20.10.24.json``, the profile of Debian's docker.io 20.10) already refuses
what needs a capability the sandbox does not have (``mount``, ``unshare``, ``bpf``, ``perf_event_open``,
``clone`` with namespace flags, ...). It still allows io_uring, whose descriptors bypass seccomp for the
operations they carry and which has been a steady source of kernel privilege escalations, and ``ptrace``,
with which one process of a sandbox can read and alter another of the same user (a session's earlier
script and a later one). ``derive`` removes every name of ``DENIED`` from every rule of the default
profile, whatever capability the rule is conditioned on, so that the profile denies them on its own; io_uring
answers ``ENOSYS`` (as a kernel built without it would, so libraries that probe for it fall back to ordinary
I/O), everything else the profile's default action, ``EPERM``.

``ENOSYS`` comes from ``SCMP_ACT_TRACE``, not from ``SCMP_ACT_ERRNO`` with ``errnoRet``: with no tracer attached
the kernel skips a traced system call and answers ``ENOSYS`` (seccomp(2)), and no process can become a tracer
(``ptrace`` is denied, the engine attaches none). gVisor's runsc before 2023 (Debian 12's included) ignores
``errnoRet`` and answered ``EPERM`` to the default profile's ``clone3`` rule, after which glibc cannot start a
thread; the trace action gives ``ENOSYS`` under runc and runsc alike. The default profile's own ``ENOSYS`` rule
(``clone3``, whose flags seccomp cannot inspect) is rewritten the same way.

The result is shipped as ``service/sandbox/seccomp.json`` (package data) and given to the engine with every
sandbox (``security_opt seccomp=<profile JSON>``). Under gVisor the engine hands it to runsc, which applies it
to the sandboxed processes inside its kernel only when registered with ``--oci-seccomp``
(``deploy/local.sh`` does).

Regenerate after changing ``DENIED``::

    python -m service.sandbox.seccomp deploy/seccomp/moby-default-v20.10.24.json > service/sandbox/seccomp.json
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

PROFILE_RESOURCE = "seccomp.json"
"""The shipped profile, next to this module."""

ENOSYS_NAMES = frozenset({"io_uring_setup", "io_uring_enter", "io_uring_register"})
"""Denied names that answer ENOSYS (as if the kernel lacked them) instead of EPERM."""

DENIED: dict[str, str] = {
    # io_uring: ring operations are not seen by seccomp; a large, often exploited kernel surface.
    "io_uring_setup": "io_uring",
    "io_uring_enter": "io_uring",
    "io_uring_register": "io_uring",
    # Looking into or steering other processes of the sandbox (a session's earlier script and a later one).
    "ptrace": "process inspection",
    "process_vm_readv": "process inspection",
    "process_vm_writev": "process inspection",
    "kcmp": "process inspection",
    "pidfd_getfd": "process inspection",
    # Namespaces (clone with CLONE_NEW* flags is refused by the default profile's argument filter).
    "unshare": "namespaces",
    "setns": "namespaces",
    # Mounting.
    "mount": "mount",
    "umount": "mount",
    "umount2": "mount",
    "mount_setattr": "mount",
    "move_mount": "mount",
    "open_tree": "mount",
    "fsopen": "mount",
    "fsconfig": "mount",
    "fsmount": "mount",
    "fspick": "mount",
    "pivot_root": "mount",
    "chroot": "mount",
    # Kernel facilities a script has no use for, with a record of privilege escalations.
    "bpf": "kernel facility",
    "perf_event_open": "kernel facility",
    "userfaultfd": "kernel facility",
    "keyctl": "kernel facility",
    "add_key": "kernel facility",
    "request_key": "kernel facility",
    "modify_ldt": "kernel facility",
    "lookup_dcookie": "kernel facility",
    "open_by_handle_at": "kernel facility",
    "name_to_handle_at": "kernel facility",
    "syslog": "kernel facility",
    "acct": "kernel facility",
    "quotactl": "kernel facility",
    "quotactl_fd": "kernel facility",
    "fanotify_init": "kernel facility",
    # The machine itself.
    "kexec_load": "machine",
    "kexec_file_load": "machine",
    "reboot": "machine",
    "init_module": "machine",
    "finit_module": "machine",
    "delete_module": "machine",
    "iopl": "machine",
    "ioperm": "machine",
    "settimeofday": "machine",
    "stime": "machine",
    "clock_settime": "machine",
    "clock_adjtime": "machine",
    "adjtimex": "machine",
    "sethostname": "machine",
    "setdomainname": "machine",
    "vhangup": "machine",
    "swapon": "machine",
    "swapoff": "machine",
}
"""System calls the sandbox profile refuses, with the reason (docs/sandbox.md, "Seccomp")."""


def derive(default: dict[str, Any]) -> dict[str, Any]:
    """The sandbox profile from the engine's default profile ``default`` (moby's JSON format).

    Every name of ``DENIED`` is removed from every rule; rules left without names are dropped; every ERRNO rule
    answering ENOSYS becomes a TRACE rule (ENOSYS without a tracer, see above); a TRACE rule for
    ``ENOSYS_NAMES`` is appended. Nothing else changes.

    Raises:
        ValueError: ``default`` does not look like a profile (no ``syscalls`` list, or a default action
            other than an errno).
    """
    if not isinstance(default.get("syscalls"), list) or not str(default.get("defaultAction", "")).startswith(
        "SCMP_ACT_ERRNO"
    ):
        raise ValueError("not a seccomp profile with an errno default action")
    profile = copy.deepcopy(default)
    rules = []
    for rule in profile["syscalls"]:
        names = [name for name in rule.get("names", []) if name not in DENIED]
        if not names:
            continue
        rule = {**rule, "names": names}
        if rule["action"] == "SCMP_ACT_ERRNO" and rule.get("errnoRet") == errno.ENOSYS:
            rule = {key: value for key, value in rule.items() if key != "errnoRet"} | {"action": "SCMP_ACT_TRACE"}
        rules.append(rule)
    rules.append(
        {
            "names": sorted(ENOSYS_NAMES),
            "action": "SCMP_ACT_TRACE",
            "comment": "ptc-sandbox: io_uring answers ENOSYS, as if the kernel had none (no tracer: ENOSYS)",
        }
    )
    profile["syscalls"] = rules
    return profile


@functools.cache
def profile_json() -> str:
    """The shipped profile as compact JSON, ready for ``security_opt`` (``seccomp=`` + this); read once."""
    text = resources.files(__package__).joinpath(PROFILE_RESOURCE).read_text(encoding="utf-8")
    return json.dumps(json.loads(text), separators=(",", ":"))


def main(argv: list[str]) -> int:
    """``python -m service.sandbox.seccomp DEFAULT.json``: print the derived profile."""
    if len(argv) != 1:
        print("usage: python -m service.sandbox.seccomp DEFAULT.json > service/sandbox/seccomp.json", file=sys.stderr)
        return 2
    profile = derive(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    print(json.dumps(profile, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
