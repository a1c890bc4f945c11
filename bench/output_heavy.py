"""Issue 12, item 1, measured: what live output costs an output-heavy script.

``python -m bench.output_heavy [--before IMAGE] [--after IMAGE] [--runs 5] [--runtime runsc] [--out FILE]``
starts one service per sandbox image (``--before``: default ``ptc-sandbox-runtime:latest``; ``--after``:
default ``$PTC_SANDBOX_IMAGE``), opens a session in each, and runs each script ``--runs`` times in both,
alternating between them so that the load of this shared machine falls on both alike (plus one untimed
warm-up run each). Per script and image it reports the median of:

- ``http_ms``: the ``POST /execute`` round trip (the script's run plus its output reaching the service);
- ``script_ms``: the script's own time (``time.perf_counter`` around its loop, written to stderr at the end);

and checks that every byte arrived (``stdout_bytes``). The scripts: 100,000 ``print(i)`` calls (~590 KB),
100,000 ``print`` calls of 99 characters (10 MB), one ``sys.stdout.write`` of 10 MB, and as the reference the
100,000 ``print(i)`` into a block-buffered stream of the script's own on fd 1 (the cost without liveness).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Service, start_service

TIMED = (
    "import sys, time\nt = time.perf_counter()\n{body}\n"
    "sys.stderr.write('%.3f\\n' % ((time.perf_counter() - t) * 1000))\n"
)
SCRIPTS = {
    "print_100k": ("for i in range(100_000):\n    print(i)", sum(len(str(i)) + 1 for i in range(100_000))),
    "print_10mb": ("for i in range(100_000):\n    print('x' * 99)", 100_000 * 100),
    "write_10mb": ("sys.stdout.write('x' * 10_000_000)", 10_000_000),
    # the reference: the same prints block-buffered to the pipe (Python's default for a pipe, lost at a kill)
    "print_100k_block_buffered": (
        "import io\nsys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, 'w', closefd=False)), 'utf-8')\n"
        "for i in range(100_000):\n    print(i)\nsys.stdout.flush()",
        sum(len(str(i)) + 1 for i in range(100_000)),
    ),
}


def run_once(api: httpx.Client, session_id: str, name: str) -> tuple[float, float]:
    """(round trip ms, script ms) of one run of script ``name`` in the session; raises when output went missing."""
    body, expected = SCRIPTS[name]
    started = time.perf_counter()
    response = api.post(
        "/execute",
        json={"script": TIMED.format(body=body), "session_id": session_id, "timeout_s": 120, "wait_s": 120},
    )
    http_ms = (time.perf_counter() - started) * 1000
    response.raise_for_status()
    view = response.json()
    if view["status"] != "succeeded" or view["stdout_bytes"] != expected:
        raise RuntimeError(f"{name}: {view['status']}, {view['stdout_bytes']} of {expected} bytes: {view['error']}")
    return http_ms, float(view["stderr"].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="ptc-sandbox-runtime:latest")
    parser.add_argument("--after", default=os.environ.get("PTC_SANDBOX_IMAGE", "ptc-sandbox-runtime:latest"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--runtime", default=None, help="OCI runtime of the sandboxes (PTC_RUNTIME), e.g. runsc")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptc-output-bench-"))
    images = {"before": args.before, "after": args.after}
    services: dict[str, Service] = {}
    clients: dict[str, httpx.Client] = {}
    sessions: dict[str, str] = {}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        label: {name: {"http_ms": [], "script_ms": []} for name in SCRIPTS} for label in images
    }
    try:
        for label, image in images.items():
            services[label] = start_service(
                f"bench-output-{label}-{secrets.token_hex(4)}",
                scratch / label,
                PTC_SANDBOX_IMAGE=image,
                **({"PTC_RUNTIME": args.runtime} if args.runtime else {}),
            )
            clients[label] = services[label].client(timeout=300)
            created = clients[label].post("/sessions", json={})
            created.raise_for_status()
            sessions[label] = created.json()["session_id"]
        for name in SCRIPTS:
            for label in images:
                run_once(clients[label], sessions[label], name)  # warm-up
            for _ in range(args.runs):
                for label in images:
                    http_ms, script_ms = run_once(clients[label], sessions[label], name)
                    samples[label][name]["http_ms"].append(http_ms)
                    samples[label][name]["script_ms"].append(script_ms)
    finally:
        for client in clients.values():
            client.close()
        for service in services.values():
            service.stop()
    result: dict[str, Any] = {
        "images": images,
        "runtime": args.runtime,
        "runs": args.runs,
        "medians": {},
        "samples": samples,
    }
    print(f"| script | before http ms | after http ms | before script ms | after script ms |  (median of {args.runs})")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in SCRIPTS:
        medians = {label: {k: statistics.median(v) for k, v in samples[label][name].items()} for label in images}
        result["medians"][name] = medians
        b, a = medians["before"], medians["after"]
        print(f"| {name} | {b['http_ms']:.0f} | {a['http_ms']:.0f} | {b['script_ms']:.0f} | {a['script_ms']:.0f} |")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
