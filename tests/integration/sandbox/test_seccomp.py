"""The sandboxes' seccomp profile: derived from the engine's default, denies what it says, by system call.

The syscall tests run a script under runc and under gVisor (``runtime_api``): each forbidden call must fail
with ENOSYS or EPERM, and an ordinary script (threads, subprocesses, multiprocessing, asyncio) must still work.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import execute

PROBE = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
params = ctypes.create_string_buffer(120)
attr = ctypes.create_string_buffer(128)
attr[4:8] = (128).to_bytes(4, "little")  # perf_event_attr.size; type 0 (hardware)

def call(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
    if result == 0 and number == 56:  # a clone that worked: this is the child
        os._exit(0)
    if result > 0 and number == 56:
        os.waitpid(result, 0)
    error = ctypes.get_errno()
    return [result, errno.errorcode.get(error, str(error)) if result == -1 else None]

print(json.dumps({
    "io_uring_setup": call(425, 8, ctypes.addressof(params)),
    "io_uring_enter": call(426, 0, 0, 0, 0, 0, 0),
    "io_uring_register": call(427, 0, 0, 0, 0),
    "unshare(CLONE_NEWUSER)": call(272, CLONE_NEWUSER),
    "unshare(CLONE_NEWNS)": call(272, CLONE_NEWNS),
    "clone(CLONE_NEWUSER)": call(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0),
    "userfaultfd": call(323, 0),
    "perf_event_open": call(298, ctypes.addressof(attr), 0, -1, -1, 0),
    "bpf": call(321, 0, 0, 0),
    "keyctl": call(250, 0, 0),
    "add_key": call(248, 0, 0, 0, 0, 0),
    "ptrace(PTRACE_TRACEME)": call(101, 0, 0, 0, 0),
    "mount": call(165, 0, 0, 0, 0, 0),
    "kexec_load": call(246, 0, 0, 0, 0),
}))
"""


ORDINARY = r"""
import asyncio, concurrent.futures, multiprocessing, subprocess, sys, threading

results = []
worker = threading.Thread(target=lambda: results.append("thread"))
worker.start()
worker.join()
child = subprocess.run([sys.executable, "-c", "print('subprocess')"], capture_output=True, text=True)
results.append(child.stdout.strip())
with multiprocessing.Pool(2) as pool:  # builtins: the script's own functions do not pickle from /run/ptc
    results.append(pool.map(abs, [-1, -4, -9]))
with concurrent.futures.ProcessPoolExecutor(2) as executor:
    results.append(list(executor.map(pow, [4, 5], [2, 2])))

async def spawn():
    code = "print('asyncio')"
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    return out.decode().strip()

results.append(asyncio.run(spawn()))
print(results)
"""


def test_forbidden_system_calls_fail_inside_the_sandbox(runtime_api: httpx.Client) -> None:
    view = execute(runtime_api, PROBE)
    assert view["status"] == "succeeded", (view["stderr"], view["error"])
    results = json.loads(view["stdout"])
    let_through = {name: out for name, out in results.items() if out[0] != -1 or out[1] not in {"ENOSYS", "EPERM"}}
    assert let_through == {}
    assert all(results[name][1] == "ENOSYS" for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"))


@pytest.mark.parametrize("session", [False, True], ids=["one-shot", "session"])
def test_an_ordinary_script_still_works(runtime_api: httpx.Client, session: bool) -> None:
    body: dict[str, Any] = {}
    if session:
        created = runtime_api.post("/sessions", json={})
        assert created.status_code in (200, 201), created.text
        body["session_id"] = created.json()["session_id"]
    try:
        view = execute(runtime_api, ORDINARY, **body)
    finally:
        if session:
            runtime_api.delete(f"/sessions/{body['session_id']}")
    assert view["status"] == "succeeded", (view["stderr"], view["error"])
    assert view["stdout"] == "['thread', 'subprocess', [1, 4, 9], [16, 25], 'asyncio']\n", view
