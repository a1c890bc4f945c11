"""The Monty replay of BFCL v4 ground truth, without an engine: its scripts, its batches, and its lists.

The ``gather`` script (``gather_replay_script``) is read back with :mod:`ast`: its calls, markers included, are the
sequential replay's (``tests.bfcl_data.replay_script``), in the same order, with the same values, one
``asyncio.gather`` per entry.  The Monty batches (``pack_for_monty``) hold every entry Monty can run once, never a
tool that another entry's tools make a namespace too; ``MODULE_NAMESPACES`` is what Monty refuses as a namespace.
That the scripts run, and what the broker records, is ``tests/integration/test_bfcl_replay_monty.py``.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest

from tests.bfcl_data import CASE_MARKER, GROUND_TRUTH_CATEGORIES, GroundTruthCase, load_ground_truth, replay_script
from tests.conftest import missing
from tests.integration.test_bfcl_replay import SCHEMA_CONTRADICTIONS
from tests.integration.test_bfcl_replay_monty import (
    MODULE_NAMESPACES,
    TOOL_ERROR_CATCH,
    gather_replay_script,
    module_namespace,
    monty_spelling,
    namespace_collisions,
    namespaces,
    pack_for_monty,
    runnable,
)
from tests.unit.test_bfcl_replay import BATCH_CASES


@pytest.fixture(scope="module")
def ground_truth() -> list[GroundTruthCase]:
    """Every entry of ``GROUND_TRUTH_CATEGORIES``; xfails (says how to install it) without ``bfcl-eval``, fails under
    CI."""
    try:
        return [case for category in GROUND_TRUTH_CATEGORIES for case in load_ground_truth(category)]
    except RuntimeError as exc:
        missing(str(exc), xfail=True)


def dotted(node: ast.expr) -> str:
    """``tools.aio.math.factorial`` for the attribute chain ``tools.aio.math.factorial``."""
    if isinstance(node, ast.Name):
        return node.id
    assert isinstance(node, ast.Attribute), ast.dump(node)
    return f"{dotted(node.value)}.{node.attr}"


def tool_calls(script: str, prefix: str) -> list[tuple[str, str]]:
    """The calls of a replay script whose function is ``<prefix><tool name>``, in source order: (tool name,
    arguments as canonical JSON: ``1`` is not ``1.0``)."""
    found = []
    for node in ast.walk(ast.parse(script)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = dotted(node.func)
        if not name.startswith(prefix):
            continue
        assert not node.args, ast.dump(node)
        args: dict[str, Any] = {}
        for keyword in node.keywords:
            value = ast.literal_eval(keyword.value)
            args.update(value if keyword.arg is None else {keyword.arg: value})
        found.append((node.lineno, node.col_offset, name.removeprefix(prefix), json.dumps(args, sort_keys=True)))
    return [(name, args) for _, _, name, args in sorted(found)]


def test_a_gather_script_awaits_each_entrys_calls_together() -> None:
    calls: list[tuple[str, dict[str, Any]]] = [("math.factorial", {"number": 5}), ("f", {"from": 1, "x": 2.0})]
    case = GroundTruthCase(id="g_0", category="g", functions=[], calls=calls)
    script = gather_replay_script([case])
    assert "    await tools.aio.bfcl_case(id='g_0')\n" in script
    assert (
        "    await asyncio.gather(\n"
        "        refused(tools.aio.math.factorial(number=5)),\n"
        "        refused(tools.aio.f(x=2.0, **{'from': 1})),\n"
        "    )\n"
    ) in script
    assert script.endswith("\n\nasyncio.run(main())\n") and f"    {TOOL_ERROR_CATCH}\n" in script
    assert "bfcl_case" not in gather_replay_script([case], marker=False)
    assert "ToolError" not in monty_spelling(script) and "    except RuntimeError:\n" in monty_spelling(script)
    with pytest.raises(AssertionError):
        monty_spelling("print(1)\n")


def test_every_entry_gets_a_gather_script_with_the_sequential_calls_in_their_order(
    ground_truth: list[GroundTruthCase],
) -> None:
    batches = pack_for_monty(ground_truth, BATCH_CASES)
    for batch in batches:
        sequential = tool_calls(replay_script(batch), "tools.")
        gathered = gather_replay_script(batch)
        expected = [(name, json.dumps(args, sort_keys=True)) for c in batch for name, args in c.calls]
        assert [c for c in sequential if c[0] != CASE_MARKER] == expected
        assert tool_calls(gathered, "tools.aio.") == sequential
        gathers = [
            n for n in ast.walk(ast.parse(gathered)) if isinstance(n, ast.Call) and dotted(n.func) == "asyncio.gather"
        ]
        assert len(gathers) == sum(1 for c in batch if c.calls)


def test_monty_batches_hold_every_runnable_entry_once_and_no_tool_beside_its_namespace(
    ground_truth: list[GroundTruthCase],
) -> None:
    chosen = runnable(ground_truth)
    assert len(chosen) == 2351 - len(SCHEMA_CONTRADICTIONS) - 39
    batches = pack_for_monty(chosen, BATCH_CASES)
    assert sorted(c.id for batch in batches for c in batch) == sorted(c.id for c in chosen)
    assert all(len(batch) <= BATCH_CASES for batch in batches)
    for batch in batches:
        docs: dict[str, dict[str, Any]] = {}
        for case in batch:
            for doc in case.functions:
                assert docs.setdefault(doc["name"], doc) == doc, (case.id, doc["name"])
        for case in batch:
            mine = {doc["name"] for doc in case.functions}
            others = set(docs) - mine
            assert not (mine & namespaces(others)) - namespaces(mine), case.id
            assert not others & namespaces(mine), case.id
    assert len(batches) <= 70  # about as many jobs as the Python replay's 58


def test_tool_namespace_pairs_are_real_collisions(ground_truth: list[GroundTruthCase]) -> None:
    pairs = namespace_collisions(ground_truth)
    assert sorted(pairs) == [
        "currency_conversion", "hotel_booking", "law_case_search", "linear_regression", "museum_info",
        "recipe_search", "restaurant_search", "sports_ranking", "stock_price", "todo", "unit_conversion",
        "weather_forecast",
    ]  # fmt: skip
    for name, (caller, other) in pairs.items():
        assert any(n == name for n, _ in caller.calls)
        assert any(doc["name"].startswith(f"{name}.") for doc in other.functions)


def test_module_namespaces_are_the_ones_monty_refuses(ground_truth: list[GroundTruthCase]) -> None:
    """Of every first part of a dotted tool name in the data, Monty's ``ExternalModule`` refuses exactly the names
    of ``MODULE_NAMESPACES`` (its own modules), and those are the entries declaring a tool under one."""
    monty = pytest.importorskip("pydantic_monty")
    firsts = {doc["name"].split(".")[0] for case in ground_truth for doc in case.functions if "." in doc["name"]}
    refused = set()
    for first in firsts:
        try:
            monty.ExternalModule({first: monty.ExternalModule({"f": print})})
        except ValueError as exc:
            assert "cannot be replaced" in str(exc), exc
            refused.add(first)
    assert refused == set(MODULE_NAMESPACES) and len(firsts) > 300
    assert {c.id: module_namespace(c) for c in ground_truth if module_namespace(c)} == {
        i: n for n, ids in MODULE_NAMESPACES.items() for i in ids
    }
