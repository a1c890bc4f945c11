"""The JavaScript replay of BFCL v4 ground truth, without an engine: literals, numbers, and the scripts themselves.

Every generated script is read back (:func:`read_script`): its calls, markers included, are the Python replay's, in
the same order, with the same JSON values (a BigInt literal read as its integer, ``2.0`` as a float).  That the
scripts run, and what the broker records, is ``tests/integration/test_bfcl_replay_js.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import pytest

from tests.bfcl_data import (
    CASE_MARKER,
    GROUND_TRUTH_CATEGORIES,
    JAVASCRIPT_CATEGORY,
    MAX_SAFE_INTEGER,
    GroundTruthCase,
    as_sent_from_javascript,
    javascript_expectation,
    js_call_source,
    js_literal,
    js_replay_script,
    load_ground_truth,
    load_javascript_ground_truth,
    pack_batches,
)
from tests.conftest import missing
from tests.unit.test_bfcl_replay import BATCH_CASES

_TOKEN: Final = re.compile(
    r'\s+|"(?:[^"\\]|\\.)*"|\["__proto__"\](?=:)|[A-Za-z_$][A-Za-z0-9_$]*(?=:)|-?\d+n'
    r"|-?\d+(?:\.\d+)?(?:e[+-]?\d+)?|true|false|null|[\[\]{}:,]"
)


def read_js_literal(source: str) -> Any:
    """The JSON value of a :func:`js_literal` (bare keys, computed ``__proto__``, BigInts), read the way JavaScript
    reads it but keeping Python's float/int distinction; ValueError for anything else."""
    parts, pos = [], 0
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None:
            raise ValueError(f"not a literal of js_literal's at {pos}: {source[pos : pos + 40]!r}")
        token, pos = match.group(), match.end()
        if token == '["__proto__"]':
            token = '"__proto__"'
        elif re.fullmatch(r"-?\d+n", token):  # a BigInt literal: its integer
            token = token[:-1]
        elif re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$]*", token) and token not in ("true", "false", "null"):
            token = json.dumps(token)
        parts.append(token)
    return json.loads("".join(parts))


def canonical(value: Any) -> str:
    """JSON that tells ``1`` from ``1.0`` and ``true``."""
    return json.dumps(value, sort_keys=True)


_CALL_FORMS: Final = (  # (prefix, suffix) of a line holding one call, per form
    ("await tools[", ");"),  # a marker
    ("try { await tools[", "); } catch (error) { refused(error); }"),  # sequential
    ("  tools[", ").catch(refused),"),  # inside Promise.all
)


def read_script(script: str) -> tuple[list[tuple[str, Any]], int]:
    """A replay script's calls in source order (tool name, arguments), and how many ``Promise.all`` it awaits."""
    lines = script.splitlines()
    prelude = lines.index("};") + 2  # after `const refused = ...;` and a blank line
    assert lines[0] == 'import tools, { ToolError } from "tools";' and lines[prelude - 1] == ""
    calls: list[tuple[str, Any]] = []
    gathers = 0
    for line in lines[prelude:]:
        if line == "await Promise.all([":
            gathers += 1
            continue
        if line == "]);":
            continue
        prefix, suffix = next((p, s) for p, s in _CALL_FORMS if line.startswith(p) and line.endswith(s))
        rest = line[len(prefix) : -len(suffix)]
        name, end = json.JSONDecoder().raw_decode(rest)
        assert rest[end : end + 2] == "](", line
        calls.append((name, read_js_literal(rest[end + 2 :])))
    return calls, gathers


def python_order(batch: list[GroundTruthCase]) -> list[tuple[str, Any]]:
    """The calls of the Python replay of ``batch`` (``replay_script``), markers included, in its order."""
    return [call for case in batch for call in [(CASE_MARKER, {"id": case.id}), *case.calls]]


@pytest.fixture(scope="module")
def ground_truth() -> list[GroundTruthCase]:
    """Every entry of ``GROUND_TRUTH_CATEGORIES`` and ``simple_javascript``; xfails (says how to install it) without
    ``bfcl-eval``, fails under CI."""
    try:
        cases = [case for category in GROUND_TRUTH_CATEGORIES for case in load_ground_truth(category)]
        return cases + load_javascript_ground_truth()
    except RuntimeError as exc:
        missing(str(exc), xfail=True)


def test_integers_past_the_safe_range_are_bigint_literals() -> None:
    assert js_literal(MAX_SAFE_INTEGER) == "9007199254740991"
    assert js_literal(-MAX_SAFE_INTEGER) == "-9007199254740991"
    assert js_literal(MAX_SAFE_INTEGER + 1) == "9007199254740992n"
    assert js_literal(-(2**63) - 1) == "-9223372036854775809n"
    assert js_literal(12345678901234567890) == "12345678901234567890n"
    assert js_literal(0) == "0" and js_literal(True) == "true" and js_literal(False) == "false"
    assert as_sent_from_javascript(2**64 + 1) == 2**64 + 1  # a BigInt is sent exactly


def test_floats_keep_their_double_and_a_whole_one_is_sent_as_an_integer() -> None:
    assert [js_literal(x) for x in (2.0, 0.1, -2.5, 1e-05, 5e-324, 1e16, 1e21, -0.0)] == [
        "2.0",
        "0.1",
        "-2.5",
        "1e-05",
        "5e-324",
        "1e+16",
        "1e+21",
        "-0.0",
    ]
    sent = as_sent_from_javascript([2.0, -0.0, 1e16, 1e20, 1e21, 0.1, 3, True, None, {"a": (4.0, "4.0")}])
    assert canonical(sent) == canonical([2, 0, 10**16, 10**20, 1e21, 0.1, 3, True, None, {"a": [4, "4.0"]}])
    assert sent[0] == 2.0 and sent[3] == 1e20  # the same values
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="is not a JSON number"):
            js_literal({"x": [bad]})


def test_strings_and_keys() -> None:
    value = {"city": "Oslo", "Content-Type": 'a"b\n', "from": 1, "$x_1": None, "1a": [], "__proto__": {"é": "\u2028"}}
    assert js_literal(value) == (
        '{city: "Oslo", "Content-Type": "a\\"b\\n", from: 1, $x_1: null, "1a": [], '
        '["__proto__"]: {"\\u00e9": "\\u2028"}}'
    )
    assert canonical(read_js_literal(js_literal(value))) == canonical(value)
    with pytest.raises(TypeError, match="object key must be a string"):
        js_literal({1: "x"})
    with pytest.raises(TypeError, match="set is not a JSON value"):
        js_literal({"x": {1}})


def test_call_source_names_the_tool_by_its_original_name() -> None:
    assert js_call_source("math.factorial", {"number": 5}) == 'tools["math.factorial"]({number: 5})'
    assert js_call_source("get-user", {}) == 'tools["get-user"]({})'
    with pytest.raises(TypeError, match="one object"):
        js_call_source("f", [1])  # type: ignore[arg-type]


def test_scripts_carry_bigints_and_whole_floats_as_written() -> None:
    case = GroundTruthCase(id="n_0", category="n", functions=[], calls=[("f", {"big": 2**64 + 1, "whole": 2.0})])
    sequential = js_replay_script([case])
    assert 'await tools["bfcl_case"]({id: "n_0"});\n' in sequential
    assert 'try { await tools["f"]({big: 18446744073709551617n, whole: 2.0}); } catch' in sequential
    gathered = js_replay_script([case], marker=False, gather=True)
    assert "bfcl_case" not in gathered
    assert (
        'await Promise.all([\n  tools["f"]({big: 18446744073709551617n, whole: 2.0}).catch(refused),\n]);\n' in gathered
    )
    assert javascript_expectation(case).calls == [("f", {"big": 2**64 + 1, "whole": 2})]
    assert read_script(sequential) == ([(CASE_MARKER, {"id": "n_0"}), *case.calls], 0)


@pytest.mark.parametrize("gather", [False, True], ids=["await", "promise-all"])
def test_every_entry_gets_a_script_with_the_python_calls_in_their_order(
    ground_truth: list[GroundTruthCase], gather: bool
) -> None:
    batches = [
        batch
        for category in (*GROUND_TRUTH_CATEGORIES, JAVASCRIPT_CATEGORY)
        for batch in pack_batches([case for case in ground_truth if case.category == category], BATCH_CASES)
    ]
    assert sum(len(batch) for batch in batches) == len(ground_truth) == 2351 + 50
    for batch in batches:
        calls, gathers = read_script(js_replay_script(batch, gather=gather))
        assert [(name, canonical(args)) for name, args in calls] == [
            (name, canonical(args)) for name, args in python_order(batch)
        ]
        assert gathers == (len(batch) if gather else 0)


def test_simple_javascript_values_are_taken_as_the_possible_answers_give_them(
    ground_truth: list[GroundTruthCase],
) -> None:
    by_id = {case.id: case for case in ground_truth if case.category == JAVASCRIPT_CATEGORY}
    assert len(by_id) == 50 and all(len(case.calls) == 1 for case in by_id.values())
    assert by_id["simple_javascript_1"].calls == [("getActiveDataEntries", {"listElement": "listElement"})]  # 'any'
    ((_, store),) = by_id["simple_javascript_5"].calls  # a 'dict' with accepted-values lists inside, resolved
    assert (
        store["store"]["enhancers"] == ["applyMiddleware('myMiddleWare')"]
        and store["context"] == "React.createContext()"
    )
    assert by_id["simple_javascript_6"].calls == [("mapTransitions", {"category": "transition", "limit": 4.0})]
    assert by_id["simple_javascript_13"].calls[0][1].keys() == {"userData", "scalingFactor", "dashboard"}  # ["", {}]
    assert by_id["simple_javascript_16"].calls[0][1]["vertices"] == [10.0, 15.0]  # the first of two accepted
    assert by_id["simple_javascript_43"].calls[0][1]["error"] == "null"  # 'any': the source text
