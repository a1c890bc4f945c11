"""Issue 15, point 3, measured: what preloading saves ``import pandas`` in the data image.

``python -m bench.preload [--image IMAGE] [--runs 10] [--out FILE]`` (image default ``$PTC_DATA_IMAGE`` or
``ptc-sandbox-data:latest``) runs ``import pandas; print(1)`` with ``time.perf_counter`` around the import,
inside the script, ``--runs`` times each:

- ``session``: in one session of a service whose sandbox image is IMAGE (1 GiB sandboxes), whose resident
  interpreter imported the image's ``PTC_PRELOAD`` modules before forking the script;
- ``warm``: from that service's warm pool (one sandbox; an untimed wait for the pool to refill before each run);
- ``cold_interpreter``: ``python3 -c`` in a fresh ``docker run --rm --network none`` container of the same image,
  whose interpreter imports pandas itself (no resident interpreter, no preload): what the import costs without it.

It also reports the ``POST /execute`` round trip of the session and warm runs and the end-to-end time of the
``docker run``, and, for the cost of preloading, how long a cold sandbox of the service takes to answer (its
resident interpreter imports the preload list before it says hello) beside a cold sandbox of the minimal image
(``$PTC_SANDBOX_IMAGE``, ``print(1)``). Prints medians and minima (ms) and writes
every figure to ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import pool_ready, start_service, wait_until

SCRIPT = (
    "import time\nt = time.perf_counter()\nimport pandas\nprint(1)\nprint('%.3f' % ((time.perf_counter() - t) * 1000))"
)
MEMORY_MB = 1024
DOCKER_RUN = ["docker", "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "--user", "10001:10001"]
DOCKER_RUN += ["--entrypoint", "python3"]


def run(api: httpx.Client, placement: str, **body: Any) -> tuple[float, float]:
    """(import ms inside the script, POST /execute round trip ms); checks the job's ``sandbox_start``."""
    started = time.perf_counter()
    response = api.post("/execute", json={"script": SCRIPT, "tools": [], **body})
    http_ms = (time.perf_counter() - started) * 1000
    view = response.raise_for_status().json()
    lines = view["stdout"].split()
    if view["status"] != "succeeded" or lines[:1] != ["1"] or view["sandbox_start"] != placement:
        raise RuntimeError(f"unexpected run: {view}")
    return float(lines[1]), http_ms


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values), 3), "min_ms": round(min(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default=os.environ.get("PTC_DATA_IMAGE", "ptc-sandbox-data:latest"))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    figures: dict[str, Any] = {"image": args.image, "runs": args.runs}

    cold_import: list[float] = []
    cold_total: list[float] = []
    for _ in range(args.runs):
        started = time.perf_counter()
        out = subprocess.run(
            [*DOCKER_RUN, args.image, "-c", SCRIPT],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        cold_total.append((time.perf_counter() - started) * 1000)
        cold_import.append(float(out[1]))
    figures["cold_interpreter"] = {"import": summary(cold_import), "docker_run": summary(cold_total)}

    work = Path(tempfile.mkdtemp(prefix="ptcb", dir="/tmp"))
    svc = start_service(
        f"bench-preload-{secrets.token_hex(4)}",
        work / "svc",
        PTC_SANDBOX_IMAGE=args.image,
        PTC_DEFAULT_MEMORY_MB=str(MEMORY_MB),
        PTC_WARM_POOL_SIZE="1",
        PTC_WARM_POOL_MAX_PROFILES="1",  # the default profile's pool only: the cold runs stay cold
    )
    try:
        with svc.client(timeout=120) as api:
            cold_start = [run(api, "cold", limits={"memory_mb": MEMORY_MB + 1})[1] for _ in range(min(args.runs, 3))]
            figures["service_cold_start"] = {"http": summary(cold_start)}
            warm: list[tuple[float, float]] = []
            for _ in range(args.runs):
                wait_until(lambda: pool_ready(api, "default") >= 1, timeout_s=120)
                warm.append(run(api, "warm"))
            figures["warm"] = {"import": summary([w[0] for w in warm]), "http": summary([w[1] for w in warm])}
            session = api.post("/sessions", json={"tools": []}).raise_for_status().json()["session_id"]
            try:
                timed = [run(api, "session", session_id=session) for _ in range(args.runs)]
            finally:
                api.delete(f"/sessions/{session}")
            figures["session"] = {"import": summary([t[0] for t in timed]), "http": summary([t[1] for t in timed])}
    finally:
        svc.stop()

    minimal = os.environ.get("PTC_SANDBOX_IMAGE", "ptc-sandbox-runtime:latest")
    other = start_service(f"bench-preload-{secrets.token_hex(4)}", work / "minimal", PTC_WARM_POOL_MAX_PROFILES="1")
    try:
        with other.client(timeout=120) as api:
            starts = []
            for _ in range(min(args.runs, 3)):
                started = time.perf_counter()
                body = {"script": "print(1)", "tools": [], "limits": {"memory_mb": MEMORY_MB + 1}}
                view = api.post("/execute", json=body).raise_for_status().json()
                starts.append((time.perf_counter() - started) * 1000)
                if view["sandbox_start"] != "cold" or view["stdout"] != "1\n":
                    raise RuntimeError(f"unexpected run: {view}")
            figures["minimal_cold_start"] = {"image": minimal, "http": summary(starts)}
    finally:
        other.stop()

    print(f"import pandas; print(1) in {args.image}, {args.runs} runs each (median / min, ms)")
    print(f"{'placement':<18} {'import (in script)':>20} {'end to end':>20}")
    for name, key, total in (
        ("cold interpreter", "cold_interpreter", "docker_run"),
        ("warm pool", "warm", "http"),
        ("session", "session", "http"),
    ):
        imp, tot = figures[key]["import"], figures[key][total]
        print(
            f"{name:<18} {imp['median_ms']:>11.3f} / {imp['min_ms']:<7.3f}"
            f" {tot['median_ms']:>11.1f} / {tot['min_ms']:<7.1f}"
        )
    cold = figures["service_cold_start"]["http"]
    print(f"{'service cold start':<18} {'(preload in start)':>20} {cold['median_ms']:>11.1f} / {cold['min_ms']:<7.1f}")
    cold = figures["minimal_cold_start"]["http"]
    print(
        f"{'minimal cold start':<18} {'(print(1))':>20} {cold['median_ms']:>11.1f} / {cold['min_ms']:<7.1f}  {minimal}"
    )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
