"""Benchmark (not a test): how long a durable job is away after its replica dies (docs/durability.md, Another
replica takes over).

    PTC_TEST_STORE_URL=... .venv/bin/python -m bench.replica_death [--rounds 3]

Starts two replicas (``r1``, ``r2``) on a fresh PostgreSQL database of ``PTC_TEST_STORE_URL``'s server
(``deploy/local.sh postgres`` prints it), each with its own work dir and port, for each lease setting in turn:
the defaults (``PTC_REPLICA_HEARTBEAT_S`` 2, ``PTC_REPLICA_LEASE_S`` 10, ``PTC_REPLICA_SCAN_S`` 2) and the
integration tests' short ones (0.5, 3, 0.5). Each round submits a durable job to ``r2`` that prints a line and
sleeps, kills ``r2`` with ``kill -9`` once the line is out, and measures from the kill:

- **taken over**: until ``r1`` answers for the job with a resume in its view (``resumes``: its reaper found the
  replica dead, moved the job to itself and admitted it again);
- **running again**: until the job's output on ``r1`` holds the line its replay printed again after the resume (the
  script running in its new sandbox).

Then ``r2`` is started again for the next round. Prints a Markdown table (median and maximum per setting).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import httpx

from service.tenancy import hash_token
from tests import pgstore
from tests.conftest import Service, start_service, stop_clean

SCRIPT = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"
SETTINGS = {
    "defaults (beat 2 s, lease 10 s, scan 2 s)": {},
    "tests' (beat 0.5 s, lease 3 s, scan 0.5 s)": {
        "PTC_REPLICA_HEARTBEAT_S": "0.5",
        "PTC_REPLICA_LEASE_S": "3",
        "PTC_REPLICA_SCAN_S": "0.5",
    },
}


def until(check: Callable[[], object], timeout_s: float = 120.0) -> float:
    """Poll ``check`` every 20 ms until it is truthy; the monotonic time then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError(f"not within {timeout_s} s")


def one_round(r1: Service, r2: Service, token: str) -> tuple[float, float]:
    """Kill ``r2`` under a durable job; (s to taken over, s to running again) on ``r1``."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=r2.url, headers=headers, timeout=60) as a2:
        body = {"script": SCRIPT, "wait_s": 0, "timeout_s": 600, "limits": {"cpus": 0.25, "memory_mb": 64}}
        job_id = a2.post("/execute", json=body).raise_for_status().json()["job_id"]
        until(lambda: a2.get(f"/jobs/{job_id}").json()["stdout"] == "started\n", 60)
    killed = time.monotonic()
    r2.kill()
    with httpx.Client(base_url=r1.url, headers=headers, timeout=60) as a1:

        def view() -> dict[str, Any]:
            answer = a1.get(f"/jobs/{job_id}")
            found: dict[str, Any] = answer.json() if answer.status_code == 200 else {}
            return found

        taken = until(lambda: bool(view().get("resumes")))
        running = until(lambda: view().get("stdout") == "started\n" and view().get("stdout_bytes") == 8)
        a1.post(f"/jobs/{job_id}/stop")
    return taken - killed, running - killed


def stop_all(engine: docker.DockerClient, members: dict[str, Service]) -> None:
    """Stop both replicas (the current processes); no container of theirs may remain."""
    for member in members.values():
        stop_clean(engine, member)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="kills per setting (default 3)")
    args = parser.parse_args()
    problem = pgstore.problem()
    if problem is not None:
        raise SystemExit(f"{problem}; deploy/local.sh postgres starts one and prints its URL")
    engine = docker.from_env()
    token = secrets.token_urlsafe(32)
    rows = []
    for label, lease in SETTINGS.items():
        scratch = Path(tempfile.mkdtemp(prefix="ptcr", dir="/tmp"))
        try:
            with pgstore.fresh_database() as store_url, ExitStack() as stack:
                env = {"PTC_STORE_URL": store_url, "PTC_API_KEYS": f"bench:{hash_token(token)}", **lease}
                env["PTC_METRICS_KEYS"] = "bench"
                env.update(PTC_LOG_LEVEL="warning", PTC_WARM_POOL_SIZE="1", PTC_INTERNAL_SECRET=secrets.token_hex(16))
                members: dict[str, Service] = {}
                for name in ("r1", "r2"):
                    (scratch / name).mkdir()
                    members[name] = start_service(f"{name}-{secrets.token_hex(2)}", scratch / name, **env)
                stack.callback(stop_all, engine, members)
                taken, running = [], []
                for _ in range(args.rounds):
                    t, r = one_round(members["r1"], members["r2"], token)
                    taken.append(t)
                    running.append(r)
                    old = members["r2"]
                    port = old.url.rsplit(":", 1)[1]
                    members["r2"] = start_service(old.instance_id, old.work_dir, **env, PTC_PORT=port)
                rows.append((label, taken, running))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC (`python -m bench.replica_death --rounds {args.rounds}`).\n"
    )
    print("| leases | taken over: median s | max s | running again: median s | max s | rounds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, taken, running in rows:
        print(
            f"| {label} | {statistics.median(taken):.2f} | {max(taken):.2f} | {statistics.median(running):.2f} "
            f"| {max(running):.2f} | {len(taken)} |"
        )


if __name__ == "__main__":
    main()
