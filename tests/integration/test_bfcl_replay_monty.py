"""BFCL v4 ground truth replayed under the Monty engine: the same scripts give the container engine's records.

Every entry of ``tests.bfcl_data.GROUND_TRUTH_CATEGORIES`` (2,351) is replayed with ``"engine": "monty"`` twice:
``sync``, the Python replay's own script (``tests.bfcl_data.replay_script``: one blocking call per ground-truth call,
in ``try`` / ``except tools.ToolError``), and ``gather``, the same calls through ``tools.aio`` with one
``asyncio.gather`` per entry (:func:`gather_replay_script`, the Python twin of the JavaScript replay's
``Promise.all``).  Each job's script and manifest are sent to the container engine too, and an entry's records
(tool, arguments, status, error type) must be the container's, record by record, and what the entry dictates
(``tests.integration.test_bfcl_replay.problem``: its ground truth, or a refusal naming its contradiction's argument).
Batched as the Python replay is (up to ``BATCH_CASES`` entries a job, a ``bfcl_case`` marker call before each entry,
:data:`PARALLEL_JOBS` jobs at a time), with two differences (:func:`pack_for_monty`): no batch offers a tool that
another entry's tool makes a namespace too (``law_case_search`` beside ``law_case_search.find_historical``: each
entry alone never has one it calls), and the entries Monty cannot run are replayed on their own:

* the ``SCHEMA_CONTRADICTIONS`` (17): their scripts catch the refusal with ``tools.ToolError``, which Monty has not
  (``service/engines/monty_run.py``).  Each is replayed alone: under Monty the job fails at the refusal with an
  ``AttributeError`` naming ``ToolError``, after recording the refusal exactly as the container does (naming the
  argument); the same script catching ``RuntimeError`` instead (Monty's spelling) gives the container's records;
* :data:`MODULE_NAMESPACES` (39): entries declaring tools under ``math.`` or ``random.``, a namespace the Monty
  interpreter keeps for its own modules.  Their job must fail with an error naming that namespace.

A tool that is also a namespace (two entries in one job, 12 such names) must fail naming the tool; and a sample of
entries is replayed alone, each with exactly its own manifest, as BFCL poses it.

One service of its own, offering both engines (the container engine, the default, under runc).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Final

import docker
import httpx
import pytest

from tests.bfcl_data import (
    CASE_MARKER,
    GROUND_TRUTH_CATEGORIES,
    GroundTruthCase,
    call_source,
    load_ground_truth,
    pack_batches,
    replay_manifest,
    replay_script,
    split_records,
)
from tests.conftest import Service, execute, missing, start_service, stop_clean
from tests.integration.test_bfcl_replay import PARALLEL_JOBS, SAMPLE_EVERY, SCHEMA_CONTRADICTIONS, problem
from tests.unit.test_bfcl_replay import BATCH_CASES, cases  # noqa: F401

TOOL_ERROR_CATCH: Final = "except tools.ToolError:"
MONTY_CATCH: Final = "except RuntimeError:"  # what a failed call raises under Monty (monty_run.py)

MODULE_NAMESPACES: Final[dict[str, tuple[str, ...]]] = {
    "math": (
        "simple_python_1", "simple_python_2", "simple_python_19", "simple_python_20", "simple_python_22",
        "simple_python_24", "simple_python_97", "simple_python_105", "multiple_1", "multiple_11", "multiple_34",
        "multiple_100", "multiple_101", "multiple_111", "multiple_124", "multiple_156", "multiple_193", "parallel_7",
        "parallel_10", "parallel_60", "parallel_61", "parallel_76", "parallel_77", "parallel_80", "parallel_144",
        "parallel_152", "parallel_183", "parallel_multiple_19", "parallel_multiple_59", "parallel_multiple_67",
        "parallel_multiple_84", "parallel_multiple_133", "parallel_multiple_134", "parallel_multiple_143",
        "parallel_multiple_155", "parallel_multiple_181",
    ),
    "random": ("simple_python_111", "multiple_191", "parallel_158"),
}  # fmt: skip
"""Entries declaring tools under a namespace that is one of the Monty interpreter's own modules (``math.factorial``,
``random.choice``; 36 + 3, of which 31 + 2 call one): Monty cannot offer ``tools.math`` (its ``ExternalModule``
refuses the name ``math``), so their jobs cannot run; each must fail with an error naming the namespace."""


def gather_replay_script(cases: list[GroundTruthCase], marker: bool = True) -> str:
    """The Python replay with one ``asyncio.gather`` per entry: each call through ``tools.aio`` (as
    ``tests.bfcl_data.call_source`` writes it), wrapped so that a refusal (``tools.ToolError``) does not stop the
    script and any other exception does; the marker (``tools.aio.bfcl_case``) awaited alone before them."""

    def aio(name: str, args: dict[str, Any]) -> str:
        return "tools.aio." + call_source(name, args).removeprefix("tools.")

    lines = ["import asyncio", "import tools", "", "", "async def refused(call):", "    try:", "        await call"]
    lines += [f"    {TOOL_ERROR_CATCH}", "        pass", "", "", "async def main():", "    pass"]
    for case in cases:
        if marker:
            lines.append(f"    await {aio(CASE_MARKER, {'id': case.id})}")
        if case.calls:
            lines += ["    await asyncio.gather(", *(f"        refused({aio(n, a)})," for n, a in case.calls), "    )"]
    return "\n".join([*lines, "", "", "asyncio.run(main())"]) + "\n"


MODES: Final[dict[str, Callable[..., str]]] = {"sync": replay_script, "gather": gather_replay_script}


def monty_spelling(script: str) -> str:
    """``script`` catching a refusal as Monty raises it (``RuntimeError``) rather than with ``tools.ToolError``."""
    assert TOOL_ERROR_CATCH in script
    return script.replace(TOOL_ERROR_CATCH, MONTY_CATCH)


def namespaces(names: set[str]) -> set[str]:
    """The dotted prefixes of ``names`` (``a`` and ``a.b`` for ``a.b.c``): the namespaces they make in ``tools``."""
    return {name.rsplit(".", depth)[0] for name in names for depth in range(1, name.count(".") + 1)}


def pack_for_monty(cases: list[GroundTruthCase], max_cases: int) -> list[list[GroundTruthCase]]:
    """``tests.bfcl_data.pack_batches``'s first fit, and no case joins a batch where one of its tool names is
    another entry's namespace or the reverse (Monty offers no tool that is also a namespace)."""
    batches: list[list[GroundTruthCase]] = []
    docs: list[dict[str, str]] = []  # per batch: name -> doc
    for case in cases:
        own = {doc["name"]: json.dumps(doc, sort_keys=True) for doc in case.functions}
        mine, theirs = set(own), namespaces(set(own))
        for batch, names in zip(batches, docs, strict=True):
            others = set(names) - mine
            if (
                len(batch) < max_cases
                and all(names.get(n, k) == k for n, k in own.items())
                and not mine & namespaces(others) - theirs
                and not others & theirs
            ):
                batch.append(case)
                names.update(own)
                break
        else:
            batches.append([case])
            docs.append(dict(own))
    return batches


def module_namespace(case: GroundTruthCase) -> str | None:
    """The Monty module a tool of ``case`` has for its namespace (``math``), if any."""
    return next((n for n in MODULE_NAMESPACES if any(d["name"].startswith(f"{n}.") for d in case.functions)), None)


@pytest.fixture(scope="module")
def monty_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    svc = start_service(f"pytest-bfcl-monty-{secrets.token_hex(3)}", scratch / "svc-bfcl-monty", PTC_RUNTIME="runc")
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def api(monty_service: Service) -> Iterator[httpx.Client]:
    with monty_service.client() as client:
        yield client


def run(api: httpx.Client, script: str, tools: list[dict[str, Any]], engine: str) -> dict[str, Any]:
    return execute(api, script, tools, engine=engine, wait_s=120, timeout_s=120)


def failed(view: dict[str, Any]) -> str | None:
    """Why a job did not run through (its engine, status, error and stderr's end), or None."""
    if view["status"] == "succeeded" and not view["calls_over_limit"]:
        return None
    return f"{view['engine']} job {view['job_id']}: {view['status']} {view['error']} stderr: {view['stderr'][-600:]!r}"


def keys(records: list[dict[str, Any]]) -> list[str]:
    """Records as compared across engines: tool, arguments (JSON: ``1`` is not ``1.0``), status, error type."""
    return [
        json.dumps([r["tool"], r["args"], r["status"], (r["error"] or {}).get("type")], sort_keys=True) for r in records
    ]


def calls_of(records: list[dict[str, Any]]) -> list[str]:
    """Records as calls made: tool and arguments (JSON)."""
    return [json.dumps([r["tool"], r["args"]], sort_keys=True) for r in records]


def compare(batch: list[GroundTruthCase], monty: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The problems of ``batch``'s entries (by id) in a Monty job's records beside the container job's."""
    if (why := failed(container)) is not None:
        return {case.id: f"the container reference failed: {why}" for case in batch}
    if (why := failed(monty)) is not None:
        return {case.id: why for case in batch}
    expected = split_records(container["calls"], batch)
    found = {}
    for case_id, records in split_records(monty["calls"], batch).items():
        case = next(c for c in batch if c.id == case_id)
        if keys(records) != keys(expected[case_id]):
            found[case_id] = f"monty {keys(records)}, container {keys(expected[case_id])}"
        elif (wrong := problem(case, records)) is not None:
            found[case_id] = wrong
    return found


def replay_batch(api: httpx.Client, mode: str, batch: list[GroundTruthCase]) -> dict[str, str]:
    """One batch as one job under each engine, the same script and manifest; the problems of its entries, by id."""
    script, manifest = MODES[mode](batch), replay_manifest(batch)
    return compare(batch, run(api, script, manifest, "monty"), run(api, script, manifest, "container"))


def runnable(cases: list[GroundTruthCase]) -> list[GroundTruthCase]:
    """The entries whose scripts use nothing Monty lacks."""
    return [c for c in cases if c.id not in SCHEMA_CONTRADICTIONS and module_namespace(c) is None]


def listing(found: dict[str, str], total: int) -> str:
    return f"{len(found)} of {total}: " + "\n".join(f"{k}: {v}" for k, v in found.items())


@pytest.mark.parametrize("mode", MODES)
def test_every_entry_gives_the_container_records_under_monty(
    api: httpx.Client, cases: list[GroundTruthCase], mode: str
) -> None:
    assert len({c.id for c in cases}) == len(cases) == 2351
    chosen = runnable(cases)
    lacking = {c.id for c in cases} - {c.id for c in chosen}
    assert lacking == set(SCHEMA_CONTRADICTIONS) | {i for ids in MODULE_NAMESPACES.values() for i in ids}
    assert {c.id: module_namespace(c) for c in cases if module_namespace(c)} == {
        i: n for n, ids in MODULE_NAMESPACES.items() for i in ids
    }
    batches = pack_for_monty(chosen, BATCH_CASES)
    with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
        found = {k: v for wrong in pool.map(partial(replay_batch, api, mode), batches) for k, v in wrong.items()}
    assert not found, listing(found, len(chosen))


def contradiction_problem(api: httpx.Client, mode: str, case: GroundTruthCase) -> str | None:
    """An entry of ``SCHEMA_CONTRADICTIONS`` alone: the container refuses naming its argument; Monty records the
    same up to the refusal and fails naming ``ToolError``; caught as ``RuntimeError`` it gives the container's
    records. None when so, else what differs."""
    script, manifest = MODES[mode]([case]), replay_manifest([case])
    container = run(api, script, manifest, "container")
    if (why := failed(container)) is not None:
        return f"the container reference failed: {why}"
    expected = split_records(container["calls"], [case])[case.id]
    if (wrong := problem(case, expected)) is not None:
        return f"container: {wrong}"
    refused = next(i for i, r in enumerate(expected) if r["status"] == "rejected")
    monty = run(api, script, manifest, "monty")
    script_report = (monty["error"] or {}).get("script_report") or {}
    if (
        monty["status"] != "failed"
        or script_report.get("type") != "AttributeError"
        or "'ToolError'" not in str(script_report.get("message"))
    ):
        return f"expected a failure naming 'ToolError', got {monty['status']} {monty['error']}"
    records = split_records(monty["calls"], [case])[case.id]
    if len(records) <= refused or calls_of(records) != calls_of(expected[: len(records)]):
        return f"monty {keys(records)} is not the container's {keys(expected)} up to its refusal"
    if keys(records[refused : refused + 1]) != keys(expected[refused : refused + 1]) or (
        records[refused]["error"] != expected[refused]["error"]
    ):
        return f"the refusal differs: monty {records[refused]}, container {expected[refused]}"
    spelled = run(api, monty_spelling(script), manifest, "monty")
    return compare([case], spelled, container).get(case.id)


@pytest.mark.parametrize("mode", MODES)
def test_schema_contradictions_are_refused_alike_and_tool_error_is_named(
    api: httpx.Client, cases: list[GroundTruthCase], mode: str
) -> None:
    chosen = [c for c in cases if c.id in SCHEMA_CONTRADICTIONS]
    assert len(chosen) == len(SCHEMA_CONTRADICTIONS) == 17
    with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
        outcomes = pool.map(partial(contradiction_problem, api, mode), chosen)
        found = {c.id: why for c, why in zip(chosen, outcomes, strict=True) if why is not None}
    assert not found, listing(found, len(chosen))


def attempt(api: httpx.Client, script: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A Monty job's view, or the problem that refused it before it ran (a 422: ``status`` ``refused``)."""
    body = {"script": script, "tools": tools, "engine": "monty", "wait_s": 120, "timeout_s": 120}
    answer = api.post("/execute", json=body)
    if answer.status_code == 422:
        problem = answer.json()
        return {"status": "refused", "engine": "monty", "error": {"type": "refused", "message": problem["detail"]}}
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


def names_it(view: dict[str, Any], name: str) -> str | None:
    """None when ``view`` is a job refused before it ran, or one that failed (not the service's ``internal_error``),
    with an error naming ``name`` (quoted, or a path from it), in its message or its script report's; else what it
    is."""
    error = view["error"] or {}
    text = f"{error.get('message')} {(error.get('script_report') or {}).get('message')}"
    if view["status"] == "succeeded":
        return f"succeeded: {view['engine']} runs it now (drop it from the list if its records are the container's)"
    if error.get("type") == "internal_error" or not re.search(rf"'{re.escape(name)}['.]", text):
        return f"expected a failure naming {name!r}, got {view['status']} {error}"
    return None


@pytest.mark.parametrize("mode", MODES)
def test_module_namespaces_fail_naming_the_namespace(
    api: httpx.Client, cases: list[GroundTruthCase], mode: str
) -> None:
    """Each entry of ``MODULE_NAMESPACES`` alone, its own manifest: refused before it runs, naming ``math`` or
    ``random``."""
    chosen = [c for c in cases if module_namespace(c) is not None]
    assert len(chosen) == sum(map(len, MODULE_NAMESPACES.values())) == 39

    def one(case: GroundTruthCase) -> str | None:
        view = attempt(api, MODES[mode]([case]), replay_manifest([case]))
        return names_it(view, str(module_namespace(case)))

    with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
        found = {c.id: why for c, why in zip(chosen, pool.map(one, chosen), strict=True) if why is not None}
    assert not found, listing(found, len(chosen))


def namespace_collisions(cases: list[GroundTruthCase]) -> dict[str, list[GroundTruthCase]]:
    """Each tool name that another entry's tools make a namespace too: the first entry calling it and the first
    entry declaring a tool under it that ``pack_batches`` would put in one job with it (names without such a pair
    left out)."""
    declared = {doc["name"] for case in cases for doc in case.functions}
    chosen = runnable(cases)
    pairs: dict[str, list[GroundTruthCase]] = {}
    for name in sorted(declared & namespaces(declared)):
        callers = [c for c in chosen if any(n == name for n, _ in c.calls)]
        under = [c for c in chosen if any(d["name"].startswith(f"{name}.") for d in c.functions)]
        pair = next(([a, b] for a in callers for b in under if len(pack_batches([a, b], 2)) == 1), None)
        if pair is not None:
            pairs[name] = pair
    return pairs


@pytest.mark.parametrize("mode", MODES)
def test_a_tool_that_is_also_a_namespace_fails_naming_it(
    api: httpx.Client, cases: list[GroundTruthCase], mode: str
) -> None:
    """Two entries in one job, one calling ``X(...)``, the other declaring ``X.y``: a batch ``pack_batches`` makes
    (12 names). The error must name ``X``: "'module' object is not callable" does not, and in ``sync`` the script's
    own ``except tools.ToolError`` is evaluated when the call raises and its ``AttributeError`` replaces the call's
    error, so there only a refusal naming ``X`` before the script runs names it."""
    pairs = namespace_collisions(cases)
    assert len(pairs) == 12, sorted(pairs)

    def one(item: tuple[str, list[GroundTruthCase]]) -> str | None:
        name, batch = item
        view = attempt(api, MODES[mode](batch), replay_manifest(batch))
        why = names_it(view, name)
        return None if why is None else f"{[c.id for c in batch]}: {why}"

    with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
        found = {n: why for n, why in zip(pairs, pool.map(one, pairs.items()), strict=True) if why is not None}
    assert not found, listing(found, len(pairs))


def sampled_cases() -> list[Any]:
    """Every ``SAMPLE_EVERY``-th entry of each category that Monty can run, each replayed alone."""
    try:
        chosen = [
            case
            for category in GROUND_TRUTH_CATEGORIES
            for index, case in enumerate(load_ground_truth(category))
            if index % SAMPLE_EVERY == 0 and runnable([case])
        ]
    except RuntimeError as exc:  # bfcl-eval missing: one case says how to install it (xfails; fails under CI)
        return [pytest.param(str(exc), id="bfcl-eval-missing")]
    return [pytest.param(case, id=case.id) for case in chosen]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sampled_cases())
def test_entry_replayed_alone_with_its_own_manifest(api: httpx.Client, case: GroundTruthCase | str, mode: str) -> None:
    if isinstance(case, str):
        missing(case, xfail=True)
    view = run(api, MODES[mode]([case], marker=False), replay_manifest([case], marker=False), "monty")
    assert failed(view) is None, failed(view)
    assert problem(case, view["calls"]) is None, problem(case, view["calls"])
