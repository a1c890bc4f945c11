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
