"""The sandboxes' seccomp profile: derived from the engine's default, denies what it says, by system call.

The syscall tests run a script under runc and under gVisor (``runtime_api``): each forbidden call must fail
with ENOSYS or EPERM, and an ordinary script (threads, subprocesses, multiprocessing, asyncio) must still work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.sandbox.docker import runtime_problem
from service.sandbox.seccomp import DENIED, ENOSYS_NAMES, derive, profile_json
from tests.conftest import ROOT

UPSTREAM = ROOT / "deploy" / "seccomp" / "moby-default-v20.10.24.json"


SHIPPED = ROOT / "service" / "sandbox" / "seccomp.json"


def test_shipped_profile_is_the_engine_default_minus_the_denied_calls() -> None:
    upstream = json.loads(UPSTREAM.read_text())
    assert json.loads(SHIPPED.read_text()) == derive(upstream)  # regenerate: see service/sandbox/seccomp.py
    assert json.loads(profile_json()) == json.loads(SHIPPED.read_text())
    upstream_allowed = {n for rule in upstream["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for n in rule["names"]}
    assert {"io_uring_setup", "ptrace", "unshare", "bpf"} <= upstream_allowed  # what the default profile let through


PROMISED = frozenset(
    {
        *("io_uring_setup", "io_uring_enter", "io_uring_register"),
        *("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
        *("unshare", "setns"),
        *("mount", "umount2", "fsopen", "open_tree", "pivot_root", "chroot"),
        *("bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "modify_ldt"),
        *("open_by_handle_at", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module"),
        *("reboot", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "swapon"),
    }
)
"""The calls docs/sandbox.md ("Seccomp") says the profile refuses: written out here, not taken from ``DENIED``, so
that a name dropped from ``DENIED`` (and the profile regenerated) fails a test."""


def test_the_calls_the_documentation_promises_are_denied() -> None:
    assert set(DENIED) >= PROMISED, sorted(PROMISED - set(DENIED))
    profile: dict[str, Any] = json.loads(SHIPPED.read_text())
    allowed = {name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert not allowed & PROMISED, sorted(allowed & PROMISED)
    assert {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= ENOSYS_NAMES


def test_profile_allows_none_of_the_denied_calls_whatever_the_capabilities() -> None:
    profile: dict[str, Any] = json.loads(SHIPPED.read_text())
    allowed = {name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert not allowed & set(DENIED)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    traced = {name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_TRACE" for name in rule["names"]}
    assert traced == set(ENOSYS_NAMES) | {"clone3"}  # ENOSYS with no tracer, under runc and gVisor alike
    assert not any("errnoRet" in rule for rule in profile["syscalls"])  # runsc before 2023 ignores errnoRet


def test_a_gvisor_runtime_without_oci_seccomp_is_refused() -> None:
    runtimes = {
        "runc": {"path": "runc"},
        "runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--host-uds=open"]},
        "gvisor": {"path": "/opt/bin/runsc", "runtimeArgs": ["--oci-seccomp"]},
    }
    assert runtime_problem("runc", runtimes) is None
    assert runtime_problem("gvisor", runtimes) is None
    problem = runtime_problem("runsc", runtimes)
    assert problem is not None and "--oci-seccomp" in problem
    missing = runtime_problem("kata", runtimes)
    assert missing is not None and "no runtime 'kata'" in missing


def test_profile_file_ships_with_the_package() -> None:
    assert Path(SHIPPED).is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"sandbox/seccomp.json"' in pyproject
