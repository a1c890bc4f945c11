"""``schema.dict_as_arguments``: when a lone positional dict is a tool's arguments, read from its input schema."""

from __future__ import annotations

from typing import Any

import pytest

from service.toolkit.manifest import parse_manifest
from service.toolkit.schema import can_take_object, dict_as_arguments, stub_parameters


def first(schema: Any, **extra: Any) -> dict[str, Any]:
    """A tool's parameters whose first (required) parameter has ``schema``, beside an ordinary string one."""
    return {"type": "object", "properties": {"p": schema, "q": {"type": "string"}}, "required": ["p"], **extra}


@pytest.mark.parametrize(
    ("schema", "as_arguments"),
    [
        ({"type": "string"}, True),
        ({"type": "integer"}, True),
        ({"type": "array", "items": {"type": "object"}}, True),  # a list, never a dict
        ({"type": ["string", "null"]}, True),
        ({"type": ["object", "null"]}, False),
        ({"type": "object"}, False),
        ({"type": "dict"}, False),  # BFCL's dialect
        ({"type": "HashMap"}, False),
        ({"type": "String"}, True),
        ({"type": "any"}, False),  # no constraint: may be an object
        ({"type": "no-such-type"}, False),
        ({}, False),  # no type: any value
        ({"description": "anything"}, False),
        (True, False),
        (False, True),
        ({"enum": ["a", "b"]}, True),
        ({"enum": ["a", {"k": 1}]}, False),
        ({"const": "x"}, True),
        ({"const": {"k": 1}}, False),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, True),
        ({"anyOf": [{"type": "string"}, {"type": "object"}]}, False),
        ({"anyOf": [{"type": "string"}, {}]}, False),
        ({"oneOf": [{"type": "string"}, {"type": "null"}]}, True),
        ({"oneOf": [{"type": "object"}, {"type": "null"}]}, False),
        ({"allOf": [{}, {"type": "string"}]}, True),
        ({"allOf": [{}, {"type": "object"}]}, False),
        ({"$ref": "#/$defs/Quarter"}, True),
        ({"$ref": "#/$defs/Filter"}, False),
        ({"$ref": "#/definitions/Quarter"}, True),
        ({"$ref": "#/$defs/Missing"}, False),  # does not resolve here: keep the ordinary meaning
        ({"$ref": "https://example.com/schema.json"}, False),
        ({"$ref": "#"}, False),  # the parameters object itself
        ({"$ref": "#/$defs/Loop"}, False),  # a cycle: bounded, then "can"
        ({"$ref": "#/$defs/Escaped~1name"}, True),
    ],
)
def test_a_lone_dict_is_the_arguments_when_the_first_parameter_cannot_take_an_object(
    schema: Any, as_arguments: bool
) -> None:
    defs = {
        "Quarter": {"type": "string", "enum": ["Q1", "Q2", "Q3", "Q4"]},
        "Filter": {"type": "object", "properties": {"stars": {"type": "integer"}}},
        "Loop": {"$ref": "#/$defs/Loop"},
        "Escaped/name": {"type": "integer"},
    }
    parameters = first(schema, **{"$defs": defs, "definitions": {"Quarter": defs["Quarter"]}})
    assert dict_as_arguments(parameters) is as_arguments


def test_the_first_parameter_is_the_stubs_first_required_then_the_first_property() -> None:
    parameters = {
        "type": "object",
        "properties": {"options": {"type": "object"}, "employee_id": {"type": "integer"}},
        "required": ["employee_id"],
    }
    assert stub_parameters(parameters) == ["employee_id", "options"]
    assert dict_as_arguments(parameters) is True
    assert dict_as_arguments({**parameters, "required": []}) is False  # now `options` comes first
    assert dict_as_arguments({"type": "object", "properties": {}}) is True  # no parameter at all
    assert dict_as_arguments({"type": "object", "required": ["x"]}) is False  # required, no schema: any value


def test_manifest_dialects_reach_the_rule_mapped() -> None:
    """BFCL's ``dict``/``float`` and a null default go through ``to_json_schema`` first, as the generator sees them."""
    tools = parse_manifest(
        [
            {
                "name": "bfcl",
                "parameters": {"type": "dict", "properties": {"x": {"type": "float"}}, "required": ["x"]},
                "endpoint": {"kind": "echo"},
            },
            {
                "name": "nullable_object",
                "parameters": {"type": "dict", "properties": {"x": {"type": "dict", "default": None}}},
                "endpoint": {"kind": "echo"},
            },
        ]
    )
    assert dict_as_arguments(tools["bfcl"].parameters) is True
    assert dict_as_arguments(tools["nullable_object"].parameters) is False


def test_a_fanned_out_ref_graph_is_decided_quickly() -> None:
    """A hostile ``$defs`` graph (each node naming every node, 50 wide) is cut at the budget: "can"."""
    defs = {f"n{i}": {"anyOf": [{"$ref": f"#/$defs/n{j}"} for j in range(50)]} for i in range(50)}
    parameters = first({"$ref": "#/$defs/n0"}, **{"$defs": defs})
    assert can_take_object({"$ref": "#/$defs/n0"}, parameters) is True  # unbounded, 50 ** 9 schemas to look at
