"""BFCL v4 scripts corrupted the way models corrupted theirs are recovered exactly, through ``POST /execute``.

For every entry of ``simple_python``, ``parallel`` and ``multiple`` (``tests.bfcl_corruption``): its multi-line
ground-truth script, and that script on one line with ``\\n`` and ``\\t`` escapes for its line breaks and indents.
The clean scripts run in batches (one job per :data:`BATCH_CASES` entries, each script after a ``bfcl_case`` marker
call, so the records split per entry); each corrupted script runs as its own job, :data:`PARALLEL_REQUESTS` at a
time. Every corrupted job must succeed, report the repair, print what its clean script printed and leave exactly the
same call records (tool, arguments, status, result, error).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Final

import httpx

from tests.bfcl_corruption import (
    clean_run,
    corrupted_run,
    recovery_problem,
)
from tests.bfcl_data import GroundTruthCase, pack_batches
from tests.unit.test_normalize_bfcl import cases  # noqa: F401

BATCH_CASES: Final = 100


PARALLEL_REQUESTS: Final = 8  # twice the service's sandbox slots on 2 cores: the queue never runs dry


def test_every_corrupted_script_gives_the_clean_call_records(api: httpx.Client, cases: list[GroundTruthCase]) -> None:
    assert len(cases) == 800
    with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
        clean: dict[str, tuple[list[dict[str, Any]], str]] = {}
        for found in pool.map(partial(clean_run, api), pack_batches(cases, BATCH_CASES)):
            clean.update(found)
        views = dict(zip((c.id for c in cases), pool.map(partial(corrupted_run, api), cases), strict=True))
    problems = {}
    for case in cases:
        if (why := recovery_problem(case, views[case.id], clean[case.id])) is not None:
            problems[case.id] = why
    assert not problems, f"{len(problems)} of {len(cases)}:\n" + "\n".join(f"{k}: {v}" for k, v in problems.items())
