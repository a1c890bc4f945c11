"""Measurement (not a test): sustained session runs per second of several checkouts, interleaved on one machine.

    .venv/bin/python -m bench.sustained_ab --tree new=. --tree old=/tmp/old,ptc-sandbox-runtime:old[,/tmp/venv-old]
        [--seconds 15] [--rounds 3] [--clients 8]

Each ``--tree LABEL=PATH[,IMAGE[,VENV]]`` is a checkout with its own runtime image (default
``ptc-sandbox-runtime:latest``; build another tree's with ``cd PATH && sandbox_image/build.sh --base offline --tag
IMAGE``) and the venv whose Python runs it (default: this one; a checkout whose dependencies differ needs its own).
Every round runs each tree in turn, in a fresh process of that tree's own code (``tests.conftest.start_service``:
its own service, no warm pool, quotas out of the way): ``--clients`` sessions, each driven by one client posting
``print(1)`` back to back for ``--seconds`` after a 3 s warm-up, as ``bench``'s sustained session mode does. It
prints one line per run: runs/s, and the CPU per run (ms) of the service process, of every container of the engine
(the ``docker`` cgroup's ``cpuacct.usage``, cgroup v1; absent elsewhere) and of the whole machine. The host drifts by
20-30% over minutes: compare the trees' runs of one round, and their medians over several rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DOCKER_CPU = Path("/sys/fs/cgroup/cpuacct/docker/cpuacct.usage")
ALL_CPU = Path("/sys/fs/cgroup/cpuacct/cpuacct.usage")


def _cpu_s(path: Path) -> float | None:
    try:
        return int(path.read_text()) / 1e9
    except (OSError, ValueError):
        return None


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_run(before: float | None, after: float | None, runs: int) -> float | None:
    """CPU ms per run between two readings of seconds (None: unreadable, or no run)."""
    if before is None or after is None or not runs:
        return None
    return round((after - before) * 1000 / runs, 2)


def worker(tree: str, seconds: float, clients: int) -> dict[str, Any]:
    """In a process of ``tree``'s own code: start its service, drive ``clients`` sessions, return the figures."""
    sys.path[:0] = [tree, tree + "/sandbox_image"]
    os.environ["PYTHONPATH"] = f"{tree}:{tree}/sandbox_image"
    import httpx

    from tests.conftest import start_service

    scratch = Path(tempfile.mkdtemp(prefix="ab-"))
    service = start_service(
        f"ab-{secrets.token_hex(3)}", scratch / "svc", PTC_LOG_LEVEL="warning", PTC_MAX_QUEUE="1000",
        PTC_QUOTA_RUNNING_JOBS="1000", PTC_QUOTA_QUEUED_JOBS="1000", PTC_QUOTA_SESSIONS="64",
        PTC_QUOTA_SESSION_CPUS="1000", PTC_QUOTA_SESSION_MEMORY_MB="1000000", PTC_QUOTA_JOBS_PER_MINUTE="1000000",
        PTC_WARM_POOL_SIZE="0",
    )  # fmt: skip
    try:
        with service.client() as api:
            sessions = [api.post("/sessions", json={}).json()["session_id"] for _ in range(clients)]
            counts = [0, 0]  # runs in the window, errors
            lock = threading.Lock()
            start = time.monotonic() + 3.0
            end = start + seconds
            marks: dict[str, tuple[float | None, ...]] = {}

            def client(session: str) -> None:
                with httpx.Client(base_url=str(api.base_url), headers=api.headers, timeout=120) as c:
                    while (now := time.monotonic()) < end:
                        view = c.post("/execute", json={"script": "print(1)", "session_id": session}).json()
                        with lock:
                            if start <= now:
                                counts[0 if view.get("stdout") == "1\n" else 1] += 1

            def sample(name: str, at: float) -> None:
                time.sleep(max(0.0, at - time.monotonic()))
                marks[name] = (
                    time.monotonic(),
                    _process_cpu_s(service.process.pid),
                    _cpu_s(DOCKER_CPU),
                    _cpu_s(ALL_CPU),
                )

            threads = [threading.Thread(target=client, args=(s,)) for s in sessions]
            threads += [threading.Thread(target=sample, args=(n, t)) for n, t in (("a", start), ("b", end))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    runs = counts[0]
    a, b = marks["a"], marks["b"]
    per_run = {
        name: _per_run(a[i], b[i], runs) for i, name in ((1, "service_ms"), (2, "sandboxes_ms"), (3, "machine_ms"))
    }
    return {"runs_per_s": round(runs / seconds, 1), "errors": counts[1], **per_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH[,IMAGE[,VENV]]")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], float(args.worker[1]), int(args.worker[2]))))
        return
    trees = []
    for spec in args.tree:
        label, _, rest = spec.partition("=")
        path, image, venv = [*rest.split(","), None, None][:3]
        trees.append((label, str(Path(path).resolve()), image or "ptc-sandbox-runtime:latest", venv))
    this = Path(__file__).resolve()
    results: dict[str, list[float]] = {label: [] for label, *_ in trees}
    for round_no in range(1, args.rounds + 1):
        for label, path, image, venv in trees:
            python = str(Path(venv) / "bin" / "python") if venv else sys.executable
            env = {**os.environ, "PTC_SANDBOX_IMAGE": image}
            done = subprocess.run(
                [python, str(this), "--tree", "x=.", "--worker", path, str(args.seconds), str(args.clients)],
                cwd=path, env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(f"round {round_no} {label}: failed\n{done.stderr[-2000:]}", flush=True)
                continue
            figures = json.loads(lines[-1])
            results[label].append(figures["runs_per_s"])
            print(f"{time.strftime('%H:%M:%S')} round {round_no} {label:8} {json.dumps(figures)}", flush=True)
    for label, values in results.items():
        if values:
            print(f"{label:8} runs/s median {statistics.median(values):.1f} of {values}")


if __name__ == "__main__":
    main()
