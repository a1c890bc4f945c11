"""Hostile scripts against the Monty engine (``engine: "monty"``) through the real service: memory and CPU bombs,
deep recursion, output floods, file, network, process and native-module escapes, interpreter crash attempts, the
worker's confinement seen from the host (``/proc``), isolation between API keys, and tool-call floods.

Where the container engine gives a verdict for the same script, the Monty job's is compared with it on the same
service. A script of each kind must end with a clear verdict, the service must keep serving, and the next script of
the same key must run.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import docker
import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import Service, execute, start_service, stop_clean

ECHO: dict[str, Any] = {"name": "echo", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}
TENANT_TOKENS = {name: f"{name}-{secrets.token_urlsafe(24)}" for name in ("alice", "bob")}
ENDED = frozenset({"succeeded", "failed", "oom_killed", "timed_out"})
WORKER_CMDLINE = [b"/monty", b"subprocess"]
T = TypeVar("T")


@pytest.fixture(scope="module")
def hostile_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    svc = start_service(f"pytest-monty-hostile-{secrets.token_hex(3)}", scratch / "svc-monty-hostile",
                        PTC_WARM_POOL_SIZE="0")  # fmt: skip
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def api(hostile_service: Service) -> Iterator[httpx.Client]:
    with hostile_service.client() as client:
        yield client


@pytest.fixture(scope="module")
def tenants_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service with the keys ``alice`` and ``bob`` besides the suite's own, one Monty worker per key."""
    keys = scratch / f"monty-hostile-keys-{secrets.token_hex(3)}"
    keys.write_text("".join(f"{name}:{hash_token(token)}\n" for name, token in TENANT_TOKENS.items()))
    svc = start_service(
        f"pytest-monty-tenants-{secrets.token_hex(3)}",
        scratch / "svc-monty-tenants",
        PTC_WARM_POOL_SIZE="0",
        PTC_API_KEYS_FILE=str(keys),
        PTC_MONTY_WORKERS_PER_KEY="1",
    )
    yield svc
    stop_clean(engine, svc)


def tenant(svc: Service, name: str) -> httpx.Client:
    return httpx.Client(base_url=svc.url, timeout=60, headers={"Authorization": f"Bearer {TENANT_TOKENS[name]}"})


def monty(api: httpx.Client, script: str, tools: list[dict[str, Any]] | None = None, **body: Any) -> dict[str, Any]:
    return execute(api, script, [ECHO] if tools is None else tools, **{"engine": "monty", **body})


def container(api: httpx.Client, script: str, **body: Any) -> dict[str, Any]:
    return execute(api, script, [ECHO], **body)


def start(api: httpx.Client, script: str, **body: Any) -> str:
    """Start a Monty job without waiting for it; its id."""
    answer = api.post("/execute", json={"script": script, "tools": [ECHO], "engine": "monty", "wait_s": 0, **body})
    assert answer.status_code in (200, 202), answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


def ended(api: httpx.Client, job_id: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """The job's view once it has ended (fails the test past ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        view: dict[str, Any] = api.get(f"/jobs/{job_id}").json()
        if view["status"] not in ("queued", "running"):
            return view
        assert time.monotonic() < deadline, f"job {job_id} still {view['status']} after {timeout_s} s"
        time.sleep(0.1)


def report(view: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = ((view.get("error") or {}).get("script_report")) or {}
    return found


def verdict(view: dict[str, Any]) -> tuple[str, str | None]:
    return view["status"], (view.get("error") or {}).get("type")


def assert_next_script_runs(api: httpx.Client) -> None:
    """The service answers and the key's next Monty script runs."""
    assert api.get("/healthz").status_code == 200
    after = monty(api, "print('next')", timeout_s=10)
    assert (after["status"], after["stdout"]) == ("succeeded", "next\n"), after


# -- the host's view of the workers (/proc) ----------------------------------------------------------------------


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0


def service_workers(svc: Service) -> list[int]:
    """Pids of the ``/monty subprocess`` worker processes descending from ``svc``'s process."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] != WORKER_CMDLINE:
                continue
            ancestor = pid
            for _ in range(6):
                ancestor = _ppid(ancestor)
                if ancestor in (svc.process.pid, 0, 1):
                    break
            if ancestor == svc.process.pid:
                found.append(pid)
        except OSError:
            continue
    return found


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])  # utime + stime


def busy_workers(svc: Service, sample_s: float = 0.3) -> set[int]:
    """The workers of ``svc`` that used the CPU most of ``sample_s`` (running a script)."""
    before = {pid: _cpu_ticks(pid) for pid in service_workers(svc)}
    time.sleep(sample_s)
    hz = os.sysconf("SC_CLK_TCK")
    return {pid for pid, ticks in before.items() if ticks >= 0 and _cpu_ticks(pid) - ticks >= sample_s * hz / 2}


def poll(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float) -> T:
    """``probe()`` until ``done`` says yes, or its last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    value = probe()
    while not done(value) and time.monotonic() < deadline:
        value = probe()
    return value


def proc_fields(pid: int, name: str) -> dict[str, str]:
    """``/proc/<pid>/<name>`` (``status``) as field -> value."""
    lines = Path(f"/proc/{pid}/{name}").read_text().splitlines()
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines)}


def proc_limit(pid: int, label: str) -> tuple[str, str]:
    """The soft and hard values of ``label`` (``Max open files``) in ``/proc/<pid>/limits``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith(label):
            soft, hard = line[len(label) :].split()[:2]
            return soft, hard
    raise AssertionError(f"{label} not in /proc/{pid}/limits")


LOOP = "n = 0\nwhile True:\n    n += 1\n"


# -- memory ------------------------------------------------------------------------------------------------------

MEMORY_BOMBS = {
    "list-growth": "x = []\nwhile True:\n    x.append(len(x))\n",
    "string-multiplication": "s = 'a' * (10 ** 9)\nprint(len(s))\n",
    "string-doubling": "s = 'a'\nwhile True:\n    s = s + s\n",
    "dict-growth": "d = {}\ni = 0\nwhile True:\n    d[i] = i\n    i += 1\n",
    "deep-nested-lists": "x = []\nwhile True:\n    x = [x, [1, 2, 3]]\n",
    "huge-int-2**(10**9)": "n = 2 ** (10 ** 9)\nprint(n > 0)\n",
    "list-multiplication": "x = [0] * (10 ** 9)\n",
    "join-of-1000-1MB-strings": "x = ['a' * 10 ** 6] * 1000\ny = ''.join(x)\nprint(len(y))\n",
    "str-encode": "x = ('é' * (20 * 2 ** 20)).encode()\nprint(len(x))\n",
    "str-split": "x = ('a ' * (20 * 2 ** 20)).split()\nprint(len(x))\n",
}


WORKER_ENDED = {"join-of-1000-1MB-strings", "str-encode", "str-split"}  # past the heap's accounting: the worker ends


@pytest.mark.parametrize("bomb", list(MEMORY_BOMBS), ids=list(MEMORY_BOMBS))
def test_a_memory_bomb_ends_oom_killed_as_in_a_container(api: httpx.Client, bomb: str) -> None:
    script = "print('start')\n" + MEMORY_BOMBS[bomb]
    body: dict[str, Any] = {"limits": {"memory_mb": 64}, "timeout_s": 15}
    monty_view = monty(api, script, **body)
    container_view = container(api, script, **body)
    # the verdict and what the script printed before it, both engines; a worker the interpreter's limit did not
    # stop in time is ended by its pool, and what it printed in its last PRINT_FLUSH_S (1 ms) may be lost with it
    # (docs/engines.md, Limits under Monty)
    assert (verdict(monty_view), verdict(container_view)) == (("oom_killed", "oom"),) * 2, (
        monty_view["stderr"][-300:],
        report(monty_view),
    )
    assert container_view["stdout"] == "start\n"
    if bomb in WORKER_ENDED:
        assert "start\n".startswith(monty_view["stdout"]), monty_view["stdout"]
    else:
        assert monty_view["stdout"] == "start\n", monty_view["stderr"][-300:]
    assert_next_script_runs(api)


def test_a_huge_int_counts_eight_times_its_size_under_monty(api: httpx.Client) -> None:
    """``2 ** (10 ** 8)`` is 12.5 MB: a container with 64 MiB computes it; Monty 1.4 counts a big integer's bits as
    bytes against the heap limit (95 MiB here), so it needs ``memory_mb`` 128 (docs/engines.md, Limits under
    Monty), and past the limit the job ends ``oom_killed`` as any other."""
    script = "n = 2 ** (10 ** 8)\nprint(n > 0)\n"
    small: dict[str, Any] = {"limits": {"memory_mb": 64}, "timeout_s": 15}
    assert verdict(container(api, script, **small)) == ("succeeded", None)
    assert verdict(monty(api, script, **small)) == ("oom_killed", "oom")
    enough = monty(api, script, limits={"memory_mb": 128}, timeout_s=15)
    assert (verdict(enough), enough["stdout"]) == (("succeeded", None), "True\n"), enough["stderr"][-300:]


def test_a_script_cannot_forge_an_oom_verdict(api: httpx.Client) -> None:
    """The verdict is what the service observed (docs/threat-model.md: a script cannot write its job's verdict); a
    MemoryError the script raises itself is its own failure, as a container's script's is."""
    script = "raise MemoryError('memory limit exceeded: 67108865 bytes > 67108864 bytes')\n"
    view = monty(api, script)
    assert verdict(view) == ("failed", "nonzero_exit"), view
    assert report(view)["type"] == "MemoryError"


# -- CPU and time ------------------------------------------------------------------------------------------------

CPU_BOMBS = {
    "endless-loop": "while True:\n    pass\n",
    "arithmetic": "x = 0\nfor i in range(10 ** 12):\n    x += i * i\n",
    "native-factorial": "import math\nx = math.factorial(10 ** 7)\nprint(x > 0)\n",
    "big-int-products": "x = 3 ** (10 ** 7)\ny = x * x\nz = y * y\nprint(z > 0)\n",
    "sorting-forever": "import random\nwhile True:\n    sorted([random.random() for _ in range(100000)])\n",
}


@pytest.mark.parametrize("bomb", list(CPU_BOMBS), ids=list(CPU_BOMBS))
def test_a_cpu_bomb_ends_timed_out_and_its_worker_is_freed(
    api: httpx.Client, hostile_service: Service, bomb: str
) -> None:
    body: dict[str, Any] = {"timeout_s": 1, "limits": {"memory_mb": 512}}
    started = time.monotonic()
    monty_view = monty(api, CPU_BOMBS[bomb], **body)
    assert time.monotonic() - started < 6
    container_view = container(api, CPU_BOMBS[bomb], **body)
    assert verdict(monty_view) == verdict(container_view) == ("timed_out", "timeout"), (monty_view, container_view)
    assert_next_script_runs(api)
    still_busy = poll(lambda: busy_workers(hostile_service), lambda busy: not busy, 5)
    assert not still_busy, f"workers still burning CPU after the job ended: {still_busy}"


# -- recursion ---------------------------------------------------------------------------------------------------

RECURSIONS = {
    "plain": "def f(n):\n    return f(n + 1)\nf(0)\n",
    "lambda": "f = lambda x: f(x)\nf(0)\n",
    "mutual": "def a(n):\n    return b(n)\ndef b(n):\n    return a(n)\na(0)\n",
    "through-sorted-key": "def f(x):\n    return sorted([1, 2], key=f)\nf(0)\n",
    "through-map": "def f(x):\n    return list(map(f, [x]))\nf(0)\n",
    "through-a-comprehension": "def f(x):\n    return [f(y) for y in [x]]\nf(0)\n",
}


@pytest.mark.parametrize("case", list(RECURSIONS), ids=list(RECURSIONS))
def test_deep_recursion_is_a_recursion_error_as_in_a_container(api: httpx.Client, case: str) -> None:
    monty_view = monty(api, RECURSIONS[case], timeout_s=10)
    container_view = container(api, RECURSIONS[case], timeout_s=10)
    assert verdict(monty_view) == verdict(container_view) == ("failed", "nonzero_exit"), (monty_view, container_view)
    assert report(monty_view)["type"] == report(container_view)["type"] == "RecursionError"
    assert "RecursionError" in monty_view["stderr"]
    assert_next_script_runs(api)


# -- output ------------------------------------------------------------------------------------------------------

OUTPUT_FLOODS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "endless-print": ("stdout", "while True:\n    print('x' * 1000)\n", {"timeout_s": 2}),
    "one-enormous-print": ("stdout", "print('y' * (50 * 1024 * 1024))\n", {"timeout_s": 15}),
    "endless-stderr": ("stderr", "import sys\nwhile True:\n    print('e' * 1000, file=sys.stderr)\n", {"timeout_s": 2}),
    "many-small-prints": ("stdout", "for i in range(300000):\n    print(i)\nprint('end')\n", {"timeout_s": 15}),
}


@pytest.mark.parametrize("flood", list(OUTPUT_FLOODS), ids=list(OUTPUT_FLOODS))
def test_an_output_flood_is_capped_as_in_a_container(api: httpx.Client, flood: str) -> None:
    stream, script, body = OUTPUT_FLOODS[flood]
    cap = 4096
    views = {
        "monty": monty(api, script, limits={"output_bytes": cap}, **body),
        "container": container(api, script, limits={"output_bytes": cap}, **body),
    }
    assert verdict(views["monty"]) == verdict(views["container"]), views
    for name, view in views.items():
        assert view[f"{stream}_truncated"] is True, (name, {k: v for k, v in view.items() if k.startswith(stream)})
        assert len(view[stream].encode()) <= cap + 64 and "elided by ptc-sandbox" in view[stream], name
        assert view[f"{stream}_bytes"] > cap and view[f"{stream}_retained_bytes"] <= 16 * 1024 * 1024, name
    if flood in ("one-enormous-print", "many-small-prints"):  # the whole output is counted alike
        assert views["monty"]["stdout_bytes"] == views["container"]["stdout_bytes"]
        assert views["monty"]["stdout_retained_bytes"] == views["container"]["stdout_retained_bytes"]
        assert views["monty"]["stdout"] == views["container"]["stdout"]
    assert_next_script_runs(api)


# -- files, network, processes, native modules -------------------------------------------------------------------

HOST_MARK = f"/tmp/ptc-monty-hostile-{secrets.token_hex(6)}"

FILE_ATTEMPTS: dict[str, tuple[str, set[str]]] = {
    "open-etc-passwd": ("print(open('/etc/passwd').read())", {"PermissionError"}),
    "open-binary": ("print(open('/etc/shadow', 'rb').read())", {"PermissionError"}),
    "proc-self-status": ("print(open('/proc/self/status').read())", {"PermissionError"}),
    "proc-self-environ": ("print(open('/proc/self/environ').read())", {"PermissionError"}),
    "proc-1-root": ("print(open('/proc/1/root/etc/hostname').read())", {"PermissionError"}),
    "write-host-tmp": (f"open('{HOST_MARK}', 'w').write('owned')", {"PermissionError"}),
    "pathlib-read": ("from pathlib import Path\nprint(Path('/etc/passwd').read_text())", {"PermissionError"}),
    "pathlib-write": (f"from pathlib import Path\nPath('{HOST_MARK}').write_text('owned')", {"PermissionError"}),
    "pathlib-iterdir": ("import pathlib\nprint(list(pathlib.Path('/').iterdir()))", {"PermissionError"}),
    "os-listdir": ("import os\nprint(os.listdir('/'))", {"PermissionError"}),
    "os-scandir": ("import os\nprint(list(os.scandir('/etc')))", {"PermissionError"}),
    "os-stat": ("import os\nprint(os.stat('/etc/passwd'))", {"PermissionError"}),
    "os-mkdir": (f"import os\nos.mkdir('{HOST_MARK}')", {"PermissionError"}),
    "os-remove": ("import os\nos.remove('/etc/hostname')", {"PermissionError"}),
    "os-open": ("import os\nos.open('/etc/passwd', 0)", {"AttributeError"}),
    "os-environ": ("import os\nprint(dict(os.environ))", {"RuntimeError"}),
    "os-getenv": ("import os\nprint(os.getenv('PATH'))", {"RuntimeError"}),
    "io-open": ("import io\nprint(io.open('/etc/passwd').read())", {"ModuleNotFoundError"}),
}
SOCKET_ATTEMPTS: dict[str, tuple[str, set[str]]] = {
    "import-socket": ("import socket\ns = socket.create_connection(('127.0.0.1', PORT))", {"ModuleNotFoundError"}),
    "urllib": ("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:PORT/')", {"ModuleNotFoundError"}),
    "http-client": (
        "import http.client\nhttp.client.HTTPConnection('127.0.0.1', PORT).request('GET', '/')",
        {"ModuleNotFoundError"},
    ),
    "ssl": ("import ssl", {"ModuleNotFoundError"}),
    "select": ("import select", {"ModuleNotFoundError"}),
    "asyncio-open-connection": (
        "import asyncio\nasync def main():\n    await asyncio.open_connection('127.0.0.1', PORT)\nasyncio.run(main())",
        {"AttributeError"},
    ),
}
PROCESS_ATTEMPTS: dict[str, tuple[str, set[str]]] = {
    "os-system": (f"import os\nos.system('touch {HOST_MARK}')", {"AttributeError"}),
    "subprocess": (f"import subprocess\nsubprocess.run(['touch', '{HOST_MARK}'])", {"ModuleNotFoundError"}),
    "os-fork": ("import os\nos.fork()", {"AttributeError"}),
    "os-execv": ("import os\nos.execv('/bin/sh', ['sh', '-c', 'id'])", {"AttributeError"}),
    "os-popen": ("import os\nos.popen('id')", {"AttributeError"}),
    "os-spawnl": ("import os\nos.spawnl(0, '/bin/sh', 'sh')", {"AttributeError"}),
    "os-kill": ("import os\nos.kill(1, 9)", {"AttributeError"}),
    "multiprocessing": ("import multiprocessing", {"ModuleNotFoundError"}),
    "threading": ("import threading", {"ModuleNotFoundError"}),
    "signal": ("import signal", {"ModuleNotFoundError"}),
}
ESCAPE_ATTEMPTS: dict[str, tuple[str, set[str]]] = {
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'id')", {"ModuleNotFoundError"}),
    "_ctypes": ("import _ctypes", {"ModuleNotFoundError"}),
    "posix": ("import posix\nposix.system('id')", {"ModuleNotFoundError"}),
    "importlib": ("import importlib\nimportlib.import_module('socket')", {"ModuleNotFoundError"}),
    "builtins": ("import builtins\nbuiltins.__import__('os').system('id')", {"ModuleNotFoundError"}),
    "__import__": ("__import__('os').system('id')", {"NameError", "AttributeError"}),
    "__builtins__": ("__builtins__.__import__('os')", {"NameError"}),
    "getattr-on-os": ("import os\ngetattr(os, 'system')('id')", {"AttributeError"}),
    "getattr-on-sys-modules": ("import sys\ngetattr(sys, 'modules')['os']", {"AttributeError"}),
    "sys-getframe": ("import sys\nsys._getframe().f_globals", {"AttributeError"}),
    "subclasses-of-object": ("print(().__class__.__bases__[0].__subclasses__())", {"AttributeError"}),
    "type-subclasses": ("print(type(1).__subclasses__())", {"AttributeError"}),
    "function-globals": ("def f():\n    pass\nprint(f.__globals__)", {"AttributeError"}),
    "function-code": ("print((lambda: 0).__code__)", {"AttributeError"}),
    "module-dict": ("import json\nprint(json.__dict__)", {"AttributeError"}),
    "tools-internals": ("import tools\nprint(tools.__dict__)", {"AttributeError"}),
    "globals": ("print(globals())", {"NameError", "AttributeError"}),
    "compile": ("compile('1', 'f', 'eval')", {"NameError", "AttributeError"}),
    "eval-of-an-import": ("eval(\"__import__('os')\").system('id')", {"NameError", "AttributeError"}),
    "exec-of-a-file-read": ("exec(\"print(open('/etc/passwd').read())\")", {"PermissionError"}),
    "exec-of-an-import": ("exec('import socket')", {"ModuleNotFoundError"}),
}


def assert_fails_cleanly(view: dict[str, Any], types: set[str]) -> None:
    assert verdict(view) == ("failed", "nonzero_exit"), view
    found = report(view)
    assert found.get("type") in types and found.get("message"), found
    assert found["type"] in view["stderr"], view["stderr"]
    for secret in ("root:x:0:0", "uid=", "Uid:"):
        assert secret not in view["stdout"] + view["stderr"]


@pytest.mark.parametrize("attempt", list(FILE_ATTEMPTS), ids=list(FILE_ATTEMPTS))
def test_a_file_attempt_fails_cleanly(api: httpx.Client, attempt: str) -> None:
    script, types = FILE_ATTEMPTS[attempt]
    assert_fails_cleanly(monty(api, script), types)
    assert not os.path.lexists(HOST_MARK), "a Monty script wrote on the host"


@pytest.mark.parametrize("attempt", list(SOCKET_ATTEMPTS), ids=list(SOCKET_ATTEMPTS))
def test_a_network_attempt_fails_cleanly_and_reaches_nothing(api: httpx.Client, attempt: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        script, types = SOCKET_ATTEMPTS[attempt]
        assert_fails_cleanly(monty(api, script.replace("PORT", str(port))), types)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@pytest.mark.parametrize("attempt", list(PROCESS_ATTEMPTS), ids=list(PROCESS_ATTEMPTS))
def test_a_process_attempt_fails_cleanly(api: httpx.Client, hostile_service: Service, attempt: str) -> None:
    script, types = PROCESS_ATTEMPTS[attempt]
    assert_fails_cleanly(monty(api, script), types)
    assert not os.path.lexists(HOST_MARK), "a Monty script ran a command on the host"
    assert hostile_service.process.poll() is None


@pytest.mark.parametrize("attempt", list(ESCAPE_ATTEMPTS), ids=list(ESCAPE_ATTEMPTS))
def test_a_native_module_or_introspection_escape_fails_cleanly(api: httpx.Client, attempt: str) -> None:
    script, types = ESCAPE_ATTEMPTS[attempt]
    assert_fails_cleanly(monty(api, script), types)


def test_eval_and_exec_run_only_inside_the_interpreter(api: httpx.Client) -> None:
    """Monty's ``eval``/``exec`` evaluate in the sandbox itself (no escape: the attempts above fail through them)."""
    view = monty(api, "print(eval('6 * 7'))\nexec('y = 1')\nprint(y)")
    assert (view["status"], view["stdout"]) == ("succeeded", "42\n1\n"), view


# -- interpreter crash attempts ----------------------------------------------------------------------------------

CRASH_ATTEMPTS: dict[str, str] = {
    "nested-brackets": "x = " + "[" * 100_000 + "]" * 100_000 + "\nprint('ok')\n",
    "nested-parens": "x = " + "(" * 100_000 + "1" + ")" * 100_000 + "\nprint('ok')\n",
    "unary-chain": "x = " + "-" * 100_000 + "1\nprint(x)\n",
    "nested-lambdas": "x = " + "lambda: " * 20_000 + "1\nprint('ok')\n",
    "nested-blocks": "".join(" " * i + "if True:\n" for i in range(1000)) + " " * 1000 + "print('deep')\n",
    "call-chain": "x = str" + "()" * 300_000 + "\nprint(x)\n",
    "subscript-chain": "x = [[0]]\ny = x" + "[0]" * 300_000 + "\nprint(y)\n",
    "eval-of-nested-parens": "print(eval('(' * 100000 + '1' + ')' * 100000))\n",
    "huge-string-literal": "x = '" + "a" * 900_000 + "'\nprint(len(x))\n",
    "huge-int-literal": "x = " + "9" * 100_000 + "\nprint(x > 0)\n",
    "pathological-regex": "import re\nprint(re.match('(a+)+$', 'a' * 40 + 'b'))\n",
    "setrecursionlimit": "import sys\nsys.setrecursionlimit(10 ** 9)\ndef f(n):\n    return f(n + 1)\nf(0)\n",
    "json-loads-deep-lists": "import json\nx = json.loads('[' * 1000000 + ']' * 1000000)\nprint('ok')\n",
    "json-loads-deep-objects": "import json\nx = json.loads('{\"a\":' * 200000 + '1' + '}' * 200000)\nprint('ok')\n",
    "deep-data-dumps": "import json\nx = []\nfor i in range(300000):\n    x = [x]\nprint(len(json.dumps(x)))\n",
    "deep-data-repr": "x = {}\nfor i in range(300000):\n    x = {'k': x}\nprint(len(str(x)))\n",
    "deep-data-compare": "a = []\nb = []\nfor i in range(300000):\n    a = [a]\n    b = [b]\nprint(a == b)\n",
    "deep-data-hash": "a = ()\nfor i in range(300000):\n    a = (a,)\nprint(hash(a))\n",
    "deep-data-deepcopy": "import copy\na = []\nfor i in range(300000):\n    a = [a]\nb = copy.deepcopy(a)\n",
    "deep-data-freed": "a = []\nfor i in range(1000000):\n    a = [a]\na = None\nprint('freed')\n",
    "cyclic-repr": "a = []\na.append(a)\nd = {}\nd['d'] = d\nprint(a, d)\n",
}


@pytest.mark.parametrize("attempt", list(CRASH_ATTEMPTS), ids=list(CRASH_ATTEMPTS))
def test_an_interpreter_crash_attempt_ends_the_job_and_the_service_survives(
    api: httpx.Client, hostile_service: Service, attempt: str
) -> None:
    started = time.monotonic()
    view = monty(api, CRASH_ATTEMPTS[attempt], timeout_s=8, limits={"memory_mb": 512})
    assert time.monotonic() - started < 15
    assert view["status"] in ENDED, view
    if view["status"] == "failed":
        assert view["error"] and view["error"]["type"], view
    assert hostile_service.process.poll() is None, "the service died"
    assert_next_script_runs(api)


def test_a_worker_killed_mid_job_ends_it_and_keeps_its_output(api: httpx.Client, hostile_service: Service) -> None:
    """A worker that dies (here: SIGKILL from the host, as a segfault would) ends its job with a clear error; what
    the script printed stays; the key's next script runs in a new worker."""
    job_id = start(api, "print('before')\n" + LOOP, timeout_s=15)
    busy = poll(lambda: busy_workers(hostile_service), bool, 5)
    assert len(busy) == 1, busy
    os.kill(busy.pop(), signal.SIGKILL)
    view = ended(api, job_id, 10)
    assert view["status"] == "failed" and view["error"]["type"] == "sandbox_error", view
    assert "worker" in view["error"]["message"] and view["stdout"] == "before\n", view
    assert_next_script_runs(api)


# -- confinement, seen from the host -----------------------------------------------------------------------------


def test_a_running_workers_confinement_seen_from_the_host(api: httpx.Client, hostile_service: Service) -> None:
    job_id = start(api, LOOP, timeout_s=15)
    try:
        busy = poll(lambda: busy_workers(hostile_service), bool, 5)
        assert len(busy) == 1, f"no worker of the service runs the job: {service_workers(hostile_service)}"
        pid = busy.pop()
        status = proc_fields(pid, "status")
        assert status["Uid"].split() == ["65534"] * 4 and status["Gid"].split() == ["65534"] * 4, status
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2", status
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0, status
        address_space = proc_limit(pid, "Max address space")
        assert address_space[0] != "unlimited" and int(address_space[0]) <= 8192 * 1024 * 1024, address_space
        assert proc_limit(pid, "Max open files") == ("64", "64")
        assert proc_limit(pid, "Max core file size") == ("0", "0")
        for ns in ("net", "pid", "user", "ipc", "uts", "mnt"):
            worker_ns = os.readlink(f"/proc/{pid}/ns/{ns}")
            assert worker_ns != os.readlink(f"/proc/{hostile_service.process.pid}/ns/{ns}"), ns
            assert worker_ns != os.readlink(f"/proc/self/ns/{ns}"), ns
        try:
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/1/ns/net")
        except PermissionError:
            pass  # pid 1 of this machine is not readable here: the service's and this process's namespaces were
        assert Path(f"/proc/{pid}/environ").read_bytes() in (b"", b"PWD=/\0"), "the worker's environment is not empty"
        assert set(os.listdir(f"/proc/{pid}/root")) <= {"monty", "lib", "lib64", "usr"}
    finally:
        stopped = api.post(f"/jobs/{job_id}/stop").json()
    assert stopped["status"] == "stopped", stopped
    still_busy = poll(lambda: busy_workers(hostile_service), lambda b: not b, 5)
    assert not still_busy, f"the stopped job's worker still runs: {still_busy}"
    assert_next_script_runs(api)


# -- keys --------------------------------------------------------------------------------------------------------


def test_two_keys_never_share_a_worker(tenants_service: Service) -> None:
    """One worker per key (``PTC_MONTY_WORKERS_PER_KEY=1``): while alice's job holds hers, bob's job runs at once, in
    another process."""
    with tenant(tenants_service, "alice") as alice, tenant(tenants_service, "bob") as bob:
        alice_job = start(alice, LOOP, timeout_s=12)
        bob_job = ""
        try:
            alice_workers = poll(lambda: busy_workers(tenants_service), bool, 5)
            assert len(alice_workers) == 1, alice_workers
            bob_job = start(bob, LOOP, timeout_s=12)
            both = poll(lambda: busy_workers(tenants_service), lambda b: len(b) == 2, 5)
            assert len(both) == 2 and alice_workers < both, (alice_workers, both)
            assert alice.get(f"/jobs/{alice_job}").json()["status"] == "running"
            assert bob.get(f"/jobs/{bob_job}").json()["status"] == "running"
        finally:
            alice.post(f"/jobs/{alice_job}/stop")
            if bob_job:
                bob.post(f"/jobs/{bob_job}/stop")
        assert ended(alice, alice_job)["status"] == "stopped"
        assert ended(bob, bob_job)["status"] == "stopped"


def test_a_scripts_globals_never_reach_another_script(tenants_service: Service) -> None:
    secret = "alice-" + secrets.token_hex(8)
    with tenant(tenants_service, "alice") as alice, tenant(tenants_service, "bob") as bob:
        first = monty(alice, f"leaked = '{secret}'\ndef leaky():\n    return leaked\nprint('set')")
        assert first["status"] == "succeeded", first
        for client, who in ((bob, "bob"), (alice, "alice's next script")):
            view = monty(client, "print(leaked)")
            assert verdict(view) == ("failed", "nonzero_exit") and report(view)["type"] == "NameError", (who, view)
            assert secret not in view["stdout"] + view["stderr"], who
            view = monty(client, "print(leaky())")
            assert view["status"] == "failed" and secret not in view["stdout"] + view["stderr"], (who, view)


# -- tool-call floods --------------------------------------------------------------------------------------------


def test_a_flood_of_2000_sync_tool_calls_is_recorded_whole(api: httpx.Client) -> None:
    view = monty(api, "import tools\nfor i in range(2000):\n    tools.echo(x=i)\nprint('done')", timeout_s=20)
    assert (view["status"], view["stdout"]) == ("succeeded", "done\n"), view["error"]
    assert view["calls_total"] == 2000 and view["calls_by_status"] == {"ok": 2000}
    assert [c["args"] for c in view["calls"]] == [{"x": i} for i in range(2000)]
    assert [c["seq"] for c in view["calls"]] == list(range(1, 2001))


def test_asyncio_gather_over_1000_tool_calls_is_recorded_whole(api: httpx.Client) -> None:
    script = """
import asyncio
import tools
async def main():
    return await asyncio.gather(*[tools.aio.echo(x=i) for i in range(1000)])
results = asyncio.run(main())
print(len(results), results[0]['args']['x'], results[999]['args']['x'])
"""
    view = monty(api, script, timeout_s=20)
    assert (view["status"], view["stdout"]) == ("succeeded", "1000 0 999\n"), view["error"]
    assert view["calls_total"] == 1000 and view["calls_by_status"] == {"ok": 1000}
    assert sorted(c["args"]["x"] for c in view["calls"]) == list(range(1000))
