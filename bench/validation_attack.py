"""Issue 11, item 11, measured: three jobs of one key hammer an expensive schema; what does another key see?

``python -m bench.validation_attack [--seconds 20]`` starts a service (as the tests do: real engine, the
sandbox image of ``PTC_SANDBOX_IMAGE``), starts three jobs of key ``mallory`` that call a tool whose array items
use a 10,000-value enum with 20,000 items in a loop, then, while they run, samples ``/healthz`` latency and the
service's resident memory, and runs one job of another key making three echo calls (``wait_s`` 60). Prints one
JSON object: the echo calls' ``duration_ms``, that job's wall time, ``/healthz`` latency (median, max) and the
service's RSS (MiB) before and under the attack.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from service.tenancy import hash_token
from tests.conftest import start_service
from tests.integration.test_validation_fairness import ECHO, HAMMER, PICK

MALLORY = secrets.token_urlsafe(32)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _healthz_ms(probe: httpx.Client) -> float:
    started = time.perf_counter()
    probe.get("/healthz")
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20, help="how long /healthz is sampled under the attack")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptc-attack-"))
    keys = scratch / "keys"
    keys.write_text(f"mallory:{hash_token(MALLORY)}\n")
    service = start_service(  # the per-key running quota raised so that the attacker's three jobs all run
        f"bench-attack-{secrets.token_hex(4)}", scratch / "svc", PTC_API_KEYS_FILE=str(keys), PTC_QUOTA_RUNNING_JOBS="4"
    )
    result: dict[str, Any] = {}
    hostile: list[str] = []
    try:
        with (
            service.client(timeout=120) as api,
            httpx.Client(base_url=service.url, timeout=120) as probe,
            httpx.Client(base_url=service.url, timeout=120, headers={"Authorization": f"Bearer {MALLORY}"}) as mallory,
        ):
            idle = [_healthz_ms(probe) for _ in range(10)]
            result["idle"] = {"healthz_ms_median": statistics.median(idle), "rss_mib": _rss_mib(service.process.pid)}
            for _ in range(3):
                body = {"script": HAMMER, "tools": [PICK], "wait_s": 0, "timeout_s": args.seconds + 120}
                hostile.append(mallory.post("/execute", json=body).json()["job_id"])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if all(mallory.get(f"/jobs/{j}").json()["calls"] for j in hostile):
                    break
                time.sleep(0.5)
            echo: dict[str, Any] = {}

            def run_echo() -> None:
                started = time.monotonic()
                script = "import tools\nfor i in range(3):\n    tools.echo(x=i)\n"
                view = api.post("/execute", json={"script": script, "tools": [ECHO], "wait_s": 60}).json()
                echo["status"] = view["status"]
                echo["call_ms"] = [c["duration_ms"] for c in view["calls"]]
                echo["job_s"] = round(time.monotonic() - started, 2)

            runner = threading.Thread(target=run_echo)
            runner.start()
            samples, rss = [], []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                samples.append(_healthz_ms(probe))
                rss.append(_rss_mib(service.process.pid))
                time.sleep(0.5)
            runner.join()
            result["attack"] = {
                "healthz_ms_median": round(statistics.median(samples), 1),
                "healthz_ms_max": round(max(samples), 1),
                "rss_mib_max": round(max(rss), 1),
                "echo_job": echo,
                "hostile_calls_done": sum(
                    sum(c["status"] != "pending" for c in mallory.get(f"/jobs/{j}").json()["calls"]) for j in hostile
                ),
            }
            for job_id in hostile:
                mallory.post(f"/jobs/{job_id}/stop")
    finally:
        service.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
