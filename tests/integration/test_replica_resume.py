"""Durable jobs across replicas (docs/durability.md): when a replica dies, a survivor takes over its durable jobs
instead of marking them lost: a running one is resumed there by replay (its tool calls answered from the log, not
made again), and one parked waiting for the harness is held parked there, answered through the survivor. The real
cluster (tests/integration/replicas.py): two replicas on PostgreSQL behind HAProxy."""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any

import docker

from tests.conftest import labelled_containers, wait_until
from tests.integration import replicas
from tests.integration.replicas import Cluster
from tests.integration.test_replicas import KILL_BOUND_S
from tests.toolserver import ToolServer

cluster = replicas.cluster
CLUSTER_ENV = {
    "PTC_PARK_AFTER_S": "1",
    "PTC_MAX_CONCURRENT_SANDBOXES": "12",  # the rolling restart's 100 jobs: a dozen at once per replica
    "PTC_QUOTA_RUNNING_JOBS": "12",
    "PTC_QUOTA_QUEUED_JOBS": "150",
    "PTC_MAX_QUEUE": "150",
}

ASK = {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}}


def idempotency_key(headers: dict[str, str]) -> str | None:
    return next((value for name, value in headers.items() if name.lower() == "idempotency-key"), None)


def test_a_dead_replicas_durable_jobs_are_resumed_or_held_parked_by_the_survivor(
    cluster: Cluster, engine: docker.DockerClient, tool_server: ToolServer
) -> None:
    marker = secrets.token_hex(4)
    remember = {
        "name": "remember",
        "parameters": {"properties": {"i": {"type": "integer"}, "marker": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
    }
    running = (
        "import time, tools\n"
        "for i in range(3):\n"
        f"    print('got', tools.remember(i=i, marker={marker!r})['args']['i'], flush=True)\n"
        "    time.sleep(1)\n"
        "time.sleep(4)\n"
        "print('done')\n"
    )
    small = {"cpus": 0.25, "memory_mb": 64}
    with cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2:
        body: dict[str, Any] = {"script": running, "tools": [remember], "wait_s": 0, "limits": small}
        resumed_id = c2.post("/execute", json=body).json()["job_id"]
        asking = "import tools\nprint('asking', flush=True)\nprint('answer:', tools.ask(q='ship?'))\n"
        parked_id = c2.post("/execute", json={"script": asking, "tools": [ASK], "wait_s": 0}).json()["job_id"]
        wait_until(lambda: c2.get(f"/jobs/{parked_id}").json()["parked_at"] is not None, 60)
        [pending] = c2.get(f"/jobs/{parked_id}").json()["pending_calls"]
        wait_until(lambda: "got 1" in c2.get(f"/jobs/{resumed_id}").json()["stdout"], 60)  # after the second call
        killed = time.monotonic()
        cluster.t2.kill()

        def on_t1(job_id: str) -> bool:
            answer = c1.get(f"/jobs/{job_id}")
            return answer.status_code == 200 and bool(answer.json()["resumes"] or answer.json()["ended_at"])

        wait_until(lambda: on_t1(resumed_id), KILL_BOUND_S + 30)
        print(f"kill -9 t2 -> its durable job running again on t1 after {time.monotonic() - killed:.2f} s")
        view = c1.post(f"/jobs/{resumed_id}/wait", params={"timeout_s": 60}).json()
        assert view["status"] == "succeeded", view
        assert view["stdout"] == "got 0\ngot 1\ngot 2\ndone\n", view
        assert [(r["reason"], r["instance"]) for r in view["resumes"]] == [("replica_lost", cluster.t1.instance_id)]
        keys: dict[int, list[str | None]] = {}
        for (path, args), headers in zip(tool_server.requests, tool_server.headers, strict=True):
            if path == "/echo" and isinstance(args, dict) and args.get("marker") == marker:
                keys.setdefault(args["i"], []).append(idempotency_key(headers))
        assert sorted(keys) == [0, 1, 2], keys
        assert all(len(set(seen)) == 1 for seen in keys.values()), keys  # a repeat, if any, under the same id
        assert sum(map(len, keys.values())) <= 4, keys  # at most the call in flight at the kill made twice

        def adopted() -> bool:  # t1 answers for it (not 503: its owner is dead)
            answer = c1.get(f"/jobs/{parked_id}")
            return answer.status_code == 200

        wait_until(adopted, KILL_BOUND_S + 30)
        assert c1.get(f"/jobs/{parked_id}").json()["parked_at"] is not None
        answered = c1.post(f"/jobs/{parked_id}/calls/{pending['call_id']}", json={"result": "yes"})
        assert answered.status_code == 200, answered.text
        wait_until(lambda: c1.get(f"/jobs/{parked_id}").json()["ended_at"] is not None, 60)
        final = c1.get(f"/jobs/{parked_id}").json()
        assert final["status"] == "succeeded" and final["stdout"] == "asking\nanswer: yes\n", final
        assert [r["reason"] for r in final["resumes"]] == ["answered"]
    cluster.restart("t2")
    assert not labelled_containers(engine, cluster.t2.instance_id)  # what t2 left, removed at its start


def test_a_rolling_restart_of_both_replicas_loses_no_job(cluster: Cluster, tool_server: ToolServer) -> None:
    """SIGTERM t2 (it drains, then parks what still runs; t1 takes those over), start it again, then the same for
    t1: every job ends ``succeeded`` with its whole output, every tool call made (a repeat only under its id)."""
    for name in ("t1", "t2"):
        if cluster.members[name].process.poll() is not None:
            cluster.restart(name)
    marker = secrets.token_hex(4)
    remember = {
        "name": "remember",
        "parameters": {"properties": {"job": {"type": "integer"}, "i": {"type": "integer"}, "m": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
    }
    script = (
        "import time, tools\n"
        "for i in range(3):\n"
        f"    tools.remember(job={{n}}, i=i, m={marker!r})\n"
        "    print('step', i, flush=True)\n"
        "    time.sleep(1)\n"
        "print('done')\n"
    )
    jobs = 100
    with cluster.balancer() as api:
        ids = []
        for n in range(jobs):
            body = {"script": script.replace("{n}", str(n)), "tools": [remember], "wait_s": 0}
            body["limits"] = {"cpus": 0.25, "memory_mb": 64}
            answer = api.post("/execute", json=body)
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["job_id"])
        time.sleep(3)
        for name in ("t2", "t1"):  # a rolling deploy: one replica at a time, the other serving
            cluster.members[name].stop()
            cluster.restart(name)
        views: dict[str, dict[str, Any]] = {}

        def ended(job_id: str) -> bool:
            views[job_id] = api.get(f"/jobs/{job_id}").json()
            return views[job_id]["ended_at"] is not None

        for job_id in ids:
            wait_until(functools.partial(ended, job_id), 300)
    expected = "".join(f"step {i}\n" for i in range(3)) + "done\n"
    assert [(v["status"], v["stdout"]) for v in views.values()] == [("succeeded", expected)] * jobs, views
    resumed = [r["reason"] for v in views.values() for r in v["resumes"]]
    assert resumed and set(resumed) <= {"replica_lost", "drained"}, resumed
    seen: dict[tuple[int, int], set[str | None]] = {}
    for (path, args), headers in zip(tool_server.requests, tool_server.headers, strict=True):
        if path == "/echo" and isinstance(args, dict) and args.get("m") == marker:
            seen.setdefault((args["job"], args["i"]), set()).add(idempotency_key(headers))
    assert sorted(seen) == [(n, i) for n in range(jobs) for i in range(3)]
    assert all(len(keys) == 1 for keys in seen.values()), seen  # a call made twice went under one id
    print(f"rolling restart: {jobs} jobs, {len(resumed)} resumes ({sorted(set(resumed))}), none lost")


def parked_gauge(api: Any) -> float:
    """``ptc_parked_jobs`` of one replica."""
    [line] = [line for line in api.get("/metrics").text.splitlines() if line.startswith("ptc_parked_jobs ")]
    return float(line.split()[1])


def test_a_parked_job_of_a_replica_restarted_within_its_lease_is_held_by_one_replica(
    cluster: Cluster, tool_server: ToolServer
) -> None:
    """A replica killed and started again at once (within its lease) and the survivor, whose reaper sees the dead
    incarnation's jobs as orphans: one of them holds the parked job, and its expiry resumes it once (before the fix
    both held it, both resumed it, and the survivor was fenced)."""
    marker = secrets.token_hex(4)
    ask = {**ASK, "timeout_s": 15}
    remember = {
        "name": "remember",
        "parameters": {"properties": {"m": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
    }
    script = (
        "import tools\n"
        "try:\n    tools.ask(q='x')\nexcept Exception as exc:\n    print('ask:', type(exc).__name__, flush=True)\n"
        f"tools.remember(m={marker!r})\nprint('done')\n"
    )
    with cluster.client(cluster.t2.url) as c2:
        body: dict[str, Any] = {"script": script, "tools": [ask, remember], "wait_s": 0}
        job_id = c2.post("/execute", json=body).json()["job_id"]
        wait_until(lambda: c2.get(f"/jobs/{job_id}").json()["parked_at"] is not None, 60)
    cluster.t2.kill()
    cluster.restart("t2")  # at once: within its lease
    time.sleep(4)  # the survivor's reaper scans a few times
    with cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2:
        held = sorted((parked_gauge(c1), parked_gauge(c2)))
        assert held == [0.0, 1.0], held
        wait_until(lambda: c1.get(f"/jobs/{job_id}").json()["ended_at"] is not None, 60)
        view = c1.get(f"/jobs/{job_id}").json()
    assert view["status"] == "succeeded" and view["stdout"] == "ask: ToolError\ndone\n", view
    assert [r["reason"] for r in view["resumes"]] == ["expired"], view["resumes"]
    assert {name: member.process.poll() for name, member in cluster.members.items()} == {"t1": None, "t2": None}
    sent = [args for path, args in tool_server.requests if path == "/echo" and args.get("m") == marker]
    assert len(sent) == 1, sent
