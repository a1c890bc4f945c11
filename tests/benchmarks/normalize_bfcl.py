"""Benchmark (not a test): how many BFCL v4 scripts corrupted the way models corrupt them normalization recovers.

    .venv/bin/python -m tests.benchmarks.normalize_bfcl [--offline] [--jobs 8] [--url URL]

For every entry of ``tests.bfcl_data.GROUND_TRUTH_CATEGORIES`` (``bfcl-eval`` must be installed) the multi-line
ground-truth script of ``tests.bfcl_corruption.ground_truth_script`` is written in damaged forms, and each is passed
through ``service.normalize.normalize`` (in this process): ``escaped`` (the research's corruption: on one line, each
line break as the two characters ``\\n``, each indent as ``\\t``), ``fenced`` (in a Markdown block with prose around
it), ``fenced+escaped``, ``python -c`` (``python3 -c '<script>'``, quoted with ``shlex.quote``) and ``heredoc``
(``python3 - <<'EOF'``). Recovered = normalized to a script with the clean script's bytecode. Also counted: clean
(valid) scripts normalization changed, which must be 0.

Then, unless ``--offline``, the ``escaped`` form of every entry of ``tests.bfcl_corruption.CORRUPTION_CATEGORIES``
runs through ``POST /execute`` (one job per entry, ``--jobs`` at a time; the clean scripts batched, 100 entries per
job): recovered = the job succeeded, reported the repair and left exactly the clean script's call records and output.
Without ``--url`` it starts its own service (instance ``bench-*``, scratch work dir).
"""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx

from service.normalize import normalize
from tests.benchmarks.bfcl_fidelity import service_url
from tests.bfcl_corruption import (
    CORRUPTION_CATEGORIES,
    JOB_TIMEOUT_S,
    bytecode,
    clean_run,
    corrupt,
    corrupted_run,
    ground_truth_script,
    recovery_problem,
)
from tests.bfcl_data import GROUND_TRUTH_CATEGORIES, GroundTruthCase, load_ground_truth, pack_batches


def _fenced(script: str) -> str:
    return f"Here is the script:\n\n```python\n{script}```\n\nIt prints what the calls returned."


FORMS: dict[str, Callable[[str], str]] = {
    "escaped": corrupt,
    "fenced": _fenced,
    "fenced+escaped": lambda s: corrupt(_fenced(s)),
    "python -c": lambda s: f"python3 -c {shlex.quote(s)}",
    "heredoc": lambda s: f"python3 - <<'EOF'\n{s}EOF\n",
}


def offline(cases: list[GroundTruthCase]) -> list[str]:
    """Recovered fraction per category and form (in this process), and the valid scripts normalization changed."""
    recovered: dict[tuple[str, str], list[int]] = {}
    changed: list[str] = []
    for case in cases:
        clean = ground_truth_script(case)
        if normalize(clean).script is not clean:
            changed.append(case.id)
        program = bytecode(clean)
        for form, damage in FORMS.items():
            result = normalize(damage(clean))
            counts = recovered.setdefault((case.category, form), [0, 0])
            counts[0] += result.changed and bytecode(result.script) == program
            counts[1] += 1
    header = f"{'category':<24}" + "".join(f"{form:>18}" for form in FORMS)
    lines = ["Recovered by normalize() (same bytecode as the clean script), per form:", header, "-" * len(header)]
    for category in (*GROUND_TRUTH_CATEGORIES, "total"):
        cells = []
        for form in FORMS:
            got = [recovered.get((c, form), [0, 0]) for c in GROUND_TRUTH_CATEGORIES if category in (c, "total")]
            done, total = sum(g[0] for g in got), sum(g[1] for g in got)
            cells.append(f"{done}/{total} {100 * done / max(1, total):5.1f}%" if total else "-")
        lines.append(f"{category:<24}" + "".join(f"{cell:>18}" for cell in cells))
    lines.append(f"\nvalid (clean) scripts normalization changed: {len(changed)} of {len(cases)} {changed[:10]}")
    return lines


def through_service(url: str | None, cases: list[GroundTruthCase], jobs: int) -> list[str]:
    """Recovered fraction per category of the escaped scripts run through POST /execute."""
    chosen = [c for c in cases if c.category in CORRUPTION_CATEGORIES]
    problems: dict[str, str | None] = {}
    with (
        service_url(url) as (base, headers),
        httpx.Client(base_url=base, headers=headers, timeout=JOB_TIMEOUT_S + 30) as api,
    ):
        started = time.perf_counter()
        with ThreadPoolExecutor(jobs) as pool:
            clean: dict[str, tuple[list[dict[str, Any]], str]] = {}
            for found in pool.map(partial(clean_run, api), pack_batches(chosen, 100)):
                clean.update(found)
            views = pool.map(partial(corrupted_run, api), chosen)
            for case, view in zip(chosen, views, strict=True):
                problems[case.id] = recovery_problem(case, view, clean[case.id])
        elapsed = time.perf_counter() - started
    lines = [f"\nThrough POST /execute (escaped form; one job per entry, {jobs} at a time):"]
    for category in (*CORRUPTION_CATEGORIES, "total"):
        ids = [c.id for c in chosen if category in (c.category, "total")]
        done = sum(problems[i] is None for i in ids)
        lines.append(f"{category:<24} {done:>4}/{len(ids):<4} {100 * done / max(1, len(ids)):6.2f}% recovered")
    failed = [f"  {i}: {why[:300]}" for i, why in problems.items() if why is not None]
    lines += [f"not recovered ({len(failed)}):" + ("" if failed else " none"), *failed]
    lines.append(f"time: {elapsed:.1f} s for {len(chosen)} corrupted and {len(chosen)} clean scripts")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", action="store_true", help="only normalize() in this process; no service")
    parser.add_argument("--jobs", type=int, default=8, help="requests at a time (default 8)")
    parser.add_argument("--url", help="an already running service; default: start one")
    args = parser.parse_args()
    cases = [case for category in GROUND_TRUTH_CATEGORIES for case in load_ground_truth(category)]
    print("\n".join(offline(cases)))
    if not args.offline:
        print("\n".join(through_service(args.url, cases, args.jobs)))


if __name__ == "__main__":
    main()
