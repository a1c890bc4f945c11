"""Stub generation: typed signatures, names, docstrings, and every BFCL v4 function schema."""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from service.toolkit.manifest import parse_manifest
from service.toolkit.stubs import generate_stub_module
from tests.bfcl_data import iter_function_docs

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "sandbox_image"))


ECHO = {"kind": "echo"}


def load(entries: list[dict[str, Any]]) -> types.ModuleType:
    """Generate the tools module for ``entries`` and import it (without a broker)."""
    source = generate_stub_module(parse_manifest(entries).values())
    module = types.ModuleType("tools")
    exec(compile(source, "tools/__init__.py", "exec"), module.__dict__)
    return module


def lookup(root: Any, path: str) -> Any:
    """The stub at ``path``; for a tool that is also a namespace, the namespace's ``__call__`` stub."""
    node = functools.reduce(getattr, path.split("."), root)
    return vars(node).get("__call__", node) if isinstance(node, type) or type(node).__name__ == "Namespace" else node


def test_signature_required_first_then_optional_with_defaults() -> None:
    tools = load(
        [
            {
                "name": "book",
                "description": "Book a room.",
                "parameters": {
                    "type": "dict",
                    "properties": {
                        "nights": {"type": "integer", "default": 1, "description": "How many nights."},
                        "city": {"type": "string", "description": "Where."},
                        "view": {"type": "string", "enum": ["sea", "garden"]},
                        "guests": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["city"],
                },
                "endpoint": ECHO,
            }
        ]
    )
    sig = inspect.signature(tools.book)
    assert list(sig.parameters) == ["city", "nights", "view", "guests"]
    assert str(sig) == (
        "(city: 'str', nights: 'int' = 1, view: \"Literal['sea', 'garden'] | None\" = None, "
        "guests: 'list[str] | None' = None) -> 'Any'"
    )
    assert tools.book.__doc__.startswith("Book a room.")
    assert "city: Where." in tools.book.__doc__ and "nights: How many nights." in tools.book.__doc__
    assert inspect.signature(tools.aio.book) == sig


def test_only_passed_arguments_are_sent_with_original_names() -> None:
    tools = load(
        [
            {
                "name": "mail.send",
                "parameters": {
                    "type": "object",
                    "properties": {"from": {"type": "string"}, "Content-Type": {}, "cc": {}},
                    "required": ["from"],
                },
                "endpoint": ECHO,
            }
        ]
    )
    binder = tools.mail.send._binder
    assert binder.bind(("a",), {}) == {"from": "a"}
    assert binder.bind((), {"from_": "a", "Content_Type": "t"}) == {"from": "a", "Content-Type": "t"}
    assert binder.bind((), {"from": "a", "Content-Type": "t", "cc": None}) == {
        "from": "a",
        "Content-Type": "t",
        "cc": None,
    }
    assert binder.bind((), {"bogus": 1}) == {"bogus": 1}  # forwarded: the broker refuses it, with a record
    with pytest.raises(TypeError):
        binder.bind((), {"from": "a", "from_": "b"})
    assert lookup(tools, "aio.mail.send")._binder is not None


def test_hostile_names_and_descriptions_compile_and_stay_text() -> None:
    evil = '"""\nimport os; os.system("x")\n"""\\'
    tools = load(
        [
            {
                "name": "class",
                "description": evil,
                "parameters": {"properties": {"def": {"description": evil}}},
                "endpoint": ECHO,
            },
            {"name": "aio", "endpoint": ECHO},
            {"name": "ToolError", "endpoint": ECHO},
            {"name": "9lives.x-y", "endpoint": ECHO},
            {"name": "ns", "endpoint": ECHO},
            {"name": "ns.inner", "endpoint": ECHO},
            {"name": "_ptc_toolbox", "endpoint": ECHO},
        ]
    )
    assert inspect.getdoc(tools.class_).startswith(evil)  # type: ignore[union-attr]
    assert list(inspect.signature(tools.class_).parameters) == ["def_"]
    assert tools.aio_._binder.tool == "aio" and tools.ToolError_._binder.tool == "ToolError"
    assert issubclass(tools.ToolError, Exception)
    assert tools._9lives.x_y._binder.tool == "9lives.x-y"
    assert tools.ns.inner._binder.tool == "ns.inner" and tools.ns.__call__._binder.tool == "ns"
    assert tools._ptc_toolbox_._binder.tool == "_ptc_toolbox"


def test_async_stub_is_awaitable_and_fails_cleanly_without_broker() -> None:
    tools = load([{"name": "t", "endpoint": ECHO}])
    with pytest.raises(tools.ToolError) as info:
        asyncio.run(tools.aio.t())
    assert info.value.type == "broker_unavailable"


def test_every_bfcl_function_schema_yields_a_stub() -> None:
    """About 8,700 real schemas (BFCL v4, non-multi-turn): each entry's module compiles and exposes each tool."""
    entries: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for stem, entry_id, doc in iter_function_docs():
        entries.setdefault((stem, entry_id), []).append(doc)
    count = 0
    for (stem, entry_id), docs in entries.items():
        try:
            tools = load([{**doc, "endpoint": ECHO} for doc in docs])
        except Exception as exc:  # pragma: no cover - the message names the entry
            raise AssertionError(f"{stem} {entry_id}: {exc}") from exc
        for doc in docs:
            assert lookup(tools, doc["name"])._binder.tool == doc["name"], (stem, entry_id)
            assert lookup(tools.aio, doc["name"])._binder.tool == doc["name"], (stem, entry_id)
            count += 1
    assert count > 8_000


def test_tool_named_like_a_namespace_is_callable_there() -> None:
    tools = load(
        [
            {
                "name": "auth",
                "parameters": {"properties": {"user": {"type": "string"}}, "required": ["user"]},
                "endpoint": ECHO,
            },
            {"name": "auth.login", "endpoint": ECHO},
        ]
    )
    assert tools.auth.__call__._binder.tool == "auth"
    assert tools.auth.login._binder.tool == "auth.login"
    assert tools.aio.auth.__call__._binder.tool == "auth"
    with pytest.raises(tools.ToolError):  # reaches the stub (no broker here), not a TypeError
        tools.auth(user="x")
    with pytest.raises(tools.ToolError):
        asyncio.run(tools.aio.auth(user="x"))


def test_special_and_private_names_neither_break_nor_hijack_the_module() -> None:
    names = [
        "x.__qualname__",
        "x.__slots__",
        "x.__dict__",
        "x.__class__",
        "x.__private",
        "__class__",
        "__all__",
        "__getattr__",
        "__get_all_users",
    ]
    tools = load(
        [{"name": n, "endpoint": ECHO} for n in names]
        + [{"name": "y.z", "parameters": {"properties": {"__secret": {}}}, "endpoint": ECHO}]
    )
    assert tools.x._qualname__._binder.tool == "x.__qualname__"
    assert tools.x._slots__._binder.tool == "x.__slots__"
    assert tools.x._private._binder.tool == "x.__private"
    assert tools._class__._binder.tool == "__class__"
    assert tools._all__._binder.tool == "__all__" and "aio" in tools.__all__
    assert tools._getattr__._binder.tool == "__getattr__"
    assert tools.__get_all_users._binder.tool == "__get_all_users"  # top level: not mangled, kept
    assert list(inspect.signature(tools.y.z).parameters) == ["_secret"]
    assert tools.y.z._binder.bind((), {"_secret": 1}) == {"__secret": 1}
    with pytest.raises(AttributeError):
        tools.no_such_tool  # noqa: B018 - a misspelling is not hijacked by a __getattr__ tool


def test_recursive_refs_and_huge_schemas_degrade_to_any() -> None:
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}},
    }
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"type": "object", "properties": {"v": {"type": "integer"}}} for i in range(600)},
    }
    tools = load(
        [{"name": "walk", "parameters": tree, "endpoint": ECHO}, {"name": "wide", "parameters": wide, "endpoint": ECHO}]
    )
    assert str(inspect.signature(tools.walk)) == "(root: 'Any' = None) -> 'Any'"
    assert len(inspect.signature(tools.wide).parameters) == 600  # past 500 shapes, plain dict[str, Any]
    assert "dict[str, Any]" in str(inspect.signature(tools.wide).parameters["p599"])


class Recorder:
    """Stands in for the broker client: keeps each request body, answers its arguments."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def request(self, body: dict[str, Any]) -> Any:
        self.bodies.append(body)
        return body["args"]

    async def arequest(self, body: dict[str, Any]) -> Any:
        return self.request(body)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    import ptc_runtime.stubs

    recorder = Recorder()
    monkeypatch.setattr(ptc_runtime.stubs, "client", lambda: recorder)
    return recorder


EXPENSES = {
    "name": "get_expenses",
    "parameters": {
        "type": "object",
        "properties": {"employee_id": {"type": "integer"}, "quarter": {"type": "string"}},
        "required": ["employee_id", "quarter"],
    },
    "endpoint": ECHO,
}


def test_a_lone_positional_dict_is_the_arguments_when_the_first_parameter_cannot_take_one(recorder: Recorder) -> None:
    tools = load(
        [
            EXPENSES,
            {"name": "configure", "parameters": {"properties": {"settings": {"type": "object"}}}, "endpoint": ECHO},
            {"name": "anything", "parameters": {"properties": {"value": {}}}, "endpoint": ECHO},
            {"name": "mail.send", "parameters": {"properties": {"from": {"type": "string"}}}, "endpoint": ECHO},
            {"name": "ping", "endpoint": ECHO},
        ]
    )
    arguments = {"employee_id": 1, "quarter": "Q3"}
    repaired = {"tool": "get_expenses", "args": arguments, "repair": "positional_dict"}
    assert tools.get_expenses(dict(arguments)) == arguments
    assert asyncio.run(tools.aio.get_expenses(dict(arguments))) == arguments
    as_global = tools._ptc_toolbox.script_globals()["get_expenses"]
    assert as_global(dict(arguments)) == arguments  # blocking, outside a loop

    async def awaited() -> Any:
        return await as_global(dict(arguments))

    assert asyncio.run(awaited()) == arguments
    assert recorder.bodies == [repaired] * 4
    recorder.bodies.clear()
    # the ordinary meaning: the first parameter can take the dict, or the call is not a lone positional dict
    tools.configure({"verbose": True})
    tools.anything({"k": 1})
    tools.get_expenses({"employee_id": 1}, quarter="Q3")
    tools.get_expenses(employee_id={"k": 1}, quarter="Q3")
    tools.get_expenses({1: "one"})  # not string keys: not arguments
    assert recorder.bodies == [
        {"tool": "configure", "args": {"settings": {"verbose": True}}},
        {"tool": "anything", "args": {"value": {"k": 1}}},
        {"tool": "get_expenses", "args": {"employee_id": {"employee_id": 1}, "quarter": "Q3"}},
        {"tool": "get_expenses", "args": {"employee_id": {"k": 1}, "quarter": "Q3"}},
        {"tool": "get_expenses", "args": {"employee_id": {1: "one"}}},
    ]
    recorder.bodies.clear()
    # the dict's keys are bound like keywords: original and Python names, unknown ones forwarded for the broker
    tools.mail.send({"from": "a@x"})
    tools.mail.send({"from_": "a@x"})
    tools.ping({})
    tools.get_expenses({"employee": 1})
    assert [(b["args"], b.get("repair")) for b in recorder.bodies] == [
        ({"from": "a@x"}, "positional_dict"),
        ({"from": "a@x"}, "positional_dict"),
        ({}, "positional_dict"),
        ({"employee": 1}, "positional_dict"),
    ]


def test_the_generator_marks_the_tools_whose_first_parameter_takes_an_object() -> None:
    source = generate_stub_module(
        parse_manifest(
            [EXPENSES, {"name": "configure", "parameters": {"properties": {"settings": {}}}, "endpoint": ECHO}]
        ).values()
    )
    assert "@_ptc_toolbox.tool('get_expenses')\n" in source
    assert "@_ptc_toolbox.tool('configure', first_takes_object=True)\n" in source


@pytest.mark.parametrize("order", [1, -1])
def test_a_signature_name_always_means_its_own_parameter(order: int, recorder: Recorder) -> None:
    props = {"content-type": {"type": "string"}, "content_type": {"type": "string"}, "from": {}, "from_": {}}
    tools = load(
        [
            {"name": "req", "parameters": {"properties": dict(list(props.items())[::order])}, "endpoint": ECHO},
            {"name": "ns.req", "parameters": {"properties": {"__x": {}, "_x": {}}}, "endpoint": ECHO},
        ]
    )
    assert sorted(inspect.signature(tools.req).parameters) == ["content_type", "content_type_", "from_", "from__"]
    doc = tools.req.__doc__
    assert "content_type_ ('content-type'):" in doc and "from__ ('from'):" in doc and "    content_type:" in doc
    binder = tools.req._binder
    assert binder.bind((), {"content_type": "A"}) == {"content_type": "A"}  # as the stub documents it
    assert binder.bind((), {"content_type_": "B"}) == {"content-type": "B"}
    assert binder.bind((), {"content_type": "A", "content_type_": "B"}) == {"content_type": "A", "content-type": "B"}
    assert binder.bind((), {"content-type": "B", "content_type": "A"}) == {"content-type": "B", "content_type": "A"}
    assert binder.bind((), {"from_": 1}) == {"from_": 1}
    assert binder.bind((), {"from": 1, "from_": 2}) == {"from": 1, "from_": 2}
    assert binder.bind((), {"from__": 1, "from_": 2}) == {"from": 1, "from_": 2}
    with pytest.raises(TypeError):  # one parameter, twice
        binder.bind((), {"from": 1, "from__": 2})
    tools.req(content_type="A", content_type_="B")
    asyncio.run(tools.aio.req(content_type="A"))
    assert [b["args"] for b in recorder.bodies] == [{"content_type": "A", "content-type": "B"}, {"content_type": "A"}]
    inner = tools.ns.req._binder  # in a namespace (a class body) a leading "__" is renamed, and the same rule holds
    assert sorted(inner.signature.parameters) == ["_x", "_x_"]
    assert inner.bind((), {"_x": 1, "__x": 2}) == {"_x": 1, "__x": 2}
