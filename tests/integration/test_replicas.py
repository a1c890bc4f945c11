"""Two replicas on one PostgreSQL store behind HAProxy (docs/scaling.md, Tests; issue 17, points 2 to 4): jobs
through the balancer land on both, every ended job is served alike by either replica and by the balancer, ``wait``
on the replica that does not own a job returns when the job ends (``LISTEN/NOTIFY``); requests about a running job
or an open session are relayed to the replica holding it (stop, events, client calls, approvals, a session's
scripts and files), and another key's ids stay 404 there without being relayed."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from typing import Any

import docker
import httpx
import orjson
import psycopg

from tests import pgstore
from tests.conftest import labelled_containers, wait_until
from tests.integration import replicas
from tests.integration.replicas import Cluster
from tests.receiver import Receiver
from tests.toolserver import ToolServer

cluster = replicas.cluster

ROUND_ROBIN_JOBS = 200
"""Jobs of the round-robin test (issue 17: 200 through the balancer)."""
ROUND_ROBIN_WAVE = 40
"""Submitted at once, then waited for: within the key's quota of jobs running or queued on each replica."""
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
    return {str(job_id): cluster.name_of(str(instance)) for job_id, instance in rows}


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
        assert running.status_code == 200, running.text  # running elsewhere: relayed to its owner (step 3)
        assert running.json()["status"] in ("queued", "running")
        waited = other.post(f"/jobs/{slow_id}/wait", params={"timeout_s": 60})
        assert waited.status_code == 200, waited.text
        assert (waited.json()["status"], waited.json()["stdout"]) == ("succeeded", "slow\nend\n")

        def submit(i: int) -> str:
            script = f"import tools\nprint('job {i}')\nprint(tools.lookup(text='arg-{i}'))\n"
            answer = lb.post("/execute", json={"script": script, "tools": tools, "wait_s": 0, "timeout_s": 120})
            assert answer.status_code in (200, 202), answer.text
            return str(answer.json()["job_id"])

        job_ids: list[str] = []
        for wave in range(0, ROUND_ROBIN_JOBS, ROUND_ROBIN_WAVE):  # under the key's quota of jobs running or queued
            job_ids += [submit(i) for i in range(wave, min(wave + ROUND_ROBIN_WAVE, ROUND_ROBIN_JOBS))]
            for job_id in job_ids[wave:]:
                assert lb.post(f"/jobs/{job_id}/wait", params={"timeout_s": 120}).status_code == 200
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
        for answer in answers:  # a replay on the replica not running it is relayed to the one running it
            assert answer.status_code == 200, answer.text
            assert (answer.json()["job_id"], answer.json()["stdout"]) == (job_id, "once\n")
        for _ in range(2):  # ended: both replicas replay it
            again = lb.post("/execute", json=body, headers=key)
            assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true", again.text
            assert again.json()["job_id"] == job_id
    assert set(owners(cluster)) - before == {job_id}


def forwarded(client: httpx.Client) -> float:
    """The replica's ``ptc_forwarded_requests_total``, all routes and outcomes."""
    return metric_sum(client, "ptc_forwarded_requests_total")


def metric_sum(client: httpx.Client, name: str, label: str = "") -> float:
    text = client.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def submitted(client: httpx.Client, body: dict[str, Any]) -> str:
    """Submit ``body`` (a script) without waiting; its job id."""
    answer = client.post("/execute", json={"wait_s": 0, "timeout_s": 120, **body})
    assert answer.status_code in (200, 202), answer.text
    return str(answer.json()["job_id"])


TICKING = "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"
"""A job that prints every 0.1 s for a minute (stopped before)."""


def test_replicas_stop_and_wait_elsewhere(cluster: Cluster) -> None:
    with cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2:
        short = submitted(c1, {"script": "import time\nprint('a', flush=True)\ntime.sleep(2)\nprint('b')\n"})
        waited = c2.post(f"/jobs/{short}/wait", params={"timeout_s": 60})  # t2 waits, t1 runs it
        assert waited.status_code == 200, waited.text
        assert (waited.json()["status"], waited.json()["stdout"]) == ("succeeded", "a\nb\n")

        long = submitted(c1, {"script": TICKING})
        events: list[tuple[str, dict[str, Any]]] = []
        with c2.stream("GET", f"/jobs/{long}/events") as stream:  # t1's stream, relayed by t2
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            name = ""
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    events.append((name, orjson.loads(line.removeprefix("data: "))))
                    if name == "stdout" and sum(n == "stdout" for n, _ in events) == 1:
                        stopped = c2.post(f"/jobs/{long}/stop")  # stopped from t2
                        assert stopped.status_code == 200, stopped.text
                        assert stopped.json()["status"] == "stopped"
                    if name == "end":
                        break
        assert events[-1][0] == "end" and events[-1][1]["status"] == "stopped"
        assert any(n == "stdout" and "tick 0" in data["text"] for n, data in events)
        assert forwarded(c2) >= 2


def test_replicas_client_call_and_approval_elsewhere(cluster: Cluster, tool_server: ToolServer) -> None:
    asking = {"name": "ask", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "client"}}
    gated = {**lookup(tool_server)[0], "approval": "always"}
    with cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2:
        client_job = submitted(c1, {"script": "import tools\nprint(tools.ask(q='x'))\n", "tools": [asking]})
        approval_job = submitted(c1, {"script": "import tools\nprint(tools.lookup(text='y'))\n", "tools": [gated]})
        for job_id, answer, suffix in ((client_job, {"result": 42}, ""), (approval_job, {"reason": "ok"}, "/approve")):
            waiting = c2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60})  # waits on t2; the view from t1
            assert waiting.status_code == 200, waiting.text
            assert waiting.json()["status"] == "waiting", waiting.text
            [call] = waiting.json()["pending_calls"]
            decided = c2.post(f"/jobs/{job_id}/calls/{call['call_id']}{suffix}", json=answer)
            assert decided.status_code == 200, decided.text
            ended = c2.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60})
            assert ended.json()["status"] == "succeeded", ended.text
        assert c2.get(f"/jobs/{client_job}").json()["stdout"] == "42\n"
        view = c2.get(f"/jobs/{approval_job}").json()
        assert view["stdout"] == "{'args': {'text': 'y'}}\n"
        assert view["calls"][0]["approval"]["decision"] == "approved"


def test_replicas_session_through_balancer(cluster: Cluster) -> None:
    with cluster.balancer() as lb, cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2:
        before = forwarded(c1) + forwarded(c2)
        created = lb.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session_id = created.json()["session_id"]
        assert session_id in [s["session_id"] for s in lb.get("/sessions").json()["sessions"]]
        for i in range(3):  # round robin: some land on the replica without the session, and are relayed
            ran = lb.post(
                "/execute",
                json={"session_id": session_id, "script": f"open('/tmp/n{i}', 'w').write('{i}')\nprint({i})"},
            )
            assert ran.status_code == 200, ran.text
            assert (ran.json()["status"], ran.json()["stdout"]) == ("succeeded", f"{i}\n")
        put = lb.put(f"/sessions/{session_id}/files/data.txt", content=b"payload")
        assert put.status_code == 200, put.text
        for name, content in (("data.txt", b"payload"), ("n2", b"2")):
            got = lb.get(f"/sessions/{session_id}/files/{name}")
            assert (got.status_code, got.content) == (200, content), got.text
        listed = lb.get(f"/sessions/{session_id}/files")
        assert listed.status_code == 200, listed.text
        assert {"data.txt", "n0", "n1", "n2"} <= {entry["path"] for entry in listed.json()["files"]}
        assert lb.get(f"/sessions/{session_id}").json()["executions"] == 3
        deleted = lb.delete(f"/sessions/{session_id}")
        assert deleted.status_code == 200 and deleted.json()["status"] == "closed", deleted.text
        for client in (c1, c2):  # ended: the same view from either replica
            assert client.get(f"/sessions/{session_id}").json()["status"] == "closed"
        assert forwarded(c1) + forwarded(c2) > before  # some requests were relayed


def test_replicas_tenants(cluster: Cluster) -> None:
    with (
        cluster.client(cluster.t1.url) as c1,
        cluster.client(cluster.t2.url) as c2,
        cluster.client(cluster.t2.url, token=cluster.other_token) as other2,
    ):
        job_id = submitted(c1, {"script": TICKING})
        session_id = c1.post("/sessions", json={}).json()["session_id"]
        before = forwarded(c2), metric_sum(c1, "ptc_internal_requests_total", 'outcome="accepted"')
        for method, path, body in (
            ("GET", f"/jobs/{job_id}", None),
            ("GET", f"/jobs/{job_id}/events", None),
            ("GET", f"/jobs/{job_id}/output/stdout", None),
            ("POST", f"/jobs/{job_id}/wait?timeout_s=1", None),
            ("POST", f"/jobs/{job_id}/stop", None),
            ("GET", f"/sessions/{session_id}", None),
            ("DELETE", f"/sessions/{session_id}", None),
            ("GET", f"/sessions/{session_id}/files", None),
            ("POST", "/execute", {"script": "print(1)", "session_id": session_id}),
        ):
            answer = other2.request(method, path, json=body)
            assert answer.status_code == 404, (method, path, answer.text)
        assert other2.get("/sessions").json()["sessions"] == []
        after = forwarded(c2), metric_sum(c1, "ptc_internal_requests_total", 'outcome="accepted"')
        assert after == before  # nothing of another key was relayed
        assert c2.get(f"/jobs/{job_id}").json()["status"] in ("queued", "running")  # the owner's key: relayed
        assert c2.post(f"/jobs/{job_id}/stop").json()["status"] == "stopped"
        assert c2.delete(f"/sessions/{session_id}").json()["status"] == "closed"


LONG = "import time\nprint('before', flush=True)\ntime.sleep(300)\nprint('never')\n"
"""A job that runs until stopped (or until its replica dies), after one line of output."""
KILL_BOUND_S = 3 * (
    float(replicas.REPLICA_ENV["PTC_REPLICA_LEASE_S"]) + float(replicas.REPLICA_ENV["PTC_REPLICA_SCAN_S"])
)
"""docs/scaling.md: a dead replica's jobs are reported lost within 3 × (lease + scan) (a correctness bound)."""


def epoch_of(cluster: Cluster, name: str) -> tuple[int, str]:
    """The registry row of replica ``name`` (``t1``, ``t2``): its epoch and state."""
    instance = cluster.members[name].instance_id
    with psycopg.connect(pgstore._libpq(cluster.store_url)) as conn:
        row = conn.execute("SELECT epoch, state FROM replicas WHERE instance_id = %s", (instance,)).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def started(client: Any, script: str = LONG, **extra: Any) -> str:
    """Submit ``script`` (with ``extra`` fields) without waiting; its job id once it printed its first line."""
    small = {"cpus": 0.25, "memory_mb": 64}  # five at once on two replicas sharing two CPUs
    body = {"script": script, "wait_s": 0, "timeout_s": 600, "limits": small, **extra}
    answer = client.post("/execute", json=body)
    assert answer.status_code == 202, answer.text
    job_id = str(answer.json()["job_id"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        view = client.get(f"/jobs/{job_id}").json()
        if view["stdout"]:
            return job_id
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} printed nothing in 60 s: {view}")


def test_replicas_kill_9(
    cluster: Cluster, engine: docker.DockerClient, record_property: Callable[[str, object], None]
) -> None:
    receiver = Receiver(failures=0)  # counts every delivery: each callback must arrive exactly once
    hook = {"callback_url": receiver.url}
    with cluster.client(cluster.t1.url) as c1, cluster.client(cluster.t2.url) as c2, closing(receiver):
        ended_ids = []
        for i in range(10):
            body = {"script": f"print('ended {i}')\nprint('x' * {i * 1000})", **hook}
            answer = c2.post("/execute", json=body)
            assert answer.status_code == 200 and answer.json()["status"] == "succeeded", answer.text
            ended_ids.append(answer.json()["job_id"])
        wait_until(lambda: all(c1.get(f"/jobs/{j}").json()["callback"]["state"] == "delivered" for j in ended_ids), 30)
        before = {j: (c1.get(f"/jobs/{j}").content, c1.get(f"/jobs/{j}/output/stdout").content) for j in ended_ids}
        session = c2.post("/sessions", json={"idle_timeout_s": 600})
        assert session.status_code == 201, session.text
        session_id = session.json()["session_id"]
        ran = c2.post("/execute", json={"script": "x = 1\nprint(x)", "session_id": session_id})
        assert ran.status_code == 200 and ran.json()["stdout"] == "1\n", ran.text
        on_t1 = [started(c1) for _ in range(2)]
        on_t2 = [started(c2, **hook, durable=False) for _ in range(3)]  # a survivor resumes durable ones instead
        time.sleep(1.5)  # three progress saves (PTC_PROGRESS_SAVE_S=0.5): the printed line is in the store
        t1_containers = {c.id for c in labelled_containers(engine, cluster.t1.instance_id, include_pool=True)}
        t1_sandboxes = {c1.get(f"/jobs/{job_id}").json()["sandbox_id"] for job_id in on_t1}
        assert len(t1_sandboxes) == 2 and all(any(c.startswith(s) for c in t1_containers) for s in t1_sandboxes)

        killed = time.monotonic()
        cluster.t2.kill()
        lost: dict[str, dict[str, Any]] = {}
        while len(lost) < 3 and time.monotonic() - killed < KILL_BOUND_S:
            for job_id in on_t2:
                answer = c1.get(f"/jobs/{job_id}")
                if job_id not in lost and answer.status_code == 200 and answer.json()["status"] == "lost":
                    lost[job_id] = answer.json()
            time.sleep(0.05)
        detected_s = time.monotonic() - killed
        record_property("dead_replica_detected_s", round(detected_s, 2))
        print(f"kill -9 t2 -> its jobs lost on t1 after {detected_s:.2f} s (bound {KILL_BOUND_S} s)")
        assert sorted(lost) == sorted(on_t2), f"not all lost within {KILL_BOUND_S} s: {sorted(lost)}"
        for view in lost.values():
            assert view["error"]["type"] == "replica_lost", view["error"]
            assert view["stdout"] == "before\n"  # as of its last progress save
            output = c1.get(f"/jobs/{view['job_id']}/output/stdout")
            assert output.status_code == 200 and output.content == b"before\n"
        assert epoch_of(cluster, "t2")[1] == "expired"
        broken = c1.get(f"/sessions/{session_id}")  # from the store: its replica is gone
        assert broken.status_code == 200 and broken.json()["status"] == "broken", broken.text
        assert c1.post("/execute", json={"script": "print(x)", "session_id": session_id}).status_code == 409

        # Every callback exactly once: the ten delivered before the kill, the three lost jobs' by t1 (a real receiver
        # counts them by webhook-id, after a pause for any duplicate to arrive).
        expected = {f"msg_{job_id}" for job_id in ended_ids + on_t2}

        def ids() -> list[str | None]:
            return [{k.lower(): v for k, v in h.items()}.get("webhook-id") for _, h, _ in receiver.deliveries]

        wait_until(lambda: set(ids()) >= expected, 30)
        time.sleep(2)
        counted = Counter(ids())
        assert counted == dict.fromkeys(expected, 1), counted
        for job_id in on_t2:
            assert c1.get(f"/jobs/{job_id}").json()["callback"]["state"] == "delivered"

        for job_id, (stored_view, stored_output) in before.items():  # byte-identical from t1 after the kill
            assert c1.get(f"/jobs/{job_id}").content == stored_view
            assert c1.get(f"/jobs/{job_id}/output/stdout").content == stored_output
        assert t1_containers <= {
            c.id for c in labelled_containers(engine, cluster.t1.instance_id, include_pool=True)
        }  # untouched
        for job_id in on_t1:
            assert c1.get(f"/jobs/{job_id}").json()["status"] == "running"
            assert c1.post(f"/jobs/{job_id}/stop").status_code in (200, 202)


def test_replicas_restart(cluster: Cluster, engine: docker.DockerClient) -> None:
    with cluster.client(cluster.t1.url) as c1:
        if cluster.t2.process.poll() is None:  # run alone: kill t2 with a job running
            with cluster.client(cluster.t2.url) as c2:
                started(c2, durable=False)
            cluster.t2.kill()
        epoch, _ = epoch_of(cluster, "t2")
        on_t1 = started(c1)
        t1_containers = {c.id for c in labelled_containers(engine, cluster.t1.instance_id, include_pool=True)}
        left = {c.id for c in labelled_containers(engine, cluster.t2.instance_id, include_pool=True)}
        assert left, "t2 left no sandbox behind"

        cluster.restart("t2")
        assert epoch_of(cluster, "t2") == (epoch + 1, "live")
        still = {c.id for c in labelled_containers(engine, cluster.t2.instance_id, include_pool=True)}
        assert not left & still, "t2's leftovers were not removed at its start"
        assert t1_containers <= {
            c.id for c in labelled_containers(engine, cluster.t1.instance_id, include_pool=True)
        }  # untouched
        assert c1.get(f"/jobs/{on_t1}").json()["status"] == "running"  # t1's job untouched
        with cluster.client(cluster.t2.url) as c2:
            answer = c2.post("/execute", json={"script": "print('after the restart')"})
            assert answer.status_code == 200, answer.text
            assert (answer.json()["status"], answer.json()["stdout"]) == ("succeeded", "after the restart\n")
            assert owners(cluster)[answer.json()["job_id"]] == "t2"
        assert c1.post(f"/jobs/{on_t1}/stop").status_code in (200, 202)
