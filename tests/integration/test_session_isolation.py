"""A session's earlier script against the later ones, and every script against the resident interpreter.

Each test takes ``runtime_api`` and runs under runc and under gVisor (runsc), in one session per runtime.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Service, execute

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


def test_scripts_cannot_reach_the_interpreter(
    runtime_api: httpx.Client, runtime_service: Service, session_id: str
) -> None:
    view = execute(runtime_api, PROBE, session_id=session_id)
    assert view["status"] == "succeeded", view
    found: list[Any] = ast.literal_eval(view["stdout"])
    # The session's env reaches the script, which runs as 10001; pid 1 (root) takes no signal from it, shows no
    # env of the session, lends no descriptor and cannot be traced; no user namespace can be made.
    assert found[:6] == ["s3cr3t-of-the-session", 10001, "EPERM", "EPERM", "EPERM", "EPERM"], view
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
