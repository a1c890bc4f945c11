"""Benchmark (not a test): how fast scripts start and tools answer, beside the alternatives, on this machine.

    deploy/local.sh bench [--quick] [--sustain-s 30] [--out bench/results]
    (= .venv/bin/python -m bench ...)

Starts its own service (scratch work dir, warm pool of 4 for the default profile, one API key) and
measures, in one run on the same machine (times in ms unless said otherwise):

- ``POST /execute`` of ``print(1)`` with no tools, HTTP round trip: in a
  session; from the warm pool (after an untimed pause that lets the pool
  refill, so the pool has stock); cold (non-default limits, and the service
  keeps a pool for the default profile only, so no pooled sandbox fits);
  ``docker run --rm --network none`` of the same image; and bare
  ``/usr/bin/python3 -c 'print(1)'`` as the floor;
- one echo tool call round trip inside a script: each of 1,000 sequential
  calls timed in the sandbox with ``time.perf_counter``;
- a fan-out of 1,000 concurrent echo calls (``tools.aio`` + ``asyncio.gather``),
  wall time in the sandbox, repeated;
- sustained throughput for ``--sustain-s`` seconds with 8 concurrent clients,
  one-shot and in sessions (one per client), with error counts, beside the
  engine's own container-start rate (Docker SDK create+start+wait+remove of
  ``python3 -c pass`` from 8 threads for the same time);
- memory of an idle pooled sandbox and an idle session (engine stats:
  usage minus page cache).

Writes ``<out>/bench.json`` (every figure) and ``<out>/bench.md`` (the
table docs/performance.md quotes) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import httpx

from service.observability.stages import HEADER as STAGES_HEADER
from service.sandbox.labels import LABEL_JOB, LABEL_POOL
from tests.conftest import IMAGE, labelled_containers, start_service, wait_until

ECHO = [
    {
        "name": "echo",
        "parameters": {"type": "object", "properties": {"i": {"type": "integer"}}},
        "endpoint": {"kind": "echo"},
    }
]
SEQUENTIAL_SCRIPT = """
import json, time, tools
samples = []
for i in range({n}):
    t = time.perf_counter()
    tools.echo(i=i)
    samples.append((time.perf_counter() - t) * 1000)
print(json.dumps(samples))
"""
MEMORY_SESSIONS = 8  # sessions opened (then each running a job) for the service's memory per session and per job
STAMPED_SCRIPT = "import time; t = time.monotonic_ns(); print(1); print(t)"  # print(1), and when it began
FANOUT_SCRIPT = """
import asyncio, json, time, tools
async def main():
    walls = []
    for _ in range({rounds}):
        t = time.perf_counter()
        await asyncio.gather(*(tools.aio.echo(i=i) for i in range({n})))
        walls.append((time.perf_counter() - t) * 1000)
    return walls
print(json.dumps(asyncio.run(main())))
"""


def stats(samples: list[float]) -> dict[str, float]:
    """Median, p90, p99, min and max of ``samples`` (nearest-rank percentiles), with their count."""
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p * len(ordered) + 0.5) - 1))]

    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p90": pct(0.90),
        "p99": pct(0.99),
        "min": ordered[0],
        "max": ordered[-1],
    }


def timed(fn: Callable[[], object], n: int, warmup: int = 2, pause_s: float = 0.0) -> list[float]:
    """``n`` timings of ``fn`` in ms after ``warmup`` untimed calls, each after an untimed ``pause_s``."""
    samples = []
    for i in range(warmup + n):
        if pause_s:
            time.sleep(pause_s)
        started = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append((time.perf_counter() - started) * 1000)
    return samples


def engine_rate(seconds: float, threads: int) -> float:
    """Containers the engine creates, starts, runs (``python3 -c pass``) and removes per second."""
    done = 0
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker() -> None:
        nonlocal done
        client = docker.from_env()
        while time.monotonic() < deadline:
            client.containers.run(
                IMAGE, ["-c", "pass"], entrypoint="python3", network_mode="none", remove=True, labels={"bench": "1"}
            )
            with lock:
                done += 1

    started = time.monotonic()
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return done / (time.monotonic() - started)


class Bench:
    def __init__(self, api: httpx.Client, engine: docker.DockerClient, instance: str, pid: int) -> None:
        self.api = api
        self.pid = pid  # the service process's
        self.engine = engine
        self.instance = instance
        self.starts: dict[str, list[str]] = {}

    def execute(self, body: dict[str, Any], label: str | None = None) -> dict[str, Any]:
        response = self.api.post("/execute", json={"tools": [], **body})
        response.raise_for_status()
        view: dict[str, Any] = response.json()
        if view["status"] != "succeeded":
            raise RuntimeError(f"{label or 'execute'}: {view['status']}: {view['error']} {view['stderr'][-500:]}")
        if label:
            self.starts.setdefault(label, []).append(view["sandbox_start"])
        return view

    def staged(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float], float]:
        """POST /execute with ``X-PTC-Stages: 1``: (the view, its stages in ms from ``Server-Timing``, the
        client's round trip in ms)."""
        started = time.perf_counter()
        response = self.api.post("/execute", json={"tools": [], **body}, headers={STAGES_HEADER: "1"})
        elapsed = (time.perf_counter() - started) * 1000
        response.raise_for_status()
        view: dict[str, Any] = response.json()
        if view["status"] != "succeeded":
            raise RuntimeError(f"staged: {view['status']}: {view['error']} {view['stderr'][-500:]}")
        return view, server_timing(response.headers.get("server-timing", "")), elapsed

    def breakdown(self, n_session: int, n_warm: int, n_calls: int) -> dict[str, Any]:
        """Per-stage medians (ms) of ``print(1)`` in a session and from the warm pool, and of one echo call."""
        sid = self.session()
        try:
            runs = [
                self.stamped(self.staged({"script": STAMPED_SCRIPT, "session_id": sid})) for _ in range(5 + n_session)
            ]
        finally:
            self.api.delete(f"/sessions/{sid}")
        session = runs[5:]
        sid = self.session(tools=ECHO)
        try:
            view, timing, _ = self.staged({"script": SEQUENTIAL_SCRIPT.format(n=n_calls), "session_id": sid})
            in_script = statistics.median(json.loads(view["stdout"]))
            calls = {k[len("call-") :]: v / n_calls for k, v in timing.items() if k.startswith("call-")}
            calls["transport and stub (in the script, not in the broker)"] = in_script - sum(calls.values())
            calls["total (in the script)"] = in_script
        finally:
            self.api.delete(f"/sessions/{sid}")
        warm = []
        for _ in range(n_warm):
            time.sleep(0.5)  # the pool refills
            warm.append(self.stamped(self.staged({"script": STAMPED_SCRIPT})))
        return {"session": medians(session), "warm_pool": medians(warm), "tool_call": calls}

    @staticmethod
    def stamped(staged: tuple[dict[str, Any], dict[str, float], float]) -> dict[str, float]:
        """One staged run's stages (ms, each since the mark before it), with the script's first line (its own stamp,
        ``STAMPED_SCRIPT``) placed among the sandbox's moments, and the client's side (HTTP client and transport)
        from its round trip."""
        view, timing, elapsed = staged
        at = timing.pop("origin")
        marks = [("received", at)]
        for name, ms in timing.items():  # each stage is the time since the mark before it
            if name != "total" and not name.startswith("call-"):
                at += ms * 1e6
                marks.append((name, at))
        stamp = float(view["stdout"].split()[1])  # the script's first line (STAMPED_SCRIPT), same clock under runc
        if marks[0][1] <= stamp <= marks[-1][1]:
            marks.append(("sandbox: the script's first line", stamp))
        marks.sort(key=lambda mark: mark[1])
        out = {name: (at - marks[i][1]) / 1e6 for i, (name, at) in enumerate(marks[1:])}
        out["total"] = timing["total"]
        out["client and transport (round trip minus total)"] = elapsed - timing["total"]
        out["round trip (client)"] = elapsed
        return out

    def session(self, **body: Any) -> str:
        response = self.api.post("/sessions", json=body)
        response.raise_for_status()
        return str(response.json()["session_id"])

    def print1(self, n_session: int, n_warm: int, n_cold: int, n_docker: int) -> dict[str, Any]:
        sid = self.session()
        try:
            in_session = timed(lambda: self.execute({"script": "print(1)", "session_id": sid}, "session"), n_session, 5)
        finally:
            self.api.delete(f"/sessions/{sid}")
        warm = timed(lambda: self.execute({"script": "print(1)"}, "warm"), n_warm, 2, pause_s=0.5)
        cold = timed(lambda: self.execute({"script": "print(1)", "limits": {"memory_mb": 255}}, "cold"), n_cold)

        def docker_run() -> None:
            out = subprocess.run(
                ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", IMAGE, "-c", "print(1)"],
                check=True,
                capture_output=True,
            )
            assert out.stdout == b"1\n"

        def bare() -> None:
            subprocess.run(["/usr/bin/python3", "-c", "print(1)"], check=True, capture_output=True)

        third = len(in_session) // 3
        return {
            "session": stats(in_session),
            "session_thirds_medians": [statistics.median(in_session[i * third : (i + 1) * third]) for i in range(3)],
            "warm_pool": stats(warm),
            "cold": stats(cold),
            "docker_run_rm": stats(timed(docker_run, n_docker)),
            "bare_python": stats(timed(bare, 30)),
            "sandbox_start_seen": {k: {s: v.count(s) for s in set(v)} for k, v in self.starts.items()},
        }

    def tool_calls(self, n_calls: int, fanout: int, rounds: int) -> dict[str, Any]:
        sid = self.session(tools=ECHO)
        try:
            view = self.execute({"script": SEQUENTIAL_SCRIPT.format(n=n_calls), "session_id": sid, "timeout_s": 600})
            sequential = json.loads(view["stdout"])
            assert view["calls_total"] == n_calls, view["calls_total"]
            view = self.execute({"script": FANOUT_SCRIPT.format(n=fanout, rounds=rounds), "session_id": sid})
            walls = json.loads(view["stdout"])
            assert view["calls_total"] == fanout * rounds and view["calls_by_status"] == {"ok": fanout * rounds}
        finally:
            self.api.delete(f"/sessions/{sid}")
        return {"round_trip_ms": stats(sequential), "fanout_wall_ms": stats(walls), "fanout_calls": fanout}

    def sustained(self, seconds: float, clients: int) -> dict[str, Any]:
        result: dict[str, Any] = {"seconds": seconds, "clients": clients}
        for mode in ("session", "one_shot"):
            sessions = [self.session() for _ in range(clients)] if mode == "session" else []
            counts = {"ok": 0, "errors": 0}
            latencies: list[float] = []
            lock = threading.Lock()
            deadline = time.monotonic() + seconds

            def client(
                i: int,
                deadline: float = deadline,
                sessions: list[str] = sessions,
                counts: dict[str, int] = counts,
                latencies: list[float] = latencies,
                lock: threading.Lock = lock,
            ) -> None:
                with httpx.Client(base_url=str(self.api.base_url), headers=self.api.headers, timeout=120) as api:
                    while time.monotonic() < deadline:
                        body: dict[str, Any] = {"script": "print(1)"}
                        if sessions:
                            body["session_id"] = sessions[i]
                        started = time.perf_counter()
                        try:
                            response = api.post("/execute", json=body)
                            ok = response.status_code == 200 and response.json()["stdout"] == "1\n"
                        except httpx.HTTPError:
                            ok = False
                        with lock:
                            counts["ok" if ok else "errors"] += 1
                            latencies.append((time.perf_counter() - started) * 1000)

            started = time.monotonic()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - started
            for sid in sessions:
                self.api.delete(f"/sessions/{sid}")
            result[mode] = {
                **counts,
                "per_second": counts["ok"] / elapsed,
                "latency_ms": stats(latencies),
            }
            if mode == "session":
                time.sleep(2)  # let the warm pool settle before one-shot load
        result["engine_starts_per_second"] = engine_rate(seconds, clients)
        return result

    def memory(self) -> dict[str, Any]:
        def usage_mib(container: Any) -> float:
            stats = container.stats(stream=False)["memory_stats"]
            extra = stats.get("stats", {})
            cache = extra.get("inactive_file", extra.get("total_inactive_file", extra.get("cache", 0)))
            return float(stats["usage"] - cache) / (1024 * 1024)

        wait_until(lambda: len(self.pooled()) >= 1, 60)
        time.sleep(2)
        pooled = [usage_mib(c) for c in self.pooled()]
        n = MEMORY_SESSIONS
        before = self.service_kib()
        sids = [self.session() for _ in range(n)]
        try:
            for sid in sids:
                self.execute({"script": "print(1)", "session_id": sid})
            time.sleep(2)
            idle = self.service_kib()
            sandboxes = [self.api.get(f"/sessions/{sid}").json()["sandbox_id"] for sid in sids]
            session = statistics.median(usage_mib(self.engine.containers.get(s)) for s in sandboxes)
            sleeper = {"script": "import time; time.sleep(4)", "wait_s": 0}
            running = [self.api.post("/execute", json={**sleeper, "session_id": sid}).json()["job_id"] for sid in sids]
            time.sleep(2)
            busy = self.service_kib()
            for job_id in running:
                self.api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 30})
        finally:
            for sid in sids:
                self.api.delete(f"/sessions/{sid}")
        return {
            "idle_pooled_sandbox_mib": statistics.median(pooled),
            "idle_session_mib": session,
            "service_rss_mib": before / 1024,
            "service_kib_per_idle_session": (idle - before) / n,
            "service_kib_per_running_job": (busy - idle) / n,
        }

    def service_kib(self) -> float:
        """The service process's resident memory (``VmRSS``, KiB), after a pause for the collector."""
        time.sleep(0.5)
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1])
        raise RuntimeError("no VmRSS")

    def pooled(self) -> list[Any]:
        return [
            c
            for c in labelled_containers(self.engine, self.instance, include_pool=True)
            if LABEL_JOB not in c.labels and c.status == "running" and LABEL_POOL in c.labels
        ]


def server_timing(value: str) -> dict[str, float]:
    """``Server-Timing`` entries (``observability.stages``) as name -> ms, in order; ``origin`` -> its ns (``desc``)."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, raw = param.partition("=")
            if key == "dur" or (name == "origin" and key == "desc"):
                out[name] = float(raw.strip('"'))
    return out


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per stage, the median over ``runs`` (a stage missing from a run counts 0 there), in first-seen order."""
    names = list(dict.fromkeys(name for run in runs for name in run))
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


Target = tuple[str, Callable[[dict[str, Any]], float], str, str, float]
TARGETS: tuple[
    Target, ...
] = (  # issue 18's, on the 2-core machine: (what, measured (results -> value), unit, comparison, target)
    ("`print(1)` in a session, p50", lambda r: r["print1"]["session"]["median"], "ms", "<=", 5.0),
    ("`print(1)` in a session, p99", lambda r: r["print1"]["session"]["p99"], "ms", "<=", 10.0),
    ("`print(1)` from the warm pool, p50", lambda r: r["print1"]["warm_pool"]["median"], "ms", "<=", 10.0),
    (
        "one echo call round trip in a script, p50",
        lambda r: r["tool_calls"]["round_trip_ms"]["median"],
        "ms",
        "<=",
        0.2,
    ),
    ("1,000 concurrent echo calls, wall p50", lambda r: r["tool_calls"]["fanout_wall_ms"]["median"], "ms", "<=", 100.0),
    ("sessions sustained, 8 clients", lambda r: r["sustained"]["session"]["per_second"], "runs/s", ">=", 400.0),
    ("sessions sustained: errors", lambda r: r["sustained"]["session"]["errors"], "", "<=", 0),
    (
        "one-shot sustained / engine's start rate",
        lambda r: 100 * r["sustained"]["one_shot"]["per_second"] / r["sustained"]["engine_starts_per_second"],
        "%",
        ">=",
        95.0,
    ),
)


def targets(results: dict[str, Any]) -> list[str]:
    """The targets table: each target beside what this run measured, and whether it is met."""
    rows = ["| target | measured | goal | met |", "| --- | ---: | ---: | :---: |"]
    for what, measured, unit, op, goal in TARGETS:
        value = float(measured(results))
        met = value <= goal if op == "<=" else value >= goal
        rows.append(f"| {what} | {value:.2f} {unit} | {op} {goal:g} {unit} | {'yes' if met else 'no'} |")
    return rows


def breakdown_rows(results: dict[str, Any]) -> list[str]:
    """The per-stage tables (medians, ms; each stage is the time since the one before it)."""
    b = results["breakdown"]
    rows = ["| stage (`print(1)`, median ms) | in a session | from the warm pool |", "| --- | ---: | ---: |"]
    for name in dict.fromkeys([*b["session"], *b["warm_pool"]]):
        cells = [f"{b[k][name]:.3f}" if name in b[k] else "" for k in ("session", "warm_pool")]
        rows.append(f"| {name} | {cells[0]} | {cells[1]} |")
    rows += ["", "| stage (one echo call, mean ms over the calls) | ms |", "| --- | ---: |"]
    rows += [f"| {name} | {ms:.4f} |" for name, ms in b["tool_call"].items()]
    return rows


def markdown(results: dict[str, Any]) -> str:
    p = results["print1"]
    t = results["tool_calls"]
    s = results["sustained"]
    m = results["memory"]

    def line(name: str, st: dict[str, float]) -> str:
        return f"| {name} | {st['median']:.1f} | {st['p90']:.1f} | {st['p99']:.1f} | {st['n']} |"

    rows = [
        f"Measured {results['date']} on {results['machine']} (`deploy/local.sh bench`).",
        "",
        "| `print(1)`, ms per run | median | p90 | p99 | n |",
        "| --- | ---: | ---: | ---: | ---: |",
        line("`POST /execute` in a session", p["session"]),
        line("`POST /execute` from the warm pool", p["warm_pool"]),
        line("`POST /execute` cold", p["cold"]),
        line("`docker run --rm --network none` (same image)", p["docker_run_rm"]),
        line("bare `/usr/bin/python3 -c 'print(1)'`", p["bare_python"]),
        "",
        "Noise: the medians of the session runs' three thirds, in order: "
        + ", ".join(f"{m:.1f}" for m in p["session_thirds_medians"])
        + " ms.",
        "",
        "| tools | median | p90 | p99 | n |",
        "| --- | ---: | ---: | ---: | ---: |",
        line("echo call round trip in a script (ms, 1,000 sequential)", t["round_trip_ms"]),
        line(f"fan-out of {t['fanout_calls']:,} concurrent echo calls (ms wall)", t["fanout_wall_ms"]),
        "",
        f"| sustained, {s['clients']} clients, {s['seconds']:g} s | runs/s | errors | median ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, name in (("session", "in sessions"), ("one_shot", "one-shot (pool, then cold)")):
        r = s[key]
        rows.append(
            f"| {name} | {r['per_second']:.1f} | {r['errors']} | {r['latency_ms']['median']:.1f} "
            f"| {r['latency_ms']['p99']:.1f} |"
        )
    rows += [
        f"| engine's own container starts (`python3 -c pass`) | {s['engine_starts_per_second']:.1f} | | | |",
        "",
        f"Memory: idle pooled sandbox {m['idle_pooled_sandbox_mib']:.1f} MiB, "
        f"idle session {m['idle_session_mib']:.1f} MiB (engine stats, usage minus page cache); the service "
        f"process {m['service_rss_mib']:.0f} MiB resident, {m['service_kib_per_idle_session']:.0f} KiB more per "
        f"idle session and {m['service_kib_per_running_job']:.0f} KiB more per running job "
        f"({MEMORY_SESSIONS} of each, default limits; VmRSS).",
        "",
        *breakdown_rows(results),
        "",
        *targets(results),
    ]
    return "\n".join(rows) + "\n"


def machine() -> str:
    cpus = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()} Linux {platform.release()}, {cpus} CPUs, {mem:.0f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few samples and a 5 s sustained run (a smoke check)")
    parser.add_argument("--sustain-s", type=float, default=30.0, help="seconds of each sustained run (default 30)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for bench.json and bench.md")
    args = parser.parse_args()
    quick = args.quick
    scratch = Path(tempfile.mkdtemp(prefix="ptcb", dir="/tmp"))
    instance = f"bench-{secrets.token_hex(4)}"
    service = start_service(  # one warm pool (the default profile's): the "cold" requests' profile stays cold
        instance,
        scratch / "svc",
        PTC_LOG_LEVEL="warning",
        PTC_ADMIN_KEYS="pytest",  # its key may ask for the per-stage timing (X-PTC-Stages)
        PTC_MAX_QUEUE="1000",
        PTC_WARM_POOL_MAX_PROFILES="1",
        # The benchmark is one key standing for every client: its quotas are the service's own limits (the
        # defaults give one key half the slots, a quarter of the sessions' CPUs and 600 jobs a minute).
        PTC_QUOTA_RUNNING_JOBS="1000",
        PTC_QUOTA_QUEUED_JOBS="1000",
        PTC_QUOTA_SESSIONS="32",
        PTC_QUOTA_SESSION_CPUS="1000",
        PTC_QUOTA_SESSION_MEMORY_MB="1000000",
        PTC_QUOTA_JOBS_PER_MINUTE="1000000",
    )
    engine = docker.from_env()
    try:
        with service.client(timeout=600) as api:
            bench = Bench(api, engine, instance, service.process.pid)
            results: dict[str, Any] = {
                "date": datetime.now(UTC).strftime("%Y-%m-%d"),
                "machine": machine(),
                "image": IMAGE,
            }
            results["print1"] = bench.print1(
                n_session=30 if quick else 300,
                n_warm=10 if quick else 60,
                n_cold=5 if quick else 30,
                n_docker=5 if quick else 20,
            )
            results["tool_calls"] = bench.tool_calls(1000, 1000, 3 if quick else 10)
            results["breakdown"] = bench.breakdown(
                n_session=30 if quick else 200, n_warm=5 if quick else 30, n_calls=200 if quick else 1000
            )
            results["memory"] = bench.memory()
            results["sustained"] = bench.sustained(5 if quick else args.sustain_s, 8)
    finally:
        service.stop()
        for c in engine.containers.list(all=True, filters={"label": "bench=1"}):
            c.remove(force=True)
        shutil.rmtree(scratch, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "bench.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
