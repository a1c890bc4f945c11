"""Benchmark (not a test): sustained throughput through the balancer with one or two replicas on one store
(docs/scaling.md, step 10; issue 17's closing figures).

    deploy/local.sh bench --replicas 1|2 [--seconds 15] [--clients 8] [--sessions-via owner|balancer] [--out F]
    (= PTC_TEST_STORE_URL=... .venv/bin/python -m bench.replicas ...)

Starts the replicas' cluster as the integration tests do (``tests/integration/replicas.py``): a fresh PostgreSQL
database on the server of ``PTC_TEST_STORE_URL`` (``deploy/local.sh postgres`` prints it), ``--replicas`` real
``ptc-sandbox serve`` processes on the shared engine (``b1``, ``b2``: their own work dirs and ports, one API key,
warm pool of 2 each, short leases) and HAProxy with ``deploy/replicas/haproxy.cfg`` in front (with one replica,
both of its servers point at it). Then, each for ``--seconds``, with ``--clients`` concurrent clients:

- **session scripts**: one session per client, created through the balancer; each client runs ``print(1)`` in
  its session again and again. Sessions stay on the replica that holds their sandbox: with ``--sessions-via
  owner`` (the default until forwarding, docs/scaling.md step 3, is merged) each client sends its scripts to
  that replica (found by asking each replica for the session); ``balancer`` sends them through the balancer
  (a script that lands on the other replica needs forwarding, else it is counted an error);
- **one-shot jobs**: ``POST /execute`` of ``print(1)`` through the balancer, each in a fresh sandbox (the warm
  pools refill from the engine): bound by the engine's container starts;
- the **engine's own rate** as the yardstick: ``docker run --rm --network none`` of the sandbox image
  (``python3 -c pass``; create, start, wait, remove) from ``--clients`` threads for ``--seconds``.

Prints a JSON document (and writes it to ``--out`` when given): per mode the scripts that succeeded per second,
the errors (by HTTP status, or ``transport``), the latency percentiles (ms) and the jobs each replica ran
(``ptc_executions_total``), with the machine's load average before and after. Everything it started is stopped
at the end (no container of its replicas may remain). A configuration takes about 3 × ``--seconds`` plus
20 s of start and stop.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import httpx

from bench.__main__ import engine_rate, machine, stats
from service.tenancy import hash_token
from tests import pgstore
from tests.conftest import Service, start_service, stop_clean
from tests.integration.replicas import REPLICA_ENV, Balancer, haproxy_binary

SCRIPT = "print(1)"
LIMITS = {
    # One key stands for every client: its quotas are each replica's own limits (as bench/__main__.py's).
    "PTC_LOG_LEVEL": "warning",
    "PTC_MAX_QUEUE": "1000",
    "PTC_QUOTA_RUNNING_JOBS": "1000",
    "PTC_QUOTA_QUEUED_JOBS": "1000",
    "PTC_QUOTA_SESSIONS": "32",
    "PTC_QUOTA_SESSION_CPUS": "1000",
    "PTC_QUOTA_SESSION_MEMORY_MB": "1000000",
    "PTC_QUOTA_JOBS_PER_MINUTE": "1000000",
}


class Load:
    """Many clients against the cluster for a while: counts, errors by kind, latencies."""

    def __init__(self, token: str) -> None:
        self.headers = {"Authorization": f"Bearer {token}"}
        self.ok = 0
        self.errors: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def run(self, targets: list[tuple[str, dict[str, Any]]], seconds: float) -> dict[str, Any]:
        """One thread per ``(base URL, body)`` posting ``/execute`` until ``seconds`` pass."""
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self._client, args=(url, body, deadline)) for url, body in targets]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        return {
            "clients": len(targets),
            "seconds": round(elapsed, 2),
            "ok": self.ok,
            "errors": sum(self.errors.values()),
            "errors_by_kind": dict(self.errors),
            "per_second": round(self.ok / elapsed, 2),
            "latency_ms": stats(self.latencies),
        }

    def _client(self, url: str, body: dict[str, Any], deadline: float) -> None:
        with httpx.Client(base_url=url, headers=self.headers, timeout=120) as api:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                kind = None
                try:
                    response = api.post("/execute", json=body)
                    if response.status_code != 200:
                        kind = str(response.status_code)
                    elif response.json().get("stdout") != "1\n":
                        kind = f"status {response.json().get('status')}"
                except httpx.HTTPError as exc:
                    kind = f"transport {type(exc).__name__}"
                with self.lock:
                    self.latencies.append((time.perf_counter() - started) * 1000)
                    if kind is None:
                        self.ok += 1
                    else:
                        self.errors[kind] += 1


def executions(service: Service) -> int:
    """Jobs the replica ran to any end (``ptc_executions_total``, all statuses)."""
    text = httpx.get(f"{service.url}/metrics", headers=service.headers, timeout=10).raise_for_status().text
    return sum(
        int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith("ptc_executions_total{")
    )


def owner_of(session_id: str, replicas: list[Service], token: str) -> Service:
    """The replica that holds the session (the one that answers for it; before step 4 the other does not know it)."""
    for service in replicas:
        answer = httpx.get(
            f"{service.url}/sessions/{session_id}", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        if answer.status_code == 200:
            return service
    raise RuntimeError(f"no replica answers for session {session_id}")


def run(replicas: int, seconds: float, clients: int, sessions_via: str) -> dict[str, Any]:
    """Start the cluster, measure (see the module's docstring), stop everything; returns the figures."""
    binary = haproxy_binary()
    if binary is None:
        raise SystemExit("no haproxy: deploy/local.sh haproxy installs Debian's package")
    problem = pgstore.problem()
    if problem is not None:
        raise SystemExit(f"{problem}; deploy/local.sh postgres starts one and prints its URL")
    engine = docker.from_env()
    scratch = Path(tempfile.mkdtemp(prefix="ptcb", dir="/tmp"))  # short: the sandboxes' unix sockets live here
    token = secrets.token_urlsafe(32)
    env = {"PTC_API_KEYS": f"bench:{hash_token(token)}", "PTC_METRICS_KEYS": "bench", **REPLICA_ENV, **LIMITS}
    result: dict[str, Any] = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "replicas": replicas,
        "clients": clients,
        "sessions_via": sessions_via,
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with pgstore.fresh_database() as store_url, ExitStack() as stack:
            services: list[Service] = []
            for n in range(1, replicas + 1):
                work_dir = scratch / f"b{n}"
                work_dir.mkdir()
                svc = start_service(f"b{n}", work_dir, PTC_STORE_URL=store_url, **env)
                svc.token = token
                stack.callback(stop_clean, engine, svc)
                services.append(svc)
            addresses = [svc.url.removeprefix("http://") for svc in services]
            balancer = Balancer(binary, (addresses[0], addresses[-1]), scratch / "haproxy.log")
            stack.callback(balancer.stop)
            balancer.wait_ready()
            time.sleep(2)  # the warm pools fill
            with httpx.Client(base_url=balancer.url, headers={"Authorization": f"Bearer {token}"}) as api:
                created = [api.post("/sessions", json={}) for _ in range(clients)]
                sessions = [answer.raise_for_status().json()["session_id"] for answer in created]
                owners = [owner_of(sid, services, token) for sid in sessions]
                result["sessions_per_replica"] = dict(Counter(owner.instance_id for owner in owners))
                targets = [
                    (owner.url if sessions_via == "owner" else balancer.url, {"script": SCRIPT, "session_id": sid})
                    for sid, owner in zip(sessions, owners, strict=True)
                ]
                before = [executions(svc) for svc in services]
                result["session"] = Load(token).run(targets, seconds)
                after = [executions(svc) for svc in services]
                result["session"]["ran_per_replica"] = {
                    svc.instance_id: a - b for svc, a, b in zip(services, after, before, strict=True)
                }
                for owner, sid in zip(owners, sessions, strict=True):
                    httpx.delete(f"{owner.url}/sessions/{sid}", headers=owner.headers, timeout=30)
                time.sleep(2)  # the warm pools settle before the one-shot load
                before = after
                result["one_shot"] = Load(token).run([(balancer.url, {"script": SCRIPT})] * clients, seconds)
                after = [executions(svc) for svc in services]
                result["one_shot"]["ran_per_replica"] = {
                    svc.instance_id: a - b for svc, a, b in zip(services, after, before, strict=True)
                }
            result["load_after_jobs"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["engine_starts_per_second"] = round(engine_rate(seconds, clients), 2)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=2, help="replicas behind the balancer")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each measured phase (s)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument(
        "--sessions-via",
        choices=("owner", "balancer"),
        default="owner",
        help="where session scripts go: the replica holding the session (until forwarding), or the balancer",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result = run(args.replicas, args.seconds, args.clients, args.sessions_via)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
