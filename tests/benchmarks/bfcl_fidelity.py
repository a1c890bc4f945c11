"""Benchmark (not a test): fidelity of BFCL v4 ground-truth replay through ``POST /execute``, per category.

    .venv/bin/python -m tests.benchmarks.bfcl_fidelity [--per-entry] [--jobs 4] [--batch 100] [--url URL]

Without ``--url`` it starts its own service (instance ``bench-*``, scratch work dir). Every entry of
``tests.bfcl_data.GROUND_TRUTH_CATEGORIES`` (``bfcl-eval`` must be installed) has its ground truth resolved to concrete
calls (``load_ground_truth``) and made by a script, as a model would write it, against echo tools built from its
function docs. By default entries are batched: up to ``--batch`` entries per job, whose docs agree per name, with a
``bfcl_case(id=...)`` marker call before each entry's calls (``tests.bfcl_data.pack_batches``); with ``--per-entry``
each entry is one job with exactly its own manifest. ``--jobs`` jobs run at a time.

Each entry is judged from its call records (``tests.bfcl_data.classify_replay``): ``exact`` (the recorded
``(tool, args)`` sequence is the ground truth's and every call ``ok``), ``rejected`` (the same sequence, but the
broker refused calls with ``invalid_arguments``: the ground truth contradicts its own schema) or ``other``. Prints
per category the entries, each count, and the fidelity: the share of entries whose recorded calls are the ground
truth's exactly, i.e. ``exact`` and ``rejected``; then the ``other`` ids, the rejected ids with the broker's message,
and the wall-clock time.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from tests.bfcl_data import (
    GROUND_TRUTH_CATEGORIES,
    GroundTruthCase,
    ReplayOutcome,
    classify_replay,
    load_ground_truth,
    pack_batches,
    replay_manifest,
    replay_script,
    split_records,
)
from tests.conftest import auth_headers, start_service

JOB_TIMEOUT_S = 300


def run_job(api: httpx.Client, script: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """POST /execute and wait for the job's final view (``202`` answers are waited for)."""
    body = {"script": script, "tools": tools, "timeout_s": JOB_TIMEOUT_S, "wait_s": JOB_TIMEOUT_S}
    response = api.post("/execute", json=body)
    response.raise_for_status()
    view: dict[str, Any] = response.json()
    while view["status"] in ("queued", "running"):
        view = api.post(f"/jobs/{view['job_id']}/wait", params={"timeout_s": JOB_TIMEOUT_S}).raise_for_status().json()
    return view


def replay(api: httpx.Client, batch: list[GroundTruthCase], marker: bool) -> dict[str, ReplayOutcome]:
    """Replay ``batch`` as one job; each entry's outcome by id (``other`` for all if the job itself failed)."""
    view = run_job(api, replay_script(batch, marker), replay_manifest(batch, marker))
    if view["status"] != "succeeded" or view["calls_over_limit"]:
        failed = ReplayOutcome("other", f"job {view['job_id']}: {view['status']} {view['error']}")
        return {case.id: failed for case in batch}
    try:
        records = split_records(view["calls"], batch) if marker else {batch[0].id: view["calls"]}
    except ValueError as exc:
        return {case.id: ReplayOutcome("other", f"job {view['job_id']}: {exc}") for case in batch}
    return {case.id: classify_replay(case, records[case.id]) for case in batch}


@contextmanager
def service_url(url: str | None) -> Iterator[tuple[str, dict[str, str]]]:
    """``url`` (API key from ``PTC_TOKEN``), or the URL of a service started for the run (stopped and its scratch
    dir removed afterwards); with the headers that authenticate to it."""
    if url:
        yield url, auth_headers(None)
        return
    scratch = Path(tempfile.mkdtemp(prefix="ptcb", dir="/tmp"))
    service = start_service(f"bench-{secrets.token_hex(4)}", scratch / "svc")
    try:
        yield service.url, service.headers
    finally:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def report(cases: list[GroundTruthCase], outcomes: dict[str, ReplayOutcome]) -> list[str]:
    """The table (one row per category and a total), then the ``other`` and ``rejected`` entries."""
    header = f"{'category':<24} {'entries':>7} {'exact':>7} {'rejected':>8} {'other':>7} {'fidelity':>9}"
    lines = [header, "-" * len(header)]
    for category in (*GROUND_TRUTH_CATEGORIES, "total"):
        chosen = [c for c in cases if category in (c.category, "total")]
        kinds = Counter(outcomes[c.id].kind for c in chosen)
        faithful = kinds["exact"] + kinds["rejected"]
        if category == "total":
            lines.append("-" * len(header))
        lines.append(
            f"{category:<24} {len(chosen):>7} {kinds['exact']:>7} {kinds['rejected']:>8} {kinds['other']:>7}"
            f" {100 * faithful / max(1, len(chosen)):>8.2f}%"
        )
    for kind in ("other", "rejected"):
        listed = [c for c in cases if outcomes[c.id].kind == kind]
        lines.append(f"\n{kind} ({len(listed)}):" + ("" if listed else " none"))
        lines += [f"  {c.id}: {outcomes[c.id].detail[:300]}" for c in listed]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-entry", action="store_true", help="one job per entry, with only its own manifest")
    parser.add_argument("--jobs", type=int, default=4, help="jobs at a time (default 4: 2 x CPUs on 2 cores)")
    parser.add_argument("--batch", type=int, default=100, help="entries per job when batched (default 100)")
    parser.add_argument("--url", help="an already running service; default: start one")
    args = parser.parse_args()
    cases = [case for category in GROUND_TRUTH_CATEGORIES for case in load_ground_truth(category)]
    batches = [[case] for case in cases] if args.per_entry else pack_batches(cases, args.batch)
    outcomes: dict[str, ReplayOutcome] = {}
    with (
        service_url(args.url) as (url, headers),
        httpx.Client(base_url=url, timeout=JOB_TIMEOUT_S + 30, headers=headers) as api,
    ):
        started = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            for found in pool.map(partial(replay, api, marker=not args.per_entry), batches):
                outcomes.update(found)
        elapsed = time.perf_counter() - started
    mode = "per entry" if args.per_entry else f"batched, up to {args.batch} entries per job"
    print(f"BFCL v4 ground-truth replay through POST /execute ({mode}; {len(batches)} jobs, {args.jobs} at a time)\n")
    print("\n".join(report(cases, outcomes)))
    print(f"\ntotal time: {elapsed:.1f} s for {len(cases)} entries, {sum(len(c.calls) for c in cases)} calls")


if __name__ == "__main__":
    main()
