"""BFCL v4 ground truth, replayed: a script making an entry's ground-truth calls gets exactly those recorded.

Every entry of ``tests.bfcl_data.GROUND_TRUTH_CATEGORIES`` (``simple_python``, ``multiple``, ``parallel``,
``parallel_multiple`` and their four ``live_*`` counterparts: 2,351 entries) is replayed through ``POST /execute``.
Fast path: entries are packed into batches of up to :data:`BATCH_CASES` whose function docs agree per name
(``tests.bfcl_data.pack_batches``); one job per batch, with the union of the docs as echo tools and a
``bfcl_case(id=...)`` marker call before each entry's calls so that the records split per entry; :data:`PARALLEL_JOBS`
jobs at a time. A sample of entries is also replayed alone, each with exactly its own manifest, as BFCL poses it.
"""

from __future__ import annotations

from typing import Any, Final

import pytest

from tests.bfcl_data import (
    CASE_MARKER,
    GROUND_TRUTH_CATEGORIES,
    GroundTruthCase,
    classify_replay,
    load_ground_truth,
    pack_batches,
    replay_manifest,
    split_records,
)
from tests.conftest import missing

BATCH_CASES: Final = 100  # entries per job: about 1 s of sandbox time each


@pytest.fixture(scope="module")
def cases() -> list[GroundTruthCase]:
    """Every entry of the eight categories; xfails (says how to install it) without ``bfcl-eval``, fails under CI."""
    try:
        return [case for category in GROUND_TRUTH_CATEGORIES for case in load_ground_truth(category)]
    except RuntimeError as exc:
        missing(str(exc), xfail=True)


def test_batches_share_no_name_with_two_docs(cases: list[GroundTruthCase]) -> None:
    batches = pack_batches(cases, BATCH_CASES)
    assert sorted(c.id for batch in batches for c in batch) == sorted(c.id for c in cases)
    assert all(len(batch) <= BATCH_CASES for batch in batches)
    for batch in batches:
        docs: dict[str, dict[str, Any]] = {}
        for case in batch:
            for doc in case.functions:
                assert docs.setdefault(doc["name"], doc) == doc, (case.id, doc["name"])
        assert len(replay_manifest(batch)) == len(docs) + 1  # the marker


def test_live_ground_truth_without_a_concrete_value_is_the_empty_value(cases: list[GroundTruthCase]) -> None:
    by_id = {case.id: case for case in cases}
    ((name, args),) = by_id["live_multiple_507-149-4"].calls  # "origin_airport": [""], required
    assert name == "Flights_4_SearchOnewayFlight" and args["origin_airport"] == ""
    ((name, args),) = by_id["live_simple_106-63-0"].calls  # "auto_loan_payment_start": [], required
    assert name == "record" and args["auto_loan_payment_start"] == [] and args["bank_hours_start"] == []
    ((name, args),) = by_id["live_multiple_862-181-3"].calls  # not in the schema, not optional: kept
    assert args["journey_start_time"] == "09:00"


def test_judging_is_strict_about_json_types_and_split_checks_markers() -> None:
    case = GroundTruthCase(id="t_0", category="t", functions=[], calls=[("f", {"a": 1, "b": True})])

    def record(seq: int, tool: str, args: dict[str, Any], status: str = "ok") -> dict[str, Any]:
        error = {"type": "invalid_arguments", "message": "f: argument 'a': ..."} if status == "rejected" else None
        return {"seq": seq, "tool": tool, "args": args, "status": status, "error": error}

    assert classify_replay(case, [record(1, "f", {"b": True, "a": 1})]).kind == "exact"
    assert classify_replay(case, [record(1, "f", {"a": 1.0, "b": True})]).kind == "other"
    assert classify_replay(case, [record(1, "f", {"a": 1, "b": 1})]).kind == "other"
    assert classify_replay(case, [record(1, "f", {"a": 1, "b": True}, "rejected")]).kind == "rejected"
    assert classify_replay(case, [record(1, "f", {"a": 1, "b": True}), record(2, "f", {})]).kind == "other"
    marked = [record(1, CASE_MARKER, {"id": "t_0"}), record(2, "f", {"a": 1, "b": True})]
    assert split_records(marked, [case]) == {"t_0": marked[1:]}
    with pytest.raises(ValueError, match="before the first marker"):
        split_records(marked[1:], [case])
    with pytest.raises(ValueError, match="no marker record for 1 cases"):
        split_records(marked, [case, GroundTruthCase(id="t_1", category="t", functions=[], calls=[])])
