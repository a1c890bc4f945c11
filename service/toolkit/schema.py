"""JSON Schema as tool manifests write it: BFCL's dialect mapped to JSON Schema, and Python types.

BFCL (the Berkeley Function Calling Leaderboard, ``bfcl-eval`` data) writes
``dict`` for ``object``, ``float`` for ``number``, ``tuple`` for ``array`` and
``any`` for "no constraint", plus Java and JavaScript type names in its
``simple_java``/``simple_javascript`` files (``String``, ``HashMap``,
``ArrayList``, ``long``, ``double``, ``char``, ``Boolean``, ...); it marks
optional parameters with ``"optional": true`` as well as by ``required``.
``to_json_schema`` maps all of that to Draft 2020-12; a type it does not know
becomes "any value" rather than an error; an ``enum`` whose values contradict
the declared type keeps the enum and drops the type, except on an array, where
an enum of scalars is moved to the items; a ``null`` default makes the type
nullable.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable
from typing import Any

JsonSchema = dict[str, Any]

_TYPE_MAP: dict[str, str | None] = {
    "object": "object",
    "dict": "object",
    "hashmap": "object",
    "map": "object",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "arraylist": "array",
    "set": "array",
    "string": "string",
    "str": "string",
    "char": "string",
    "character": "string",
    "integer": "integer",
    "int": "integer",
    "long": "integer",
    "short": "integer",
    "byte": "integer",
    "number": "number",
    "float": "number",
    "double": "number",
    "bigdecimal": "number",
    "boolean": "boolean",
    "bool": "boolean",
    "null": "null",
    "none": "null",
    "any": None,
    "object?": None,
    "": None,
}

_PY_TYPE = {
    "object": "dict[str, Any]",
    "array": "list[Any]",
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "null": "None",
}

_JSON_TYPE_CHECK: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}

MAX_DEPTH = 8


def json_type(name: Any) -> str | None:
    """JSON Schema type for a manifest's type name (BFCL dialect included); None = any value."""
    if not isinstance(name, str):
        return None
    return _TYPE_MAP.get(name.strip().lower())


def _types_of(schema: JsonSchema) -> list[str]:
    raw = schema.get("type")
    names = raw if isinstance(raw, list) else [raw] if raw is not None else []
    mapped = [json_type(n) for n in names]
    if any(m is None for m in mapped):
        return []
    return list(dict.fromkeys(m for m in mapped if m is not None))


def to_json_schema(schema: Any, depth: int = 0) -> JsonSchema:
    """Map a manifest parameter schema (any dialect above) to Draft 2020-12 JSON Schema.

    Args:
        schema: the schema as the manifest gives it; a non-dict means "any value".
        depth: recursion depth; below ``MAX_DEPTH`` levels the rest is "any value".

    Returns:
        A new schema; the input is not modified. Unknown keywords are kept.
    """
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return {}
    out: JsonSchema = {
        k: v for k, v in schema.items() if k not in ("type", "properties", "items", "required", "optional", "default")
    }
    if "default" in schema:
        out["default"] = schema["default"]
    types = _types_of(schema)
    enum = schema.get("enum")
    items_enum = None
    if isinstance(enum, list) and types == ["array"] and enum and not any(isinstance(v, (list, dict)) for v in enum):
        items_enum = enum  # an array whose enum lists item values: the enum belongs to the items
        del out["enum"]
    elif isinstance(enum, list) and types:
        if not all(any(_JSON_TYPE_CHECK[t](v) for t in types) for v in enum):
            types = []
    if types and "default" in schema and schema["default"] is None and "null" not in types:
        types = [*types, "null"]  # a null default means "may be null"
    if types:
        out["type"] = types[0] if len(types) == 1 else types
    properties = schema.get("properties")
    if isinstance(properties, dict):
        out["properties"] = {str(k): to_json_schema(v, depth + 1) for k, v in properties.items()}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        optional = {k for k, v in properties.items() if isinstance(v, dict) and v.get("optional") in (True, "true")}
        required = [r for r in dict.fromkeys(required) if r not in optional]
        if required:
            out["required"] = required
    elif isinstance(schema.get("required"), list):
        out["required"] = [r for r in schema["required"] if isinstance(r, str)]
    items = schema.get("items")
    if isinstance(items, dict):
        out["items"] = to_json_schema(items, depth + 1)
    elif isinstance(items, list):  # draft-4 tuple form
        out["prefixItems"] = [to_json_schema(i, depth + 1) for i in items]
    if items_enum is not None:
        out["items"] = {**out.get("items", {}), "enum": items_enum}
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            out[key] = [to_json_schema(s, depth + 1) for s in schema[key]]
    return out


def python_type(
    schema: JsonSchema, depth: int = 0, name_object: Callable[[JsonSchema], str | None] | None = None
) -> str:
    """Python annotation text for a JSON Schema (``str``, ``list[int]``, ``Literal['a', 'b']``, ``X | None``).

    ``name_object`` may turn an object schema with properties into the name of
    a TypedDict (it returns None to keep ``dict[str, Any]``). Bounded: beyond
    ``MAX_DEPTH`` levels, or for shapes it does not render, ``Any``.
    """
    if depth > MAX_DEPTH:
        return "Any"
    enum = schema.get("enum")
    if (
        isinstance(enum, list)
        and enum
        and len(enum) <= 64
        and all(isinstance(v, (str, int, bool)) or v is None for v in enum)
    ):
        literal = f"Literal[{', '.join(repr(v) for v in enum)}]"
        return literal if len(literal) <= 2000 else "Any"
    types = _types_of(schema)
    if not types:
        variants = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(variants, list) and variants:
            rendered = list(
                dict.fromkeys(python_type(v, depth + 1, name_object) for v in variants if isinstance(v, dict))
            )
            return "Any" if "Any" in rendered or not rendered else " | ".join(rendered)
        return "Any"
    parts = []
    for t in types:
        if t == "array" and isinstance(schema.get("items"), dict):
            parts.append(f"list[{python_type(schema['items'], depth + 1, name_object)}]")
        elif t == "object" and name_object is not None and depth < MAX_DEPTH:
            parts.append(name_object(schema) or _PY_TYPE[t])
        else:
            parts.append(_PY_TYPE[t])
    return " | ".join(dict.fromkeys(parts))


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value (a scalar is 0), counted without recursion and only up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def safe_identifier(name: str, taken: set[str], in_class: bool = False) -> str:
    """A valid, unused Python identifier for ``name`` (``from`` -> ``from_``, ``Content-Type`` -> ``Content_Type``).

    Rule (documented in docs/tools-and-manifests.md, "Scripts and stubs"): characters that cannot appear in an
    identifier become ``_``; a leading digit gets a ``_`` prefix; a dunder
    name (``__qualname__``), or in a class body (a namespace) any name with a
    leading double underscore, starts with a single one instead, so nothing is
    taken for a special name or mangled; a keyword, or a name already in
    ``taken``, gets ``_`` appended until it is free. The result is added to
    ``taken``.
    """
    ident = name if name.isascii() and name.isidentifier() else re.sub(r"\W", "_", name, flags=re.ASCII)
    if not ident or ident[0].isdigit():
        ident = "_" + ident
    if ident.startswith("__") and (in_class or ident.endswith("__")):
        ident = "_" + ident.lstrip("_")
    while keyword.iskeyword(ident) or ident in taken:
        ident += "_"
    taken.add(ident)
    return ident


def stub_parameters(parameters: JsonSchema) -> list[str]:
    """The tool's parameter names in the stub's order: the required ones (as ``required`` lists them), then the
    other properties (as ``properties`` lists them); each once."""
    props = parameters.get("properties")
    required = [r for r in parameters.get("required") or [] if isinstance(r, str)]
    return list(dict.fromkeys([*required, *(props if isinstance(props, dict) else {})]))


def dict_as_arguments(parameters: JsonSchema) -> bool:
    """Whether a stub call with one positional dict and no keywords binds the dict's keys as the arguments.

    Rule (documented in docs/tools-and-manifests.md, "Scripts and stubs"): True when the tool's first parameter,
    in the stub's order (``stub_parameters``), cannot take an object, or the tool has no parameter; False when it
    can (then the dict is that parameter's value, as for any positional argument). "Can take an object" is read
    from the parameter's schema (``can_take_object``).

    Args:
        parameters: the tool's parameter object schema (JSON Schema, as ``to_json_schema`` maps it); its ``$defs``
            and ``definitions`` resolve local ``$ref`` values.
    """
    names = stub_parameters(parameters)
    if not names:
        return True
    props = parameters.get("properties")
    schema = props.get(names[0], {}) if isinstance(props, dict) else {}
    return not can_take_object(schema, parameters)


OBJECT_CHECK_BUDGET = 1000
"""Most schemas ``can_take_object`` looks at for one parameter (a manifest's ``$ref`` values may fan out)."""


def can_take_object(schema: Any, root: JsonSchema) -> bool:
    """Whether a JSON object may be valid against ``schema``, as far as its keywords tell (no full check).

    False only when a keyword rules every object out: ``false``; a ``type`` (name or list, BFCL's dialect too)
    without ``object``; an ``enum`` or ``const`` with no object value; ``anyOf``/``oneOf`` none of whose variants
    can; an ``allOf`` branch or a local ``$ref`` (``#/...`` in ``root``) that cannot. A schema without such a
    keyword (no type: any value), an unknown type name, a ``$ref`` that does not resolve here, or past
    ``MAX_DEPTH`` levels or ``OBJECT_CHECK_BUDGET`` schemas, can: such a call keeps its ordinary meaning.
    """
    budget = [OBJECT_CHECK_BUDGET]

    def can(node: Any, depth: int) -> bool:
        budget[0] -= 1
        if node is False:
            return False
        if not isinstance(node, dict) or depth > MAX_DEPTH or budget[0] < 0:
            return True
        if "const" in node and not isinstance(node["const"], dict):
            return False
        enum = node.get("enum")
        if isinstance(enum, list) and not any(isinstance(v, dict) for v in enum):
            return False
        types = _types_of(node)
        if types and "object" not in types:
            return False
        for key in ("anyOf", "oneOf"):
            variants = node.get(key)
            if isinstance(variants, list) and variants and not any(can(v, depth + 1) for v in variants):
                return False
        branches = node.get("allOf")
        if isinstance(branches, list) and not all(can(b, depth + 1) for b in branches):
            return False
        ref = node.get("$ref")
        target = _local_ref(ref, root) if isinstance(ref, str) else None
        return target is None or can(target, depth + 1)

    return can(schema, 0)


def _local_ref(ref: str, root: JsonSchema) -> Any:
    """The schema a local ``$ref`` (``#`` or ``#/a/b``, JSON Pointer escapes) points at in ``root``; None if it does
    not resolve there (another document, a missing key)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for token in ref[2:].split("/"):
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
