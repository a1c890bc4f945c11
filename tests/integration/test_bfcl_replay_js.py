"""BFCL v4 ground truth replayed as JavaScript: the same call records as the Python replay.

Every entry of ``tests.bfcl_data.GROUND_TRUTH_CATEGORIES`` (2,351) is replayed as a JavaScript module on the node
image, twice: one ``await`` per call, then one ``await Promise.all([...])`` per entry.  Batched as
``tests/integration/test_bfcl_replay.py`` does (``pack_batches``, one job per batch, a ``bfcl_case`` marker call per
entry, :data:`PARALLEL_JOBS` jobs at a time), and judged by the same expectations: each entry's records are its
ground truth, or for its ``SCHEMA_CONTRADICTIONS`` a refusal naming the argument.  The one difference is JSON's:
JavaScript sends a whole float such as ``4.0`` as ``4``, so the ground truth is compared as JavaScript sends it
(``tests.bfcl_data.as_sent_from_javascript``), i.e. by value.

The 50 ``simple_javascript`` entries (``tests.bfcl_data.load_javascript_ground_truth``) are replayed as Python and as
JavaScript (both ways) and their records compared with each other, call by call (tool, arguments by value, status,
error), besides being judged against the ground truth with :data:`JAVASCRIPT_CONTRADICTIONS`.  Integers cross
exactly (a BigInt past ``Number.MAX_SAFE_INTEGER``); a number literal past it is rounded before it is sent.

One service of its own, offering the node image (``sandbox_image/build.sh --node``), under runc only.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Final

import docker
import httpx
import pytest

from tests.bfcl_data import (
    MAX_SAFE_INTEGER,
    GroundTruthCase,
    as_sent_from_javascript,
    classify_replay,
    javascript_expectation,
    js_replay_script,
    load_javascript_ground_truth,
    pack_batches,
    replay_manifest,
    replay_script,
    split_records,
)
from tests.conftest import Service, execute, missing, require_runtime, start_service, stop_clean
from tests.integration.test_bfcl_replay import PARALLEL_JOBS, SCHEMA_CONTRADICTIONS, problem
from tests.integration.test_javascript import node_images
from tests.unit.test_bfcl_replay import BATCH_CASES, cases  # noqa: F401

JAVASCRIPT_CONTRADICTIONS: Final[dict[str, tuple[str, str]]] = {
    "simple_javascript_5": ("store", "manageReactState: variable names for the 'dict's store.initialState, .reducers"),
    "simple_javascript_9": ("jsonPayload", "validateApiResponse: the variable name 'responseData' for a 'dict'"),
    "simple_javascript_11": ("items", "prioritizeAndSort: the variable name 'myItemList' for an 'array'"),
    "simple_javascript_15": ("labels", "ChartSeriesGenerator: variable names for 'labels', 'data' and 'chartLayout'"),
    "simple_javascript_19": ("property", "configureShaderMaterial: variable names for 'property' and 'textures'"),
    "simple_javascript_32": ("queue", "pollQueue: the variable name 'fileWatchQueue' for an 'array'"),
    "simple_javascript_37": ("statements", "addInitializedPropertyStatements: 'shapeStatements' for an 'array'"),
    "simple_javascript_39": ("parameters", "maybeAddJsSyntheticRestParameter: 'funcParameters' for an 'array'"),
}
"""``simple_javascript`` entries whose ground truth passes a variable's name (a string) for an ``array`` or ``dict``
argument, or a property of one (see ``load_javascript_ground_truth``): refused, naming the argument given, by
JavaScript and Python alike."""

MODES: Final = {"await": False, "promise-all": True}  # test id -> js_replay_script(gather=...)


@pytest.fixture(scope="module")
def node_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service offering the node image (and the default one), its sandboxes under runc."""
    require_runtime(engine, "runc")
    svc = start_service(
        f"pytest-bfcl-js-{secrets.token_hex(3)}",
        scratch / "svc-bfcl-js",
        PTC_IMAGES=node_images(engine),
        PTC_RUNTIME="runc",
    )
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def node(node_service: Service) -> Iterator[httpx.Client]:
    with node_service.client() as client:
        yield client


@pytest.fixture(scope="module")
def js_cases() -> list[GroundTruthCase]:
    """The ``simple_javascript`` entries; xfails (says how to install it) without ``bfcl-eval``, fails under CI."""
    try:
        return load_javascript_ground_truth()
    except RuntimeError as exc:
        missing(str(exc), xfail=True)


def run_js(api: httpx.Client, script: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    return execute(api, script, tools, language="javascript", wait_s=120, timeout_s=120)


def failed(view: dict[str, Any]) -> str | None:
    """Why a batch job did not run through (its status, error and stderr's end), or None."""
    if view["status"] == "succeeded" and not view["calls_over_limit"]:
        return None
    return f"batch job {view['job_id']}: {view['status']} {view['error']} stderr: {view['stderr'][-600:]!r}"


def replay_batch(api: httpx.Client, gather: bool, batch: list[GroundTruthCase]) -> dict[str, str]:
    """Run one batch as one JavaScript job; the problems of its entries, by id (``problem`` of the Python replay)."""
    view = run_js(api, js_replay_script(batch, gather=gather), replay_manifest(batch))
    if (why := failed(view)) is not None:
        return {case.id: why for case in batch}
    found = {}
    for case_id, records in split_records(view["calls"], batch).items():
        case = next(c for c in batch if c.id == case_id)
        if (why := problem(javascript_expectation(case), records)) is not None:
            found[case_id] = why
    return found


@pytest.mark.parametrize("gather", MODES.values(), ids=MODES.keys())
def test_every_entry_replayed_as_javascript_gives_the_python_records(
    node: httpx.Client, cases: list[GroundTruthCase], gather: bool
) -> None:
    assert len({c.id for c in cases}) == len(cases) == 2351
    batches = pack_batches(cases, BATCH_CASES)
    with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
        found = {
            k: v for problems in pool.map(partial(replay_batch, node, gather), batches) for k, v in problems.items()
        }
    assert not found, f"{len(found)} of {len(cases)} entries: " + "\n".join(f"{k}: {v}" for k, v in found.items())
    assert set(SCHEMA_CONTRADICTIONS) <= {c.id for c in cases}


def javascript_problem(case: GroundTruthCase, records: list[dict[str, Any]]) -> str | None:
    """None when a ``simple_javascript`` entry's records are its ground truth (as JavaScript sends it), or for one of
    :data:`JAVASCRIPT_CONTRADICTIONS` a refusal naming its argument; else what is wrong."""
    outcome = classify_replay(javascript_expectation(case), records)
    if case.id not in JAVASCRIPT_CONTRADICTIONS:
        return None if outcome.kind == "exact" else f"{outcome.kind}: {outcome.detail}"
    argument, _ = JAVASCRIPT_CONTRADICTIONS[case.id]
    if outcome.kind != "rejected":
        return f"expected a refusal naming {argument!r}, got {outcome.kind}: {outcome.detail}"
    named = re.search(rf"'{re.escape(argument)}['.]", outcome.detail)
    return None if named else f"the refusal does not name {argument!r}: {outcome.detail}"


def by_value(records: list[dict[str, Any]]) -> list[str]:
    """Records as compared across languages: tool, arguments as JavaScript sends them, status and error (JSON)."""
    return [
        json.dumps([r["tool"], as_sent_from_javascript(r["args"]), r["status"], r["error"]], sort_keys=True)
        for r in records
    ]


def test_simple_javascript_entries_give_the_same_records_as_python(
    node: httpx.Client, js_cases: list[GroundTruthCase]
) -> None:
    assert len(js_cases) == 50
    found: dict[str, str] = {}
    for batch in pack_batches(js_cases, BATCH_CASES):
        manifest = replay_manifest(batch)
        python = execute(node, replay_script(batch), manifest, wait_s=120, timeout_s=120)
        assert failed(python) is None, failed(python)
        expected = split_records(python["calls"], batch)
        for mode, gather in MODES.items():
            view = run_js(node, js_replay_script(batch, gather=gather), manifest)
            assert failed(view) is None, failed(view)
            for case_id, records in split_records(view["calls"], batch).items():
                case = next(c for c in batch if c.id == case_id)
                if by_value(records) != by_value(expected[case_id]):
                    found[f"{case_id} ({mode})"] = (
                        f"JavaScript {by_value(records)}, Python {by_value(expected[case_id])}"
                    )
                elif (wrong := javascript_problem(case, records)) is not None:
                    found[f"{case_id} ({mode})"] = wrong
    assert not found, f"{len(found)} replays: " + "\n".join(f"{k}: {v}" for k, v in found.items())


NUMBERS_DOC: Final = {
    "name": "numbers",
    "parameters": {"type": "object", "properties": {}},
    "endpoint": {"kind": "echo"},
}


def test_numbers_keep_their_meaning_across_the_boundary(node: httpx.Client) -> None:
    """Integers past 2^53 - 1 arrive exactly (BigInt literals), whole floats as integers of the same value, other
    floats as the same double; a plain number literal past 2^53 - 1 is rounded in JavaScript before it is sent."""
    args = {
        "big": 2**64 + 1,
        "negative": -(2**63) - 3,
        "safe": MAX_SAFE_INTEGER,
        "past_safe": MAX_SAFE_INTEGER + 2,
        "whole": 2.0,
        "fraction": 0.1,
        "tiny": 5e-324,
        "huge": 1e21,
        "nested": [{"n": 12345678901234567890, "x": -0.0}],
    }
    case = GroundTruthCase(id="numbers", category="numbers", functions=[], calls=[("numbers", args)])
    python = execute(node, replay_script([case], marker=False), [NUMBERS_DOC])
    assert [json.dumps(c["args"], sort_keys=True) for c in python["calls"]] == [json.dumps(args, sort_keys=True)]
    for gather in MODES.values():
        view = run_js(node, js_replay_script([case], marker=False, gather=gather), [NUMBERS_DOC])
        assert view["status"] == "succeeded", view
        assert by_value(view["calls"]) == by_value(python["calls"])
        (recorded,) = [c["args"] for c in view["calls"]]
        assert recorded["big"] == 2**64 + 1 and recorded["nested"][0]["n"] == 12345678901234567890
        assert type(recorded["whole"]) is int and recorded["whole"] == 2  # JSON.stringify(2.0) is "2"
        assert type(recorded["huge"]) is float and recorded["fraction"] == 0.1 and recorded["tiny"] == 5e-324
    rounded = run_js(
        node, 'import tools from "tools";\nawait tools.numbers({n: 12345678901234567890});\n', [NUMBERS_DOC]
    )
    assert [c["args"] for c in rounded["calls"]] == [{"n": 12345678901234567000}]  # the double's shortest decimal
