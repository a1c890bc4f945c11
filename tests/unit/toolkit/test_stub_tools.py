"""``stub_tools`` (what the Monty engine binds calls with) and ``type_stubs`` (what the type check reads) describe
exactly the module ``generate_stub_module`` writes: the same paths, parameter names and order, renames and positional
dict rule, for hostile names and for every BFCL v4 function schema."""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path
from typing import Any

from service.toolkit.manifest import parse_manifest
from service.toolkit.stubs import generate_stub_module, stub_tools, type_stubs
from tests.bfcl_data import iter_function_docs

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "sandbox_image"))

ECHO = {"kind": "echo"}
HOSTILE = [
    {"name": "class", "parameters": {"properties": {"def": {}, "from": {}, "from_": {}}}, "endpoint": ECHO},
    {"name": "aio", "endpoint": ECHO},
    {"name": "ToolError", "endpoint": ECHO},
    {"name": "9lives.x-y", "endpoint": ECHO},
    {"name": "ns", "endpoint": ECHO},
    {"name": "ns.inner.deep", "parameters": {"properties": {"o": {"type": "object"}}}, "endpoint": ECHO},
    {"name": "_ptc_toolbox", "endpoint": ECHO},
    {"name": "req", "parameters": {"properties": {"b": {}, "a": {}}, "required": ["a"]}, "endpoint": ECHO},
]


def described(
    entries: list[dict[str, Any]],
) -> list[tuple[str, str, tuple[tuple[str, bool], ...], dict[str, str], bool]]:
    """What the generated module's decorators register, in order: (tool, path, parameters, renames, object)."""
    tools = parse_manifest(entries)
    module = types.ModuleType("tools")
    exec(compile(generate_stub_module(tools.values()), "tools/__init__.py", "exec"), module.__dict__)
    found = []
    for binder, _ in module._ptc_toolbox._stubs:
        parameters = tuple(
            (name, p.default is inspect.Parameter.empty) for name, p in binder.signature.parameters.items()
        )
        found.append((binder.tool, binder.path, parameters, binder.renames, binder.first_takes_object))
    return found


def listed(entries: list[dict[str, Any]]) -> list[tuple[str, str, tuple[tuple[str, bool], ...], dict[str, str], bool]]:
    return [
        (t.tool, t.path, t.parameters, t.renames, t.first_takes_object)
        for t in stub_tools(parse_manifest(entries).values())
    ]


def test_hostile_names_are_described_as_the_module_declares_them() -> None:
    assert sorted(listed(HOSTILE)) == sorted(described(HOSTILE))
    stubs = type_stubs(parse_manifest(HOSTILE).values())
    ast.parse(stubs)
    assert "class ToolError(Exception):" in stubs and "async def deep(" in stubs
    assert "ToolError(Exception)" not in type_stubs(parse_manifest(HOSTILE).values(), tool_error=False)


def test_every_bfcl_function_schema_is_described_as_the_module_declares_it() -> None:
    entries: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for stem, entry_id, doc in iter_function_docs():
        entries.setdefault((stem, entry_id), []).append({**doc, "endpoint": ECHO})
    for key, docs in entries.items():
        assert sorted(listed(docs)) == sorted(described(docs)), key
        ast.parse(type_stubs(parse_manifest(docs).values()))
    assert len(entries) > 2_000
