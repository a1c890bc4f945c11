"""Durable jobs across replicas (docs/durability.md): when a replica dies, a survivor takes over its durable jobs
instead of marking them lost: a running one is resumed there by replay (its tool calls answered from the log, not
made again), and one parked waiting for the harness is held parked there, answered through the survivor. The real
cluster (tests/integration/replicas.py): two replicas on PostgreSQL behind HAProxy."""

from __future__ import annotations

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
CLUSTER_ENV = {"PTC_PARK_AFTER_S": "1"}

ASK = {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}}


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
        wait_until(lambda: "got 2" in c2.get(f"/jobs/{resumed_id}").json()["stdout"], 60)
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
        made = [
            a
            for path, a in tool_server.requests
            if path == "/echo" and isinstance(a, dict) and a.get("marker") == marker
        ]
        assert sorted(a["i"] for a in made) == [0, 1, 2]  # each call made once: the replay took them from the log

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
