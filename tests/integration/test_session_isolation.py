"""A session's earlier script against the later ones, and every script against the resident interpreter.

Each test takes ``runtime_api`` and runs under runc and under gVisor (runsc), in one session per runtime.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest

from service.sandbox.labels import LABEL_SANDBOX, LABEL_UID
from tests.conftest import Service, execute, wait_until

ECHO = [
    {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "endpoint": {"kind": "echo"},
    }
]


@pytest.fixture
def session_id(runtime_api: httpx.Client) -> Iterator[str]:
    response = runtime_api.post("/sessions", json={"tools": ECHO, "env": {"SESSION_SECRET": "s3cr3t-of-the-session"}})
    assert response.status_code == 201, response.text
    sid: str = response.json()["session_id"]
    yield sid
    runtime_api.delete(f"/sessions/{sid}")


# A process whose main thread has exited while another thread runs: /proc shows it as a zombie. Its thread waits
# until the script that started it has ended (its parent is then the interpreter, pid 1), then haunts the later
# scripts: writes into their stdout through /proc, sends a forged call to the broker, and beats in /tmp/beat.
GHOST = """
import ctypes, os, socket, threading, time
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    def haunt():
        beat = 0
        while True:
            time.sleep(0.02)
            if os.getppid() != 1:
                continue
            beat += 1
            with open('/tmp/beat', 'w') as f:
                f.write(str(beat))
            for p in os.listdir('/proc'):
                if p.isdigit() and int(p) not in (1, os.getpid()):
                    try:
                        with open(f'/proc/{p}/fd/1', 'w') as out:
                            out.write('FORGED\\n')
                    except OSError:
                        pass
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect('/run/ptc/tools.sock')
                s.sendall(b'{"id": 1, "tool": "echo", "args": {"x": 666}}\\n')
                time.sleep(0.05)
                s.close()
            except OSError:
                pass
    threading.Thread(target=haunt).start()
    os.write(ready_w, b'x')
    ctypes.CDLL(None).pthread_exit(None)
os.read(ready_r, 1)
for _ in range(100):
    stat = open(f'/proc/{pid}/stat').read()
    if stat[stat.rfind(')') + 2] == 'Z':
        break
    time.sleep(0.01)
print('leader', stat[stat.rfind(')') + 2])
"""

HAUNTED = """
import os, time, tools
time.sleep(0.5)
before = open('/tmp/beat').read() if os.path.exists('/tmp/beat') else None
time.sleep(0.5)
after = open('/tmp/beat').read() if os.path.exists('/tmp/beat') else None
print('beating', before != after)
print('others', [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())])
print(tools.echo(x=1)['args'])
"""

PLANT = """
import os, sys
os.makedirs('/tmp/tools', exist_ok=True)
open('/tmp/tools/__init__.py', 'w').write("print('EVIL tools package')\\n")
open('/tmp/tools/__main__.py', 'w').write("print('EVIL tools main')\\n")
open('/tmp/evil.pth', 'w').write("import sys; print('EVIL pth in tmp')\\n")
open('/tmp/sitecustomize.py', 'w').write("print('EVIL sitecustomize')\\n")
site = os.path.expanduser('~/.local/lib/python%d.%d/site-packages' % sys.version_info[:2])
os.makedirs(site, exist_ok=True)
open(site + '/x.pth', 'w').write("import sys; print('EVIL user pth')\\n")
open(site + '/usercustomize.py', 'w').write("print('EVIL usercustomize')\\n")
open('/tmp/helper.py', 'w').write("print('EVIL helper')\\n")
open('/tmp/main.py', 'w').write("import helper\\n")
print('planted')
"""

SUBPROCESSES = """
import subprocess, sys
for args in (['-c', 'import tools; print(tools.__file__)'], ['-m', 'tools'], ['/tmp/main.py']):
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd='/tmp')
    print(done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1])
import tools
print(tools.__file__)
"""


def test_nothing_a_script_starts_outlives_it(runtime_api: httpx.Client, session_id: str) -> None:
    ghost = execute(runtime_api, GHOST, session_id=session_id)
    assert ghost["status"] == "succeeded" and ghost["stdout"] == "leader Z\n", ghost
    haunted = execute(runtime_api, HAUNTED, session_id=session_id)
    assert haunted["stdout"] == "beating False\nothers []\n{'x': 1}\n", haunted
    assert [call["args"] for call in haunted["calls"]] == [{"x": 1}]
    assert runtime_api.get(f"/sessions/{session_id}").json()["status"] == "ready"


def test_leftovers_in_tmp_never_become_code(runtime_api: httpx.Client, session_id: str) -> None:
    assert execute(runtime_api, PLANT, session_id=session_id)["stdout"] == "planted\n"
    view = execute(runtime_api, SUBPROCESSES, session_id=session_id)
    assert "EVIL" not in view["stdout"] + view["stderr"], view
    assert view["stdout"] == (
        "1 ModuleNotFoundError: No module named 'tools'\n"
        "1 /usr/bin/python3: No module named tools\n"
        "1 ModuleNotFoundError: No module named 'helper'\n"
        "/run/ptc/tools/__init__.py\n"
    ), view


PROBE = """
import ctypes, os, signal, subprocess
libc = ctypes.CDLL(None, use_errno=True)
out = [os.environ.get('SESSION_SECRET'), os.getuid()]
for number in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP, signal.SIGCONT):
    try:
        os.kill(1, number)
        out.append('sent')
    except PermissionError:
        out.append('EPERM')
try:
    out.append(b's3cr3t' in open('/proc/1/environ', 'rb').read())
except PermissionError:
    out.append('EPERM')
try:
    with open('/proc/1/fd/1', 'w') as f:
        f.write('FORGED through the interpreter\\n')
    out.append('wrote')
except PermissionError:
    out.append('EPERM')
out.append((libc.ptrace(16, 1, 0, 0), ctypes.get_errno()))
out.append((libc.unshare(0x10000000), ctypes.get_errno()))
out.append(subprocess.run(['unshare', '-U', 'true'], capture_output=True).returncode != 0)
print(out)
"""


def _script_uid(engine: docker.DockerClient, session_id: str) -> int:
    """The uid the session's sandbox runs its scripts as: its own (``LABEL_UID``), or 10001 (an image without a
    range of uids)."""
    (container,) = engine.containers.list(filters={"label": f"{LABEL_SANDBOX}={session_id}"})
    return int(container.labels.get(LABEL_UID, 10001))


def test_scripts_cannot_reach_the_interpreter(
    runtime_api: httpx.Client, runtime_service: Service, session_id: str, engine: docker.DockerClient
) -> None:
    view = execute(runtime_api, PROBE, session_id=session_id)
    assert view["status"] == "succeeded", view
    found: list[Any] = ast.literal_eval(view["stdout"])
    # The session's env reaches the script, which runs as the sandbox's uid; pid 1 (root) takes no signal from it,
    # shows no env of the session, lends no descriptor and cannot be traced; no user namespace can be made.
    uid = _script_uid(engine, session_id)
    assert found[:6] == ["s3cr3t-of-the-session", uid, "EPERM", "EPERM", "EPERM", "EPERM"], view
    assert found[6] in (False, "EPERM"), view  # gVisor lets any user read /proc/1/environ: it holds no secret
    assert found[7:] == ["EPERM", (-1, 1), (-1, 1), True], view
    assert "FORGED" not in runtime_service.log()
    suicide = execute(runtime_api, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", session_id=session_id)
    assert (suicide["status"], suicide["exit_code"]) == ("failed", 137), suicide  # not oom_killed: it did it
    bomb = "import subprocess\nopen('/tmp/b.sh', 'w').write('sh /tmp/b.sh & sh /tmp/b.sh & wait')\n"
    bomb += "print('bombing', flush=True)\nsubprocess.run(['sh', '/tmp/b.sh'])"
    chain = execute(runtime_api, bomb, session_id=session_id, timeout_s=4)
    # How far the chain gets before the pids limit differs (it may even collapse by itself); the sandbox lives on.
    assert chain["status"] in ("succeeded", "failed", "timed_out") and chain["stdout"] == "bombing\n", chain
    assert chain["error"] is None or chain["error"]["type"] != "sandbox_error", chain
    assert execute(runtime_api, "print('still here')", session_id=session_id)["stdout"] == "still here\n"
    assert runtime_api.get(f"/sessions/{session_id}").json()["status"] == "ready"


# Run in the session's container through the engine (root, with the sandbox's capabilities): with an argument,
# SIGKILL that pid first; then the live processes of the sandbox but pid 1 and this one, as
# [pid, ppid, uid, oom_score_adj, Seccomp mode, CapEff].
LOOK = """
import os, sys
if len(sys.argv) > 1:
    os.kill(int(sys.argv[1]), 9)
found = []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) not in (1, os.getpid()):
        try:
            lines = open(f'/proc/{p}/status').read().splitlines()
            adj = open(f'/proc/{p}/oom_score_adj').read().strip()
        except OSError:
            continue
        pairs = (line.split(':', 1) for line in lines if ':' in line)
        status = {k: (v.split() or [''])[0] for k, v in pairs}
        if status.get('State') not in ('Z', 'X'):
            fields = [status.get(k) for k in ('PPid', 'Uid', 'Seccomp', 'CapEff')]
            found.append([int(p), fields[0], fields[1], adj, *fields[2:]])
print(found)
"""


def _look(container: Any, kill: int | None = None) -> list[list[Any]]:
    done = container.exec_run(["python3", "-c", LOOK, *([str(kill)] if kill else [])], user="0")
    assert done.exit_code == 0, done.output
    found: list[list[Any]] = ast.literal_eval(done.output.decode())
    return found


def test_the_next_scripts_process_waits_confined_and_a_lost_one_is_replaced(
    runtime_api: httpx.Client, engine: docker.DockerClient, runtime: str, session_id: str
) -> None:
    """Between runs the session's sandbox holds one process besides its interpreter: the next script's, forked after
    the last script ended and everything of it was killed, already confined as a script (10001, no capability,
    the OOM killer's first choice, the seccomp filter under runc) and waiting for its run. One killed meanwhile (the
    OOM killer, say: /tmp is memory) is replaced at the next run, which runs as any other."""
    first = execute(runtime_api, "import os\nos.environ['LEFT'] = '1'\nprint(1)", session_id=session_id)
    assert first["stdout"] == "1\n", first
    (container,) = engine.containers.list(filters={"label": f"{LABEL_SANDBOX}={session_id}"})
    found: list[list[Any]] = []

    def one_waits() -> bool:
        found[:] = _look(container)
        return len(found) == 1

    wait_until(one_waits, 10)
    pid, ppid, uid, adj, seccomp, caps = found[0]
    own = _script_uid(engine, session_id)
    assert (ppid, uid, adj, int(caps, 16)) == ("1", str(own), "1000", 0), found
    if runtime == "runc":
        assert seccomp == "2", found  # gVisor's /proc shows no filter
    _look(container, kill=pid)
    wait_until(lambda: _look(container) == [], 10)
    view = execute(runtime_api, "import os\nprint(os.environ.get('LEFT'), os.getuid())", session_id=session_id)
    assert (view["status"], view["exit_code"], view["stdout"]) == ("succeeded", 0, f"None {own}\n"), view
    wait_until(one_waits, 10)
    assert found[0][0] != pid, found


# A script that locks what it leaves in outputs/: a read-only folder (0555), a sticky one, one nobody may enter
# (0000), a symlink to a folder of /tmp (never followed: what it points to stays), a hard link to a file it does not
# own (where the kernel allows one).
LOCK_OUTPUTS = """
import os
os.makedirs('/tmp/keep', exist_ok=True)
open('/tmp/keep/precious', 'w').write('kept')
os.makedirs('outputs/deep/deeper', exist_ok=True)
open('outputs/planted.txt', 'w').write('planted')
open('outputs/deep/planted.txt', 'w').write('planted')
open('outputs/deep/deeper/planted.txt', 'w').write('planted')
os.symlink('/tmp/keep', 'outputs/link')
try:
    os.link('/etc/hostname', 'outputs/hard')
except OSError:
    pass
os.chmod('outputs/deep/deeper', 0)
os.chmod('outputs/deep', 0o1777)
os.chmod('outputs', 0o555)
print('locked')
"""


def test_outputs_a_script_locks_are_not_a_later_jobs(runtime_api: httpx.Client, session_id: str) -> None:
    """Whatever modes a script leaves on what it wrote under outputs/, the folder is emptied after it (its
    symlinks not followed), so no later job of the session lists it as its own."""
    locked = execute(runtime_api, LOCK_OUTPUTS, session_id=session_id)
    assert (locked["status"], locked["stdout"]) == ("succeeded", "locked\n"), locked
    assert "outputs/planted.txt" in [entry["path"] for entry in locked["files"]], locked
    look = "import os\nprint(os.listdir('outputs'), os.access('outputs', os.W_OK), open('/tmp/keep/precious').read())"
    later = execute(runtime_api, look, session_id=session_id)
    assert (later["status"], later["files"]) == ("succeeded", []), later
    assert later["stdout"] == "[] True kept\n", later
    # Locked again with the folder the cleanup left: the same.
    again = execute(runtime_api, LOCK_OUTPUTS, session_id=session_id)
    assert again["status"] == "succeeded", again
    assert execute(runtime_api, look, session_id=session_id)["files"] == []


# Reads the script's own memory (every mapping /proc/self/maps lists as readable) for the markers an earlier run of
# the session was given (its env value, the bytes of a file put in): what the process inherited from the resident
# interpreter. The markers are never in this script: only their prefixes, each candidate compared by its sha256.
SCAN_MEMORY = """
import hashlib, re
found = set()
pattern = re.compile(rb'(ptcleak|ptcfile)-([0-9a-f]{32})')
with open('/proc/self/maps') as maps:
    regions = [line.split()[:2] for line in maps]
with open('/proc/self/mem', 'rb', 0) as mem:
    for span, perms in regions:
        if 'r' not in perms:
            continue
        low, high = (int(x, 16) for x in span.split('-'))
        try:
            mem.seek(low)
            data = mem.read(high - low)
        except (OSError, ValueError, OverflowError):
            continue
        for match in pattern.finditer(data):
            found.add(hashlib.sha256(match.group(0)).hexdigest())
        del data
print(sorted(found))
"""


def test_no_run_leaves_its_env_or_files_in_what_later_scripts_inherit(
    runtime_api: httpx.Client, session_id: str
) -> None:
    """A run's env and the bytes of a file put in never pass through the resident interpreter's memory, which
    every later script of the session inherits (fork): a later script scanning its own memory finds neither."""
    import hashlib
    import secrets

    env_marker = "ptcleak-" + secrets.token_hex(16)
    file_marker = "ptcfile-" + secrets.token_hex(16)
    put = runtime_api.put(f"/sessions/{session_id}/files/upload.txt", content=file_marker.encode() * 3)
    assert put.status_code in (200, 201, 204), put.text
    used = "import os\nprint(os.environ['RUN_SECRET'] == %r, open('upload.txt').read(7))\nos.remove('upload.txt')"
    first = execute(runtime_api, used % env_marker, session_id=session_id, env={"RUN_SECRET": env_marker})
    assert first["stdout"] == "True ptcfile\n", first
    later = execute(runtime_api, SCAN_MEMORY, session_id=session_id)
    assert later["status"] == "succeeded", later
    found = ast.literal_eval(later["stdout"])
    for marker in (env_marker, file_marker):
        assert hashlib.sha256(marker.encode()).hexdigest() not in found, (marker, later)


# What a script sees of the host and of the interpreter: the unix sockets' addresses (one connected to the broker
# meanwhile), pid 1's memory map, auxiliary vector and its fd 0.
LOOK_AROUND = """
import os, tools
tools.echo(x=1)
lines = open('/proc/net/unix').read().splitlines()[1:]
paths = [line.split()[7] for line in lines if len(line.split()) > 7]
out = {'paths': paths}
for name in ('maps', 'smaps', 'auxv', 'mem', 'environ'):
    try:
        with open('/proc/1/' + name, 'rb') as f:
            f.read(1)
        out[name] = 'read'
    except OSError as exc:
        out[name] = exc.errno
try:
    with open('/proc/1/fd/0', 'rb') as f:
        out['fd0'] = (os.path.samestat(os.fstat(f.fileno()), os.stat('/dev/null')), f.read(1))
except OSError as exc:
    out['fd0'] = exc.errno
print(out)
"""


def test_a_script_sees_no_host_path_and_nothing_of_the_interpreter(
    runtime_api: httpx.Client, runtime: str, session_id: str
) -> None:
    """No socket address names a host path (the service binds its sockets as ``/proc/self/fd/N/name``); pid 1's
    memory is unreadable and its fd 0 is /dev/null. Under runc its map and auxiliary vector are unreadable too;
    gVisor lets any user read those (they show the mappings every script inherits by fork: nothing of a run)."""
    view = execute(runtime_api, LOOK_AROUND, session_id=session_id)
    assert view["status"] == "succeeded", view
    out = ast.literal_eval(view["stdout"])
    assert all(path.startswith("/proc/self/fd/") for path in out["paths"]), out
    assert out["paths"] or runtime == "runsc", out  # gVisor lists no socket of the host's
    assert out["mem"] == 13 and out["fd0"] in (13, (True, b"")), out
    if runtime == "runc":
        assert (out["maps"], out["smaps"], out["auxv"], out["environ"]) == (13, 13, 13, 13), out


# Everything a script can reach under its working directory and HOME (both /tmp) that it cannot write: what the
# resident interpreter (root) made there before any script.
UNWRITABLE = """
import os
bad = []
for folder, folders, files in os.walk('/tmp'):
    for path in [folder] + [os.path.join(folder, name) for name in files]:
        if not os.path.islink(path) and not os.access(path, os.W_OK):
            bad.append(path)
print(sorted(bad))
"""


def test_nothing_in_tmp_is_unwritable_for_scripts(runtime_api: httpx.Client, session_id: str) -> None:
    """What the sandbox holds in /tmp before a script (one-shot or in a session) is the script user's to write."""
    for view in (execute(runtime_api, UNWRITABLE), execute(runtime_api, UNWRITABLE, session_id=session_id)):
        assert (view["status"], view["stdout"]) == ("succeeded", "[]\n"), (view.get("error"), view.get("stderr"))


# Takes every inotify instance it can (until EMFILE) and holds them: prints its uid and how many it took.
HOG_INOTIFY = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 4096:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
print(os.getuid(), len(held), ctypes.get_errno() == 24, flush=True)
time.sleep(120)
"""
ONE_INOTIFY = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(os.getuid(), fd >= 0, ctypes.get_errno() if fd < 0 else 0)
"""


def test_sandboxes_do_not_share_per_user_kernel_limits(runtime_api: httpx.Client, engine: docker.DockerClient) -> None:
    """Issue 24, item 13: under runc every script ran as host uid 10001, so one tenant's script that took all 128
    inotify instances (``fs.inotify.max_user_instances``, per user) left another sandbox's script ``EMFILE``. Each
    sandbox now runs its scripts as a uid of its own: two live sessions differ, and one's exhaustion is its own."""
    sessions = []
    try:
        for _ in range(2):
            answer = runtime_api.post("/sessions", json={})
            assert answer.status_code == 201, answer.text
            sessions.append(answer.json()["session_id"])
        uids = [_script_uid(engine, sid) for sid in sessions]
        assert uids[0] != uids[1] and 10001 not in uids, uids
        hog = runtime_api.post("/execute", json={"script": HOG_INOTIFY, "session_id": sessions[0], "wait_s": 0})
        assert hog.status_code in (200, 202), hog.text
        job = hog.json()["job_id"]
        held: list[str] = []

        def hogging() -> bool:
            view = runtime_api.get(f"/jobs/{job}").json()
            assert view["status"] in ("queued", "running"), view
            held[:] = view["stdout"].split()
            return bool(held)

        wait_until(hogging, 60)
        assert held == [str(uids[0]), held[1], "True"] and int(held[1]) > 0, held  # stopped by EMFILE
        other = execute(runtime_api, ONE_INOTIFY, session_id=sessions[1])
        assert (other["status"], other["stdout"]) == ("succeeded", f"{uids[1]} True 0\n"), other
        runtime_api.post(f"/jobs/{job}/stop")
    finally:
        for sid in sessions:
            runtime_api.delete(f"/sessions/{sid}")
