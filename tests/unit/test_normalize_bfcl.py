"""BFCL v4 scripts corrupted the way models corrupted theirs are recovered exactly, through ``POST /execute``.

For every entry of ``simple_python``, ``parallel`` and ``multiple`` (``tests.bfcl_corruption``): its multi-line
ground-truth script, and that script on one line with ``\\n`` and ``\\t`` escapes for its line breaks and indents.
The clean scripts run in batches (one job per :data:`BATCH_CASES` entries, each script after a ``bfcl_case`` marker
call, so the records split per entry); each corrupted script runs as its own job, :data:`PARALLEL_REQUESTS` at a
time. Every corrupted job must succeed, report the repair, print what its clean script printed and leave exactly the
same call records (tool, arguments, status, result, error).
"""

from __future__ import annotations

import pytest

from service.normalize import normalize
from tests.bfcl_corruption import (
    CORRUPTION_CATEGORIES,
    bytecode,
    corrupt,
    ground_truth_script,
)
from tests.bfcl_data import GroundTruthCase, load_ground_truth
from tests.conftest import missing


@pytest.fixture(scope="module")
def cases() -> list[GroundTruthCase]:
    try:
        return [case for category in CORRUPTION_CATEGORIES for case in load_ground_truth(category)]
    except RuntimeError as exc:
        missing(str(exc), xfail=True)


def test_every_corrupted_script_normalizes_to_its_clean_program(cases: list[GroundTruthCase]) -> None:
    wrong = []
    for case in cases:
        clean = ground_truth_script(case)
        assert normalize(clean).script is clean, case.id
        result = normalize(corrupt(clean))
        if [r.kind for r in result.repairs] != ["literal_escapes"] or bytecode(result.script) != bytecode(clean):
            wrong.append(case.id)
    assert not wrong, f"{len(wrong)} of {len(cases)} not recovered: {wrong[:20]}"
