"""Manifest parsing, BFCL's schema dialect, and argument validation messages that name the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from service.errors import ManifestError
from service.toolkit.manifest import parse_manifest, parse_tool
from service.toolkit.schema import to_json_schema

ECHO = {"kind": "echo"}


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(levels):
        schema = {"not": schema}
    return schema


def test_bfcl_dialect_maps_to_json_schema() -> None:
    schema = to_json_schema(
        {
            "type": "dict",
            "properties": {
                "x": {"type": "float"},
                "pair": {"type": "tuple", "items": {"type": "integer"}},
                "anything": {"type": "any"},
                "name": {"type": "String"},
                "opts": {"type": "HashMap", "optional": True},
                "flag": {"type": "boolean", "enum": ["true", "false"]},
            },
            "required": ["x", "opts"],
        }
    )
    props = schema["properties"]
    assert schema["type"] == "object"
    assert props["x"] == {"type": "number"}
    assert props["pair"] == {"type": "array", "items": {"type": "integer"}}
    assert props["anything"] == {}
    assert props["name"] == {"type": "string"}
    assert "type" not in props["flag"] and props["flag"]["enum"] == ["true", "false"]
    assert schema["required"] == ["x"]  # "optional": true wins


@pytest.mark.parametrize(
    "entry",
    [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}},
        {"name": "f", "input_schema": {"type": "object", "properties": {}}},
        {"name": "f", "inputSchema": {"type": "object", "properties": {}}},
    ],
)
def test_openai_anthropic_and_mcp_shapes_are_accepted(entry: dict[str, Any]) -> None:
    assert parse_tool({**entry, "endpoint": ECHO}, ("tools", 0)).name == "f"


def tool() -> Any:
    return parse_tool(
        {
            "name": "area",
            "parameters": {
                "type": "dict",
                "properties": {
                    "base": {"type": "integer"},
                    "size": {"type": "dict", "properties": {"w": {"type": "float"}}, "required": ["w"]},
                },
                "required": ["base"],
            },
            "endpoint": ECHO,
        },
        ("tools", 0),
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "missing required argument 'base'"),
        ({"base": "3"}, "argument 'base': '3' is not of type 'integer'"),
        ({"base": 3, "size": {"w": "x"}}, "argument 'size.w': 'x' is not of type 'number'"),
        ({"base": 3, "size": {}}, "argument 'size': 'w' is a required property"),
        ({"base": 3, "bse": 1}, "unexpected argument 'bse' (did you mean 'base'?)"),
        ([1], "arguments must be a JSON object, got list"),
    ],
)
def test_validation_names_the_parameter(args: Any, message: str) -> None:
    problem = tool().check_arguments(args).problem
    assert problem is not None and message in problem, problem


def test_valid_arguments_pass() -> None:
    assert tool().check_arguments({"base": 3, "size": {"w": 2}}).problem is None


@pytest.mark.parametrize(
    ("divisor", "value", "valid"),
    [
        (0.5, 10**400, True),
        (0.5, 10**400 + 1, True),
        (0.3, 10**400, False),
        (10**400, 1.5, False),
        (10**400, 10**401, True),
        (float("nan"), 3, False),
        (float("inf"), 10**400, False),
    ],
    ids=["1e400/0.5", "(1e400+1)/0.5", "1e400/0.3", "1.5/1e400", "1e401/1e400", "3/nan", "1e400/inf"],
)
def test_multiple_of_past_a_floats_range_is_a_verdict_not_a_fault(divisor: Any, value: Any, valid: bool) -> None:
    spec = parse_tool(
        {"name": "m", "parameters": {"properties": {"x": {"multipleOf": divisor}}}, "endpoint": ECHO}, ("tools", 0)
    )
    check = spec.check_arguments({"x": value})  # before: OverflowError (the call's internal_error, a logged traceback)
    assert (check.problem is None) == valid, check.problem


@pytest.mark.parametrize(
    ("entry", "loc"),
    [
        ({"name": "", "endpoint": ECHO}, ("tools", 0, "name")),
        ({"name": "f"}, ("tools", 0, "endpoint")),
        ({"name": "f", "endpoint": {"kind": "http", "url": "file:///etc/passwd"}}, ("tools", 0, "endpoint", "url")),
        (
            {"name": "f", "endpoint": ECHO, "parameters": {"type": "object", "properties": {"a": {"minimum": "x"}}}},
            ("tools", 0, "parameters"),
        ),
        ("not an object", ("tools", 0)),
    ],
)
def test_bad_entries_raise_with_their_location(entry: Any, loc: tuple[Any, ...]) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest([entry])
    assert info.value.loc == loc


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ManifestError, match="duplicate"):
        parse_manifest([{"name": "f", "endpoint": ECHO}, {"name": "f", "endpoint": ECHO}])


def timed_check(entry: dict[str, Any], args: Any) -> tuple[str | None, float]:
    import time

    tool_ = parse_tool({**entry, "endpoint": ECHO}, ("tools", 0))
    started = time.monotonic()
    problem = tool_.check_arguments(args).problem
    return problem, time.monotonic() - started


def test_remote_refs_are_never_fetched() -> None:
    entry = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "http://127.0.0.1:9/s"}}}}
    problem, elapsed = timed_check(entry, {"x": 1})
    assert problem is not None and "cannot be resolved" in problem
    assert elapsed < 1


def test_catastrophic_pattern_is_bounded() -> None:
    entry = {
        "name": "f",
        "parameters": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}},
    }
    problem, elapsed = timed_check(entry, {"s": "a" * 60 + "!"})
    assert problem is not None
    assert elapsed < 1


def test_many_unexpected_arguments_are_described_quickly() -> None:
    problem, elapsed = timed_check(
        {"name": "f", "parameters": {"properties": {"a": {}}}}, {f"k{i}": 0 for i in range(200_000)}
    )
    assert problem is not None and "and 199997 more" in problem
    assert elapsed < 5


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": ".".join(["a"] * 17)}, "dotted parts"),
        ({"name": "bad\ud800"}, "lone surrogate"),
        ({"name": "f", "parameters": {"properties": {"p\ud800": {}}}}, "lone surrogate"),
        ({"name": "f", "parameters": {"properties": {"deep": _deep(300)}}}, "deeper"),
    ],
)
def test_unusable_names_and_schemas_are_refused(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_manifest([{**entry, "endpoint": ECHO}])


def test_array_enums_move_to_items_and_null_defaults_allow_null() -> None:
    schema = to_json_schema(
        {
            "type": "dict",
            "properties": {
                "metrics": {"type": "array", "enum": ["temp", "humidity"], "items": {"type": "string"}},
                "since": {"type": "string", "default": None},
            },
        }
    )
    assert schema["properties"]["metrics"] == {
        "type": "array",
        "items": {"type": "string", "enum": ["temp", "humidity"]},
    }
    assert schema["properties"]["since"]["type"] == ["string", "null"]


def test_unique_items_is_checked_in_linear_time() -> None:
    entry = {"name": "f", "parameters": {"properties": {"x": {"type": "array", "uniqueItems": True}}}}
    problem, elapsed = timed_check(entry, {"x": [{"a": i} for i in range(20_000)]})
    assert problem is None and elapsed < 2
    problem, _ = timed_check(entry, {"x": [1, 1.0]})
    assert problem is not None and "more than once" in problem
    assert timed_check(entry, {"x": [1, True]})[0] is None


@pytest.mark.parametrize(
    ("parameters", "cheap"),
    [
        ({"type": "object", "properties": {"i": {"type": "integer"}}}, True),
        ({"properties": {"pattern": {"type": "string"}, "format": {"enum": ["a", "b"]}}}, True),  # names, not keywords
        ({"properties": {"s": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["s"]}, True),
        ({"properties": {"s": {"type": "string", "pattern": "^(a|a)+$"}}}, False),
        ({"patternProperties": {"^x": {}}}, False),
        ({"properties": {"s": {"type": "string", "format": "email"}}}, False),
        ({"properties": {"n": {"$ref": "#"}}}, False),  # may recurse
        ({"properties": {"n": {"items": {"$ref": "#/$defs/a"}}}, "$defs": {"a": {}}}, False),
        ({"properties": {"s": {"enum": list(range(200))}}}, False),  # its set would be built on the loop
        ({"properties": {f"p{i}": {"type": "integer"} for i in range(60)}}, False),
        ({"properties": {"o": {"type": "object"}}, "unevaluatedProperties": False}, False),
    ],
)
def test_cheap_schemas_are_small_and_without_costly_keywords(parameters: dict[str, Any], cheap: bool) -> None:
    tool = parse_tool({"name": "t", "parameters": parameters, "endpoint": ECHO}, ())
    assert tool.cheap_arguments is cheap
    assert tool.cheap_result  # no output schema: nothing to check but the result's depth


def test_an_approval_rule_or_a_costly_output_schema_is_not_cheap() -> None:
    cheap = {"type": "object", "properties": {"i": {"type": "integer"}}}
    rule = {"when": {"required": ["i"]}}
    ruled = parse_tool({"name": "t", "parameters": cheap, "approval": rule, "endpoint": ECHO}, ())
    assert not ruled.cheap_arguments and ruled.cheap_result
    out = {"type": "object", "properties": {"u": {"type": "string", "format": "uri"}}}
    checked = parse_tool({"name": "t", "parameters": cheap, "output_schema": out, "endpoint": ECHO}, ())
    assert checked.cheap_arguments and not checked.cheap_result
    simple = parse_tool({"name": "t", "parameters": cheap, "output_schema": {"type": "object"}, "endpoint": ECHO}, ())
    assert simple.cheap_result
