"""Python beside JavaScript and TypeScript, in one run: what a script's language costs (not a test).

    .venv/bin/python -m bench.languages [--runs 100]

Starts its own service offering the sandbox image (Python) and the node image (``sandbox_image/build.sh --node``),
with a warm pool of 2 per image (each image's pool is made at its first use), and measures for each language, in
this order, interleaved per round so that the machine's drift falls on all alike (times in ms, HTTP round trip of
``POST /execute`` unless said otherwise):

- ``print(1)`` / ``console.log(1)`` in a session of that language, back to back (the three languages' runs
  interleaved), and after an untimed idle pause of 0.5 s (as between an agent's turns: the sandbox forks the next
  script's process ahead of its run, and for JavaScript that process is Node.js started and waiting, which takes
  longer than one back-to-back round);
- the same, one-shot, from the warm pool (an untimed pause of 0.5 s before each lets the pool refill);
- one echo tool call's round trip inside the script: each of ``--calls`` sequential calls timed in the sandbox
  (``time.perf_counter`` in Python, ``performance.now()`` in JavaScript), the median of all.

Prints one table (median and p90 per figure); ``docs/performance.md`` quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.__main__ import stats
from tests.conftest import IMAGE, start_service

NODE_IMAGE = os.environ.get("PTC_NODE_IMAGE", "ptc-sandbox-node:latest")
ECHO = [{"name": "echo", "parameters": {"properties": {"i": {"type": "integer"}}}, "endpoint": {"kind": "echo"}}]
PRINT = {"python": "print(1)", "javascript": "console.log(1)", "typescript": "const one: number = 1;\nconsole.log(one)"}
CALLS = {
    "python": """import json, time, tools
samples = []
for i in range({n}):
    began = time.perf_counter()
    tools.echo(i=i)
    samples.append((time.perf_counter() - began) * 1000)
print(json.dumps(samples))
""",
    "javascript": """const samples = [];
for (let i = 0; i < {n}; i++) {
  const began = performance.now();
  await tools.echo({ i });
  samples.push(performance.now() - began);
}
console.log(JSON.stringify(samples));
""",
}
LANGUAGES = ("python", "javascript", "typescript")


def timed_execute(api: httpx.Client, body: dict[str, Any]) -> float:
    """One ``POST /execute`` of ``body``; its round trip (ms). Raises RuntimeError unless it printed 1."""
    began = time.perf_counter()
    view = api.post("/execute", json=body).json()
    elapsed = (time.perf_counter() - began) * 1000
    if view.get("stdout") != "1\n":
        raise RuntimeError(f"{body}: {view}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="timed runs per figure and language (default 100)")
    parser.add_argument("--calls", type=int, default=500, help="sequential echo calls timed in the script")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptcl", dir="/tmp"))
    service = start_service(
        f"lang-{secrets.token_hex(4)}",
        scratch / "svc",
        PTC_IMAGES=f"default={IMAGE},node={NODE_IMAGE}",
        PTC_LOG_LEVEL="warning",
        PTC_WARM_POOL_SIZE="2",
        PTC_QUOTA_JOBS_PER_MINUTE="100000",
    )
    figures: dict[str, dict[str, list[float]]] = {lang: {"session": [], "idle": [], "warm": []} for lang in LANGUAGES}
    try:
        with service.client(timeout=120) as api:
            sessions = {lang: api.post("/sessions", json={"language": lang}).json()["session_id"] for lang in LANGUAGES}
            for lang in LANGUAGES:  # warm up: each session's first run, each image's pool made
                timed_execute(api, {"script": PRINT[lang], "language": lang, "session_id": sessions[lang]})
                timed_execute(api, {"script": PRINT[lang], "language": lang})
            for _ in range(args.runs):
                for lang in LANGUAGES:
                    body = {"script": PRINT[lang], "language": lang, "session_id": sessions[lang]}
                    figures[lang]["session"].append(timed_execute(api, body))
            for _ in range(args.runs):
                for lang in LANGUAGES:
                    time.sleep(0.5)  # idle, as between an agent's turns
                    body = {"script": PRINT[lang], "language": lang, "session_id": sessions[lang]}
                    figures[lang]["idle"].append(timed_execute(api, body))
            for _ in range(args.runs):
                for lang in LANGUAGES:
                    time.sleep(0.5)  # the pools refill
                    figures[lang]["warm"].append(timed_execute(api, {"script": PRINT[lang], "language": lang}))
            calls: dict[str, list[float]] = {}
            for lang, source in CALLS.items():
                body = {"script": source.replace("{n}", str(args.calls)), "language": lang, "tools": ECHO}
                view = api.post("/execute", json={**body, "timeout_s": 120}).json()
                calls[lang] = [float(x) for x in json.loads(view["stdout"])]
            for sid in sessions.values():
                api.delete(f"/sessions/{sid}")
    finally:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'figure (ms)':60} " + "  ".join(f"{lang:>22}" for lang in LANGUAGES))
    rows = (
        ("session", "print / console.log in a session, back to back"),
        ("idle", "print / console.log in a session, after 0.5 s idle"),
        ("warm", "print / console.log, warm pool"),
    )
    for key, label in rows:
        cells = []
        for lang in LANGUAGES:
            st = stats(figures[lang][key])
            cells.append(f"{st['median']:8.1f} (p90 {st['p90']:7.1f})")
        print(f"{label + ', median (p90)':60} " + "  ".join(f"{c:>22}" for c in cells))
    cells = []
    for lang in LANGUAGES:
        st = stats(calls.get(lang) or calls["javascript"])
        cells.append(f"{st['median']:8.3f} (p90 {st['p90']:7.3f})")
    print(f"{'echo call round trip in the script, median (p90)':60} " + "  ".join(f"{c:>22}" for c in cells[:2]))


if __name__ == "__main__":
    main()
