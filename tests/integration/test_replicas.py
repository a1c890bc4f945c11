"""Two replicas on one PostgreSQL store behind HAProxy (docs/scaling.md, Tests; issue 17, point 2): jobs through
the balancer land on both, every ended job is served alike by either replica and by the balancer, and ``wait`` on
the replica that does not own a job returns when the job ends (``LISTEN/NOTIFY``)."""

from __future__ import annotations

import secrets
from typing import Any

import psycopg

from tests import pgstore
from tests.integration import replicas
from tests.integration.replicas import Cluster
from tests.toolserver import ToolServer

cluster = replicas.cluster

ROUND_ROBIN_JOBS = 40
"""Jobs of the round-robin test (the issue's closing figures use 200: ``deploy/local.sh bench --replicas``)."""
ENDED = ("succeeded", "failed", "timeout", "stopped", "lost")


def lookup(tool_server: ToolServer) -> list[dict[str, Any]]:
    return [
        {
            "name": "lookup",
            "parameters": {"properties": {"text": {"type": "string"}}},
            "endpoint": {"kind": "http", "url": tool_server.url("echo")},
        }
    ]


def owners(cluster: Cluster) -> dict[str, str]:
    """Each stored job's owning instance (``t1``/``t2``), read from the store."""
    with psycopg.connect(pgstore._libpq(cluster.store_url)) as conn:
        rows = conn.execute("SELECT job_id, instance_id FROM jobs").fetchall()
    return {str(job_id): str(instance) for job_id, instance in rows}


def test_replicas_round_robin(cluster: Cluster, tool_server: ToolServer) -> None:
    tools = lookup(tool_server)
    with cluster.balancer() as lb, cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2:
        clients = {"t1": c1, "t2": c2}
        # A job that outlives the requests below: wait on the replica that does not own it returns at its end.
        slow = lb.post(
            "/execute",
            json={"script": "import time\nprint('slow', flush=True)\ntime.sleep(3)\nprint('end')\n", "wait_s": 0},
        )
        assert slow.status_code == 202, slow.text
        slow_id = slow.json()["job_id"]
        slow_owner = owners(cluster)[slow_id]  # saved before it was answered
        other = clients["t2" if slow_owner == "t1" else "t1"]
        running = other.get(f"/jobs/{slow_id}")
        assert running.status_code == 503, running.text  # running elsewhere: no forwarding yet (step 3)
        assert running.json()["type"].endswith("/owner-unavailable")
        waited = other.post(f"/jobs/{slow_id}/wait", params={"timeout_s": 60})
        assert waited.status_code == 200, waited.text
        assert (waited.json()["status"], waited.json()["stdout"]) == ("succeeded", "slow\nend\n")

        job_ids: list[str] = []
        for i in range(ROUND_ROBIN_JOBS):
            script = f"import tools\nprint('job {i}')\nprint(tools.lookup(text='arg-{i}'))\n"
            answer = lb.post("/execute", json={"script": script, "tools": tools, "wait_s": 0, "timeout_s": 120})
            assert answer.status_code in (200, 202), answer.text
            job_ids.append(answer.json()["job_id"])
        owned = owners(cluster)
        ran = {name: sum(owned[j] == name for j in job_ids) for name in ("t1", "t2")}
        assert ran["t1"] > 0 and ran["t2"] > 0, ran  # round-robin: both replicas ran some

        for job_id in job_ids:  # each through the replica that does not own it
            not_owner = clients["t2" if owned[job_id] == "t1" else "t1"]
            ended = not_owner.post(f"/jobs/{job_id}/wait", params={"timeout_s": 120})
            assert ended.status_code == 200, ended.text
            assert ended.json()["status"] in ENDED

        for i, job_id in enumerate(job_ids):
            views = [c.get(f"/jobs/{job_id}") for c in (c1, c2, lb)]
            for view in views:
                assert view.status_code == 200, view.text
            assert views[0].content == views[1].content == views[2].content, job_id  # byte for byte
            body = views[0].json()
            assert (body["status"], body["stdout"]) == ("succeeded", f"job {i}\n{{'args': {{'text': 'arg-{i}'}}}}\n")
            [call] = body["calls"]
            assert (call["tool"], call["args"], call["status"]) == ("lookup", {"text": f"arg-{i}"}, "ok")
            outputs = [c.get(f"/jobs/{job_id}/output/stdout") for c in (c1, c2, lb)]
            assert all(o.status_code == 200 for o in outputs)
            assert outputs[0].content == outputs[1].content == outputs[2].content == body["stdout"].encode()


def test_replicas_one_job_per_idempotency_key(cluster: Cluster) -> None:
    """One Idempotency-Key sent at once through the balancer (a client retrying): one job, whichever replica each
    request reached (docs/scaling.md, Idempotency keys: claims in the store)."""
    from concurrent.futures import ThreadPoolExecutor

    key = {"Idempotency-Key": f"retry-{secrets.token_hex(8)}"}
    body = {"script": "import time\nprint('once', flush=True)\ntime.sleep(1)\n", "wait_s": 60}
    before = set(owners(cluster))
    with cluster.balancer() as lb, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: lb.post("/execute", json=body, headers=key), range(8)))
        made = set(owners(cluster)) - before
        assert len(made) == 1, made  # one job in the store
        [job_id] = made
        first = [a for a in answers if "idempotent-replayed" not in a.headers]
        assert len(first) == 1 and first[0].json()["job_id"] == job_id, [a.text for a in answers]
        for answer in answers:  # a replay on the replica not running it: 503 while it runs (no forwarding yet)
            assert answer.status_code in (200, 503), answer.text
            if answer.status_code == 200:
                assert (answer.json()["job_id"], answer.json()["stdout"]) == (job_id, "once\n")
        for _ in range(2):  # ended: both replicas replay it
            again = lb.post("/execute", json=body, headers=key)
            assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true", again.text
            assert again.json()["job_id"] == job_id
    assert set(owners(cluster)) - before == {job_id}
