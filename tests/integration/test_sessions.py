"""Sessions: one sandbox per conversation, a forked process per script, files kept, scripts one at a time."""

from __future__ import annotations

import itertools
import secrets
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import container_gone, execute, labelled_containers, pool_ready, start_service, wait_until

RUN = secrets.token_hex(4)  # instance ids of this run: a concurrent run on the same engine removes its own only

ECHO = [
    {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "endpoint": {"kind": "echo"},
    }
]


def open_session(api: httpx.Client, **body: Any) -> dict[str, Any]:
    response = api.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    view: dict[str, Any] = response.json()
    return view


@pytest.fixture
def session(api: httpx.Client) -> Iterator[dict[str, Any]]:
    view = open_session(api, tools=ECHO)
    yield view
    api.delete(f"/sessions/{view['session_id']}")


def test_files_persist_within_a_session_and_stay_private_to_it(api: httpx.Client, session: dict[str, Any]) -> None:
    sid = session["session_id"]
    first = execute(api, "open('/tmp/notes.txt', 'w').write('kept')\nprint('written')", session_id=sid)
    second = execute(api, "print(open('/tmp/notes.txt').read())", session_id=sid)
    assert (first["stdout"], second["stdout"]) == ("written\n", "kept\n")
    assert first["job_id"] != second["job_id"]
    assert first["session_id"] == second["session_id"] == sid
    assert first["sandbox_start"] == second["sandbox_start"] == "session"
    assert first["sandbox_id"] == second["sandbox_id"] == session["sandbox_id"]
    other = open_session(api)
    try:
        view = execute(api, "print(open('/tmp/notes.txt').read())", session_id=other["session_id"])
        assert view["status"] == "failed" and view["error"]["script_report"]["type"] == "FileNotFoundError"
        assert other["sandbox_id"] != session["sandbox_id"]
    finally:
        api.delete(f"/sessions/{other['session_id']}")


def test_each_script_gets_its_own_process_records_and_env(api: httpx.Client, session: dict[str, Any]) -> None:
    sid = session["session_id"]
    script = "import os, tools\nprint(os.getpid(), os.environ.get('WHO'))\nprint(tools.echo(x=1)['args'])"
    a = execute(api, script, session_id=sid, env={"WHO": "a"})
    b = execute(api, script, session_id=sid)
    pid_a, who_a = a["stdout"].split("\n")[0].split()
    pid_b, who_b = b["stdout"].split("\n")[0].split()
    assert pid_a != pid_b and (who_a, who_b) == ("a", "None")
    assert [c["args"] for c in a["calls"]] == [c["args"] for c in b["calls"]] == [{"x": 1}]
    assert a["calls"][0]["call_id"] != b["calls"][0]["call_id"]
    leftover = execute(api, "import subprocess\nsubprocess.Popen(['sleep', '300'])\nprint('started')", session_id=sid)
    listed = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()))"
    after = execute(api, listed, session_id=sid)
    assert leftover["stdout"] == "started\n"
    assert after["stdout"] == "[1]\n"  # only init besides this script: nothing of a script outlives it


def test_scripts_of_a_session_run_one_at_a_time_in_order(api: httpx.Client, session: dict[str, Any]) -> None:
    sid = session["session_id"]
    jobs = []
    for i in range(4):
        script = f"import time\nopen('/tmp/order', 'a').write('{i}')\ntime.sleep(0.2)\nprint(open('/tmp/order').read())"
        response = api.post("/execute", json={"script": script, "session_id": sid, "wait_s": 0})
        assert response.status_code == 202, response.text
        jobs.append(response.json()["job_id"])
    views = [api.post(f"/jobs/{job}/wait", params={"timeout_s": 30}).json() for job in jobs]
    assert [v["stdout"] for v in views] == ["0\n", "01\n", "012\n", "0123\n"]
    for earlier, later in itertools.pairwise(views):
        assert earlier["ended_at"] <= later["started_at"]
    assert api.get(f"/sessions/{sid}").json()["executions"] == 4


HOSTILE: list[tuple[str, str, dict[str, Any]]] = [
    ("tool call", "import tools\nprint(tools.echo(x=2)['args'])", {}),
    (
        "rejected call",
        "import tools\ntry:\n    tools.echo(x='no')\nexcept tools.ToolError as e:\n    print(e.type)",
        {},
    ),
    ("exception", "print('before')\nraise KeyError('k')", {}),
    ("syntax error", "print('x'\n", {}),
    ("exit code", "import sys\nprint('bye')\nsys.exit(3)", {}),
    ("exit message", "import sys\nsys.exit('fatal')", {}),
    ("stderr and partial line", "import sys\nsys.stderr.write('e\\n')\nprint('no newline', end='')", {}),
    ("invalid utf-8", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfeok')", {}),
    (
        "atexit and threads",
        "import atexit, threading, time\natexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()",
        {},
    ),
    ("timeout", "import time\nprint('start', flush=True)\ntime.sleep(30)", {"timeout_s": 1}),
    ("memory hog", "x = bytearray(b'1') * (600 * 1024 * 1024)\nprint('survived')", {}),
    (
        "fork bomb",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        {"timeout_s": 3},
    ),
    ("after the hostile ones", "import tools\nprint(tools.echo(x=3)['args'])", {}),
]


def comparable(view: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: c[k] for k in ("seq", "tool", "args", "status", "result", "error")} for c in view["calls"]]
    keep = ("status", "exit_code", "stdout", "stderr", "error", "stdout_invalid_utf8", "calls_total")
    return {**{k: view[k] for k in keep}, "calls": calls}


def test_same_input_gives_the_same_view_in_a_session_warm_and_cold(engine: docker.DockerClient, scratch: Path) -> None:
    instance = f"pytest-same-view-{RUN}"
    # One pool (the default profile's): a job with other limits is always cold.
    svc = start_service(instance, scratch / "same-view", PTC_WARM_POOL_SIZE="2", PTC_WARM_POOL_MAX_PROFILES="1")

    try:
        with svc.client() as api:
            sid = open_session(api, tools=ECHO)["session_id"]
            for name, script, extra in HOSTILE:
                in_session = execute(api, script, session_id=sid, **extra)
                wait_until(lambda: pool_ready(api) >= 1, 30)
                warm = execute(api, script, ECHO, **extra)
                cold = execute(api, script, ECHO, limits={"cpus": 0.99}, **extra)
                starts = (in_session["sandbox_start"], warm["sandbox_start"], cold["sandbox_start"])
                assert starts == ("session", "warm", "cold"), name
                if name == "fork bomb":  # how far the bomb got before the limit differs; the outcome does not
                    assert in_session["status"] == warm["status"] == cold["status"] == "timed_out", name
                    continue
                expected = comparable(cold)
                assert comparable(in_session) == expected, name
                assert comparable(warm) == expected, name
                state = api.get(f"/sessions/{sid}").json()
                assert state["status"] == "ready", (name, state)  # the session survived and is usable
    finally:
        svc.stop()
    assert labelled_containers(engine, instance, include_pool=True) == []


def test_memory_hog_in_a_session_is_oom_killed_and_the_session_goes_on(api: httpx.Client) -> None:
    sid = open_session(api, limits={"memory_mb": 128})["session_id"]
    try:
        hog = execute(api, "x = bytearray(b'1') * (300 * 1024 * 1024)\nprint('survived')", session_id=sid)
        assert hog["status"] == "oom_killed" and "survived" not in hog["stdout"], hog
        assert "128 MiB" in hog["error"]["message"]  # the session's limit
        after = execute(api, "print('still here')", session_id=sid)
        assert after["stdout"] == "still here\n"
    finally:
        api.delete(f"/sessions/{sid}")


def test_scripts_cannot_take_over_the_resident_interpreter(api: httpx.Client, session: dict[str, Any]) -> None:
    script = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())  # PTRACE_ATTACH\n"
        "for name in ('mem', 'fd/1'):\n"
        "    try:\n"
        "        open(f'/proc/{os.getppid()}/{name}', 'rb').close()\n"
        "        print('opened', name)\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
    )
    for view in (execute(api, script, session_id=session["session_id"]), execute(api, script)):
        assert view["stdout"] == "-1 1\nPermissionError\nPermissionError\n", view  # EPERM: not dumpable
    signals = (
        "import os, signal\nfor s in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
        "    try:\n        os.kill(1, s)\n    except PermissionError:\n        print('EPERM')\n"
    )
    for view in (execute(api, signals + "print('alive')", session_id=session["session_id"]), execute(api, signals)):
        assert view["status"] == "succeeded", view  # the interpreter is root, the script 10001: not its to signal
        assert view["stdout"].startswith("EPERM\nEPERM\nEPERM\n"), view
    assert execute(api, "print('next')", session_id=session["session_id"])["stdout"] == "next\n"
    assert api.get(f"/sessions/{session['session_id']}").json()["status"] == "ready"


def test_pathological_scripts_fail_alone_and_the_session_goes_on(api: httpx.Client, session: dict[str, Any]) -> None:
    sid = session["session_id"]
    deep = "s = ''" + "".join(f" + 'w{i}'" for i in range(5000)) + "\nprint(len(s))"
    view = execute(api, deep, session_id=sid)
    assert view["status"] == "failed" and view["error"]["type"] == "RecursionError", view
    huge = "x = [" + ",".join(str(i) for i in range(30000)) + "]\nprint(len(x))"  # compiled by the child
    assert execute(api, huge, session_id=sid)["stdout"] == "30000\n"
    assert execute(api, "print('fine')", session_id=sid)["stdout"] == "fine\n"
    assert api.get(f"/sessions/{sid}").json()["status"] == "ready"


def test_files_in_tmp_never_shadow_the_standard_library(api: httpx.Client, session: dict[str, Any]) -> None:
    sid = session["session_id"]
    execute(api, "open('/tmp/csv.py', 'w').write('raise SystemExit(9)')", session_id=sid)
    view = execute(api, "import csv\nprint(csv.QUOTE_ALL)", session_id=sid)
    assert (view["status"], view["stdout"]) == ("succeeded", "1\n")


def test_env_the_interpreter_reads_at_start_is_refused(api: httpx.Client, session: dict[str, Any]) -> None:
    for body in (
        {"script": "print(1)", "env": {"PYTHONMALLOC": "bogus"}},
        {"script": "print(1)", "env": {"LD_PRELOAD": "/x.so"}, "session_id": session["session_id"]},
    ):
        response = api.post("/execute", json=body)
        assert response.status_code == 422 and "reserved" in response.json()["detail"], response.text
    assert api.post("/sessions", json={"env": {"PYTHONHASHSEED": "0"}}).status_code == 422
    for env in (b'{"A\\n": "x"}', b'{"A": "\\ud800"}'):  # a name with a newline; a lone surrogate
        raw = b'{"script": "print(1)", "env": ' + env + b"}"
        assert api.post("/execute", content=raw, headers={"content-type": "application/json"}).status_code == 422
    view = execute(
        api, "import time\nprint(time.strftime('%Z'))", session_id=session["session_id"], env={"TZ": "JST-9"}
    )
    assert view["stdout"] == "JST\n"


def test_a_session_whose_sandbox_dies_while_idle_ends_broken(api: httpx.Client, engine: docker.DockerClient) -> None:
    view = open_session(api)
    engine.containers.get(view["sandbox_id"]).kill()
    wait_until(lambda: api.get(f"/sessions/{view['session_id']}").json()["status"] == "broken", 10)
    wait_until(lambda: container_gone(engine, view["sandbox_id"]), 10)


def test_a_session_whose_sandbox_dies_is_marked_broken_with_a_reason(
    api: httpx.Client, engine: docker.DockerClient
) -> None:
    view = open_session(api)
    sid = view["session_id"]
    job = api.post("/execute", json={"script": "import time\ntime.sleep(60)", "session_id": sid, "wait_s": 0}).json()
    wait_until(lambda: api.get(f"/jobs/{job['job_id']}").json()["status"] == "running", 10)
    engine.containers.get(view["sandbox_id"]).kill()
    ended = api.post(f"/jobs/{job['job_id']}/wait", params={"timeout_s": 30}).json()
    assert ended["status"] == "failed" and ended["exit_code"] == 137
    assert ended["error"]["type"] == "sandbox_error" and "stopped answering" in ended["error"]["message"]
    wait_until(lambda: api.get(f"/sessions/{sid}").json()["status"] == "broken", 10)
    state = api.get(f"/sessions/{sid}").json()
    assert "stopped answering" in state["error"]["message"]
    refused = api.post("/execute", json={"script": "print(1)", "session_id": sid})
    assert refused.status_code == 409 and refused.json()["session_status"] == "broken"
    wait_until(lambda: container_gone(engine, view["sandbox_id"]), 10)


def test_delete_stops_the_running_script_and_the_queued_ones(api: httpx.Client, engine: docker.DockerClient) -> None:
    view = open_session(api)
    sid = view["session_id"]
    running = api.post("/execute", json={"script": "import time\ntime.sleep(60)", "session_id": sid, "wait_s": 0})
    queued = api.post("/execute", json={"script": "print('never')", "session_id": sid, "wait_s": 0})
    wait_until(lambda: api.get(f"/jobs/{running.json()['job_id']}").json()["status"] == "running", 10)
    deleted = api.delete(f"/sessions/{sid}")
    assert deleted.status_code == 200 and deleted.json()["status"] == "closed"
    first = api.post(f"/jobs/{running.json()['job_id']}/wait", params={"timeout_s": 30}).json()
    second = api.post(f"/jobs/{queued.json()['job_id']}/wait", params={"timeout_s": 30}).json()
    assert first["status"] == "stopped" and "session ended" in first["error"]["message"]
    assert second["status"] == "stopped" and second["error"]["type"] == "session_closed"
    assert container_gone(engine, view["sandbox_id"])
    assert api.delete(f"/sessions/{sid}").json() == deleted.json()  # idempotent


def test_session_errors_are_problems(api: httpx.Client, session: dict[str, Any]) -> None:
    unknown = api.post("/execute", json={"script": "print(1)", "session_id": "ses_nope"})
    assert unknown.status_code == 404 and unknown.headers["content-type"] == "application/problem+json"
    assert api.get("/sessions/ses_nope").status_code == 404
    assert api.delete("/sessions/ses_nope").status_code == 404
    other_memory = api.post(
        "/execute", json={"script": "print(1)", "session_id": session["session_id"], "limits": {"memory_mb": 64}}
    )
    assert other_memory.status_code == 422 and "memory_mb" in other_memory.json()["detail"]
    too_long = api.post("/sessions", json={"max_lifetime_s": 10**9})
    assert too_long.status_code == 422
    bad_runtime = api.post("/sessions", json={"runtime": "nonesuch"})
    assert bad_runtime.status_code == 422 and "runtime" in bad_runtime.json()["detail"]
    bad_tools = api.post("/sessions", json={"tools": [{"name": "x y"}]})
    assert bad_tools.status_code == 422


def test_idle_session_expires_and_its_sandbox_is_removed(api: httpx.Client, engine: docker.DockerClient) -> None:
    view = open_session(api, idle_timeout_s=1.5)
    execute(api, "print(1)", session_id=view["session_id"])
    wait_until(lambda: api.get(f"/sessions/{view['session_id']}").json()["status"] == "expired", 10)
    state = api.get(f"/sessions/{view['session_id']}").json()
    assert state["error"]["type"] == "session_expired" and "idle" in state["error"]["message"]
    wait_until(lambda: container_gone(engine, view["sandbox_id"]), 10)
    lifetime = open_session(api, max_lifetime_s=2)
    job = api.post(
        "/execute", json={"script": "import time\ntime.sleep(30)", "session_id": lifetime["session_id"], "wait_s": 0}
    )
    ended = api.post(f"/jobs/{job.json()['job_id']}/wait", params={"timeout_s": 30}).json()
    assert ended["status"] == "stopped" and "max_lifetime_s" in ended["error"]["message"]
    wait_until(lambda: container_gone(engine, lifetime["sandbox_id"]), 10)


def test_max_sessions_is_enforced(engine: docker.DockerClient, scratch: Path) -> None:
    svc = start_service(  # the one key may open every session: the global limit is tested
        f"pytest-max-sessions-{RUN}",
        scratch / "max-sessions",
        PTC_MAX_SESSIONS="2",
        PTC_QUOTA_SESSIONS="4",
        PTC_WARM_POOL_SIZE="0",
    )
    try:
        with svc.client() as api, ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: api.post("/sessions", json={}), range(4)))
            assert sorted(a.status_code for a in answers) == [201, 201, 429, 429]
            assert {a.json()["reason"] for a in answers if a.status_code == 429} == {"max_sessions"}
            assert len(api.get("/sessions").json()["sessions"]) == 2
    finally:
        svc.stop()
    assert labelled_containers(engine, f"pytest-max-sessions-{RUN}", include_pool=True) == []


def test_killed_service_leaves_nothing_after_the_next_start(engine: docker.DockerClient, scratch: Path) -> None:
    first = start_service(f"pytest-session-crash-{RUN}", scratch / "session-crash", PTC_WARM_POOL_SIZE="2")
    with first.client() as api:
        sessions = [open_session(api) for _ in range(2)]
        execute(api, "open('/tmp/x', 'w').write('x')", session_id=sessions[0]["session_id"])
        wait_until(lambda: len(labelled_containers(engine, f"pytest-session-crash-{RUN}", include_pool=True)) == 4, 30)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_service(f"pytest-session-crash-{RUN}", scratch / "session-crash", PTC_WARM_POOL_SIZE="0")
    try:
        assert labelled_containers(engine, f"pytest-session-crash-{RUN}", include_pool=True) == []
        with second.client() as api:
            gone = api.post("/execute", json={"script": "print(1)", "session_id": sessions[0]["session_id"]})
            assert gone.status_code == 404
    finally:
        second.stop()


def test_a_session_that_fails_to_start_leaves_the_others_alone(engine: docker.DockerClient, scratch: Path) -> None:
    instance = f"pytest-failed-start-{RUN}"
    svc = start_service(instance, scratch / "failed-start", PTC_SESSION_RUNTIMES='["runc", "nonesuch"]')
    try:
        with svc.client() as api:
            alive = open_session(api)
            refused = api.post("/sessions", json={"runtime": "nonesuch"})  # the engine knows no such runtime
            assert refused.status_code == 503, refused.text
            assert execute(api, "print('still')", session_id=alive["session_id"])["stdout"] == "still\n"
            assert execute(api, "print('warm')")["sandbox_start"] in ("warm", "cold")
    finally:
        svc.stop()
    assert labelled_containers(engine, instance, include_pool=True) == []
