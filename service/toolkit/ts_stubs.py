"""TypeScript declarations of a manifest's tools, for a model that writes its script in JavaScript or TypeScript.

The form Cloudflare's Code Mode gives its models: ``declare module "tools"`` (an interface per object schema, a
typed async function per tool, the ``tools`` object), then the globals. It declares, for the tools a script may call
(``callable_from_code``), the module the runtime imports (``toolkit.js_stubs``, ``ptc_runtime/js/tools.mjs``'s
``makeTools``; docs/tools-and-manifests.md, "JavaScript and TypeScript"):

- the default export ``tools``: every tool by its original name (``tools["get-user"]``); a dotted name of non-empty
  segments also as a path of namespaces (``tools.math.factorial``), each the tool of that name where there is one
  (``tools.auth(...)`` beside ``tools.auth.login(...)``; it keeps its own ``length`` and ``name``);
- named exports: ``ToolError`` and what ``js_stubs.exported_names`` exports; globals: ``tools``, ``ToolError`` and
  the exports that are no global of Node's (``GLOBALS``: the runtime does not replace those);
- a tool takes one object of arguments (``args?`` when none is required) and returns a Promise of its result (the
  output schema's type, else ``any``); a failed call rejects with ``ToolError``.

Types as ``schema.python_type`` makes Python's: enums and ``const`` as literals, ``T[]``, tuples (``prefixItems``),
unions (``anyOf``/``oneOf``, type lists, nullable); a local ``$ref`` is followed once per target (a recursive object
is a recursive interface), any other is ``any``. Bounded: ``MAX_DEPTH`` levels, ``MAX_INTERFACES`` interfaces
besides the tools' ``...Args`` (then ``{ [key: string]: any }``), ``MAX_TYPE_CHARS`` a type, ``MAX_DOC_CHARS`` a
comment. Nothing from the manifest can end a string or a comment early: names are JSON string literals (ASCII,
escaped), ``*/`` in a comment becomes ``*\\/``, and interface names are identifiers made from the names.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from service.errors import InvalidField
from service.toolkit.js_stubs import IDENTIFIER, RESERVED, exported_names
from service.toolkit.schema import MAX_DEPTH, JsonSchema, _local_ref, _types_of, stub_parameters
from service.toolkit.specs import ToolSpec
from service.toolkit.stubs import MAX_DOC_CHARS, MAX_TYPED_DICTS

_COMMON = """\
Every tool takes ONE object of named arguments and returns a Promise of its JSON result (see the declarations).
`import tools from "tools"` has every tool by its name: `await tools["get-user"]({ id: 7 })`. A tool whose name
is an identifier is also a named export and a global: `import { get_weather } from "tools"`, or just
`await get_weather({ city: "Oslo" })`, unless it is a JavaScript keyword or global (`tools.fetch(...)` only).
Dotted names are namespaces too: `tools.math.factorial({ n: 5 })` is `tools["math.factorial"]({ n: 5 })`.
For many calls at once use `await Promise.all([...])`: the calls run concurrently. A failed call rejects with a
`ToolError` (`import { ToolError } from "tools"`) with `.type` and `.message`; catch it to recover or report.
Only what you print (`console.log`) is returned to you: print the answer, not raw tool results.
"""

JS_USAGE = "Write the script as a JavaScript ES module; top-level `await` works.\n" + _COMMON
"""The usage text for a model's system prompt when its scripts are JavaScript (``POST /stubs``, ``language``)."""

TS_USAGE = "Write the script as a TypeScript ES module; top-level `await` works.\n" + _COMMON
"""The usage text for a model's system prompt when its scripts are TypeScript."""

GLOBALS = frozenset(
    # In Node's globalThis (18 to 22, ES modules; ``Object.getOwnPropertyNames``), and Object.prototype's members.
    """AbortController AbortSignal AggregateError Array ArrayBuffer Atomics BigInt BigInt64Array BigUint64Array Blob
    Boolean BroadcastChannel Buffer ByteLengthQueuingStrategy CompressionStream CountQueuingStrategy Crypto CryptoKey
    CustomEvent DOMException DataView Date DecompressionStream Error EvalError Event EventTarget File
    FinalizationRegistry Float32Array Float64Array FormData Function Headers Int16Array Int32Array Int8Array Intl JSON
    Iterator Map Math MessageChannel MessageEvent MessagePort Navigator Number Object Performance PerformanceEntry
    PerformanceMark PerformanceMeasure PerformanceObserver PerformanceObserverEntryList PerformanceResourceTiming
    Promise Proxy RangeError ReadableByteStreamController ReadableStream ReadableStreamBYOBReader
    ReadableStreamBYOBRequest ReadableStreamDefaultController ReadableStreamDefaultReader ReferenceError Reflect RegExp
    Request Response Set SharedArrayBuffer Storage String SubtleCrypto Symbol SyntaxError TextDecoder TextDecoderStream
    TextEncoder TextEncoderStream TransformStream TransformStreamDefaultController TypeError URIError URL
    URLSearchParams Uint16Array Uint32Array Uint8Array Uint8ClampedArray WeakMap WeakRef WeakSet WebAssembly WebSocket
    WritableStream WritableStreamDefaultController WritableStreamDefaultWriter atob btoa clearImmediate clearInterval
    clearTimeout console crypto decodeURI decodeURIComponent encodeURI encodeURIComponent escape eval fetch global
    globalThis isFinite isNaN localStorage navigator parseFloat parseInt performance process queueMicrotask
    sessionStorage setImmediate setInterval setTimeout structuredClone undefined unescape Infinity NaN constructor
    hasOwnProperty isPrototypeOf propertyIsEnumerable toLocaleString toString valueOf __proto__ __defineGetter__
    __defineSetter__ __lookupGetter__ __lookupSetter__""".split()
)
"""Names a named export is not made a global under: the runtime defines a global only where ``name in globalThis``
is false (it stays a named export and ``tools.<name>``). A superset: a global not declared is only unused."""

_TS_TYPES = frozenset("Record Partial Required Readonly Pick Omit Exclude Extract Awaited PromiseLike Iterable".split())
MAX_INLINE_REF_CHARS = 64  # a $ref target's type longer than this is an ``export type`` alias, named at each use
DECLARATIONS_RATIO = 4  # the declarations may be this many times the manifest's schemas and texts, plus the slack
DECLARATIONS_SLACK = 256 * 1024  # characters
FUNCTION_OWN = ("length", "name")  # own properties of a tool's function: no namespace member replaces them
NO_MEMBER = "then"  # makeTools makes no member of this name (a thenable would be called by await): not declared
MAX_INTERFACES = MAX_TYPED_DICTS  # interfaces of nested objects and results; each tool's ...Args is not counted
MAX_TYPE_CHARS = 2000  # a longer type (a huge union, a deep tuple) is written ``any``
MAX_ENUM = 64  # an enum of more values is written as its type
MAX_NAME_CHARS = 64  # of an interface name made from a hint, before the suffix that makes it unique
MAX_DEFAULT_CHARS = 200  # a longer default is left out of the doc comment
_LINE_BREAK = re.compile("\r\n|[\r\u2028\u2029\x85]")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x84\x86-\x9f\ud800-\udfff]")  # and lone surrogates
INDENT = "  "

APPROVAL_NOTE = (
    "A call may wait for a person's approval. Denied, it rejects with a ToolError of type 'denied' (the reason in"
    " its message); left undecided, of type 'approval_timeout'. Either way the tool did not run."
)
"""The last paragraph of the doc comment of a tool whose calls may need approval (``stubs.APPROVAL_NOTE``'s twin)."""

TOOL_ERROR = """\
/** A failed call: `type` says why (`invalid_arguments`, `timeout`, `denied`, ...), `message` what, `tool` where. */
export class ToolError extends Error {
  constructor(type: string, message: string, tool?: string);
  type: string;
  message: string;
  tool?: string;
}"""


def _string(text: str) -> str:
    """``text`` as a JavaScript string literal (JSON's, ASCII only: no character of it can end the literal)."""
    return json.dumps(text, ensure_ascii=True)


def _key(name: str) -> str:
    """A property name as written in a type: bare when an identifier, else a string literal."""
    return name if IDENTIFIER.fullmatch(name) else _string(name)


def _doc(text: str, indent: str) -> str:
    """A ``/** ... */`` comment of ``text`` (ending in a newline), or "" for no text; no text can close it early."""
    if len(text) > MAX_DOC_CHARS:
        text = text[:MAX_DOC_CHARS] + " [...]"
    text = _CONTROL.sub(" ", _LINE_BREAK.sub("\n", text)).replace("*/", "*\\/").strip()
    if not text:
        return ""
    lines = [line.rstrip() for line in text.split("\n")]
    if len(lines) == 1:
        return f"{indent}/** {lines[0]} */\n"
    return f"{indent}/**\n" + "".join(f"{indent} *{' ' + line if line else ''}\n" for line in lines) + f"{indent} */\n"


def _literal(value: Any) -> str | None:
    """A JSON scalar as a TypeScript literal type; None for an object, an array or a number JSON cannot hold."""
    if value is None or isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return json.dumps(value)
    return _string(value) if isinstance(value, str) else None


def _union(parts: Iterable[str]) -> str:
    """``A | B`` of distinct parts; ``any`` when one is; ``never`` parts dropped (unless alone)."""
    unique = list(dict.fromkeys(f"({p})" if " & " in p else p for p in parts))
    return "any" if not unique or "any" in unique else " | ".join([p for p in unique if p != "never"] or ["never"])


def _array(item: str) -> str:
    return f"({item})[]" if "|" in item or "&" in item else f"{item}[]"


def _pascal(hint: str) -> str:
    """PascalCase of the ASCII letters and digits of ``hint`` (``hotels.search_args``: ``HotelsSearchArgs``)."""
    name = "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", hint) if part)
    name = name[:MAX_NAME_CHARS] or "Tool"
    return "Tool" + name if name[0].isdigit() else name


@dataclass
class _Node:
    """A namespace of ``tools``: the tool of its full name, if any (the node is then its function), and members."""

    tool: ToolSpec | None = None
    members: dict[str, _Node] = field(default_factory=dict)


def _namespaces(tools: list[ToolSpec]) -> tuple[dict[str, _Node], dict[str, _Node]]:
    """The namespaces of the dotted names as ``makeTools`` builds them (module doc): by first segment, and by path."""
    by_name = {spec.name: spec for spec in tools}
    roots: dict[str, _Node] = {}
    paths: dict[str, _Node] = {}
    for spec in tools:
        parts = spec.name.split(".")
        if len(parts) < 2 or not all(parts):
            continue
        members, parent = roots, _Node()
        for i, part in enumerate(parts):
            if (parent.tool is not None and part in FUNCTION_OWN) or part == NO_MEMBER:
                break  # makeTools leaves the function's own property (and makes no "then"): the path stops there
            path = ".".join(parts[: i + 1])
            node = paths[path] = members.setdefault(part, _Node(by_name.get(path)))
            members, parent = node.members, node
    return roots, paths


class _Writer:
    """The declarations of one manifest: interfaces as they are needed, then the module around them."""

    def __init__(self, values: Iterable[str]) -> None:
        self.interfaces: list[str] = []
        self._shapes = 0  # interfaces counted against MAX_INTERFACES
        self._taken: set[str] = set(RESERVED | GLOBALS | _TS_TYPES) | set(values)  # no interface named like a value
        self._tool = ""  # the name of the tool whose schemas are being written
        self._refs: dict[int, str] = {}  # id of a schema of this root -> its type (a name once it has one)
        self._documented: set[str] = set()

    def _unique(self, hint: str) -> str:
        """An interface name from ``hint`` that nothing else has: ``Name``, else ``Name2``, ``Name3``..."""
        base = name = _pascal(hint)
        for number in itertools.count(2):
            if name not in self._taken:
                break
            name = f"{base}{number}"
        self._taken.add(name)
        return name

    def signature(self, spec: ToolSpec) -> tuple[str, str]:
        """``(args: XArgs)`` (``args?`` when nothing is required) and ``Promise<R>`` of a tool."""
        self._refs, self._tool = {}, spec.name
        args = self._interface(spec.parameters, self._unique(f"{spec.name}_args"), 0, spec.name, spec.parameters)
        required = any(isinstance(r, str) for r in spec.parameters.get("required") or [])
        self._refs, output = {}, spec.output_schema
        returns = "any" if output is None else self._type(output, 0, f"{spec.name}_result", output)
        return f"(args{'' if required else '?'}: {args})", f"Promise<{returns}>"

    def doc(self, spec: ToolSpec | None, indent: str) -> str:
        """The tool's doc comment at its first place in the declarations; "" at the others."""
        if spec is None or spec.name in self._documented:
            return ""
        self._documented.add(spec.name)
        note = APPROVAL_NOTE if spec.approval is not None else ""
        return _doc("\n\n".join(part for part in (spec.description.strip(), note) if part), indent)

    def _interface(self, schema: JsonSchema, name: str, depth: int, hint: str, root: JsonSchema) -> str:
        """Write ``export interface <name>`` for an object schema (its properties, required or ``?``, and an index
        signature when ``additionalProperties`` is ``true`` or a schema); returns ``name``."""
        self._refs[id(schema)] = name  # a $ref back to this schema (recursion) is this interface
        slot = len(self.interfaces)
        self.interfaces.append("")  # the parent before the interfaces its members add
        props = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        required = {r for r in schema.get("required") or [] if isinstance(r, str)}
        members: list[str] = []
        types: list[str] = []
        for key in stub_parameters(schema):
            sub = props.get(key, True)
            member_type = self.type_of(sub, depth + 1, f"{hint}_{key}", root)
            types += [member_type] if key in required else [member_type, "undefined"]
            members.append(_doc(_member_doc(sub), INDENT * 2))
            members.append(f"{INDENT * 2}{_key(key)}{'' if key in required else '?'}: {member_type};\n")
        extra = schema.get("additionalProperties")
        if extra is True or isinstance(extra, dict):
            value = self.type_of(extra, depth + 1, f"{hint}_value", root) if isinstance(extra, dict) else "any"
            value = _union([value, *types])  # every member must fit the index signature
            members.append(f"{INDENT * 2}[key: string]: {value if len(value) <= MAX_TYPE_CHARS else 'any'};\n")
        body = f"\n{''.join(members)}{INDENT}" if members else ""
        self.interfaces[slot] = f"{INDENT}export interface {name} {{{body}}}\n"
        return name

    def type_of(self, schema: Any, depth: int, hint: str, root: JsonSchema) -> str:
        """The TypeScript type of a schema (``any`` past ``MAX_TYPE_CHARS``)."""
        text = self._type(schema, depth, hint, root)
        return text if len(text) <= MAX_TYPE_CHARS else "any"

    def _type(self, schema: Any, depth: int, hint: str, root: JsonSchema) -> str:
        if schema is False:
            return "never"
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return "any"
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self._ref(ref, depth, hint, root)
        if "const" in schema and (literal := _literal(schema["const"])) is not None:
            return literal
        enum = schema.get("enum")
        if isinstance(enum, list) and 0 < len(enum) <= MAX_ENUM:
            literals = [_literal(v) for v in enum]
            if all(literal is not None for literal in literals):
                return _union(literal for literal in literals if literal is not None)
        types = _types_of(schema)
        if not types:
            for key in ("anyOf", "oneOf"):
                variants = schema.get(key)
                if isinstance(variants, list) and variants:
                    return _union(self._type(v, depth + 1, f"{hint}_option", root) for v in variants)
            branches = schema.get("allOf")
            if isinstance(branches, list) and branches:
                parts = [self._type(b, depth + 1, hint, root) for b in branches]
                kept = list(dict.fromkeys(p if " | " not in p else f"({p})" for p in parts if p != "any"))
                return " & ".join(kept) if kept else "any"
            if not isinstance(schema.get("properties"), dict):
                return "any"
            types = ["object"]  # properties without a type: an object, as a manifest means it
        parts = [self._of_type(t, schema, depth, hint, root) for t in types]
        if schema.get("nullable") is True:  # OpenAPI's spelling
            parts.append("null")
        return _union(parts)

    def _of_type(self, name: str, schema: JsonSchema, depth: int, hint: str, root: JsonSchema) -> str:
        if name == "array":
            prefix, items = schema.get("prefixItems"), schema.get("items")
            if isinstance(prefix, list) and prefix:
                elements = [self._type(p, depth + 1, f"{hint}_item", root) for p in prefix]
                if isinstance(items, dict):
                    elements.append("..." + _array(self._type(items, depth + 1, f"{hint}_item", root)))
                return f"[{', '.join(elements)}]"
            if isinstance(items, dict):
                return _array(self._type(items, depth + 1, f"{hint}_item", root))
            return "any[]"
        if name == "object":
            return self._object(schema, depth, hint, root)
        return {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}.get(name, "null")

    def _object(self, schema: JsonSchema, depth: int, hint: str, root: JsonSchema) -> str:
        props = schema.get("properties")
        if isinstance(props, dict) and props and self._shapes < MAX_INTERFACES:
            self._shapes += 1
            return self._interface(schema, self._unique(hint), depth, hint, root)
        extra = schema.get("additionalProperties")
        value = self._type(extra, depth + 1, f"{hint}_value", root) if isinstance(extra, dict) else "any"
        return f"{{ [key: string]: {value} }}"

    def _ref(self, ref: str, depth: int, hint: str, root: JsonSchema) -> str:
        """A local ``$ref``'s type, rendered once per target (a cycle through a non-object is ``any``)."""
        target = _local_ref(ref, root)
        if target is None:
            return "any"
        known = self._refs.get(id(target))
        if known is not None:
            return known
        self._refs[id(target)] = "any"  # while it is being rendered
        hint = f"{self._tool}_{ref.rsplit('/', 1)[-1]}" if "/" in ref else hint
        text = self._type(target, depth + 1, hint, root)
        if len(text) > MAX_TYPE_CHARS:
            text = "any"
        elif len(text) > MAX_INLINE_REF_CHARS and not IDENTIFIER.fullmatch(text):  # written once, named at each use
            name = self._unique(hint)
            self.interfaces.append(f"{INDENT}export type {name} = {text};\n")
            text = name
        self._refs[id(target)] = text
        return text


def _member_doc(schema: Any) -> str:
    """A property's doc comment text: its description and its default (``@default``)."""
    if not isinstance(schema, dict):
        return ""
    description = schema.get("description")
    text = description if isinstance(description, str) else ""
    try:
        default = json.dumps(schema["default"], ensure_ascii=True, allow_nan=False) if "default" in schema else ""
    except (TypeError, ValueError):  # not JSON (a manifest is, but a ToolSpec may be built by hand)
        default = ""
    return text + (f"\n@default {default}" if default and len(default) <= MAX_DEFAULT_CHARS else "")


def typescript_declarations(tools: Iterable[ToolSpec]) -> str:
    """TypeScript declarations of the tools a JavaScript or TypeScript script can call (module doc).

    Args:
        tools: the manifest's tools, all of them (the runtime makes its namespaces and exports of every name).

    Returns:
        The text of a declaration file (a script, not a module: ``declare module "tools" { ... }``, then the
        globals), which ``tsc --strict`` accepts alongside a script that imports "tools"; deterministic for a
        manifest order. CPU work that grows with the schemas (bounded as the module doc says): run it off the event
        loop for a large manifest.
    """
    every = list(tools)
    budget = DECLARATIONS_SLACK + DECLARATIONS_RATIO * sum(_size(spec) for spec in every)
    callable_ = {spec.name: spec for spec in every if spec.callable_from_code and spec.name != NO_MEMBER}
    roots, paths = _namespaces(every)
    exports = [name for name in exported_names(spec.name for spec in every) if name in callable_ or name in roots]
    writer = _Writer(exports)
    signatures = {name: writer.signature(spec) for name, spec in callable_.items()}
    functions = {name: f"{params} => {returns}" for name, (params, returns) in signatures.items()}

    def node_type(node: _Node, indent: str) -> str | None:
        """A node's type: its callable tool's function, its members' object, or both; None: nothing to call there."""
        inner, members = indent + INDENT, ""
        for segment, child in node.members.items():
            if (child_type := node_type(child, inner)) is not None:
                doc = writer.doc(callable_.get(child.tool.name) if child.tool else None, inner)
                members += f"{doc}{inner}{_key(segment)}: {child_type};\n"
        function = functions.get(node.tool.name) if node.tool is not None else None
        if function and members:
            return f"({function}) & {{\n{members}{indent}}}"
        return function or (f"{{\n{members}{indent}}}" if members else None)

    parts, declared = list(writer.interfaces), []
    for name in exports:
        spec, node = callable_.get(name), roots.get(name)
        typed = node_type(node, INDENT) if node is not None else functions.get(name)
        if typed is None:
            continue  # nothing callable under this export
        declared.append(name)
        if spec is not None and typed == functions[name]:
            params, returns = signatures[name]
            parts.append(f"{writer.doc(spec, INDENT)}{INDENT}export function {name}{params}: {returns};\n")
        else:
            doc = writer.doc(spec, INDENT) or f"{INDENT}/** Tools named {name}.* */\n"
            parts.append(f"{doc}{INDENT}export const {name}: {typed};\n")
    members = []
    for name, spec in callable_.items():  # a dotted tool's function has its namespace's members too
        node = paths.get(name)
        typed = f"typeof {name}" if name in declared else (node_type(node, INDENT * 2) if node else functions[name])
        members.append(f"{writer.doc(spec, INDENT * 2)}{INDENT * 2}{_string(name)}: {typed};\n")
    for name, node in roots.items():  # the namespaces no tool is named like (those are above)
        typed = None if name in callable_ else f"typeof {name}" if name in declared else node_type(node, INDENT * 2)
        if typed is not None:
            members.append(f"{INDENT * 2}{_key(name)}: {typed};\n")
    parts.append(
        f"{INDENT}/** Every tool by its name; dotted names' namespaces too. */\n"
        f"{INDENT}const tools: {{\n{''.join(members)}{INDENT}}};\n{INDENT}export default tools;\n"
    )
    parts.append("".join(f"{INDENT}{line}\n" for line in TOOL_ERROR.split("\n")))
    values = {"tools": "default", "ToolError": "ToolError", **{n: n for n in declared if n not in GLOBALS}}
    globals_ = [f'declare const {name}: typeof import("tools").{value};\n' for name, value in values.items()]
    text = (
        "// Tools for this script (generated by ptc-sandbox from the job's manifest).\n"
        'declare module "tools" {\n' + "\n".join(parts) + "}\n\n"
        "// Globals too, without the import: tools, ToolError and the named exports that are no global of Node.\n"
        + "".join(globals_)
    )
    if len(text) > budget:
        raise InvalidField(
            f"the TypeScript declarations of these tools would take {len(text)} characters, more than "
            f"{DECLARATIONS_RATIO} times their schemas and descriptions: simplify the schemas",
            ("body", "tools"),
        )
    return text


def _size(spec: ToolSpec) -> int:
    """What a tool's declarations are measured against (characters): its name, description and schemas as JSON."""
    schemas = json.dumps([spec.parameters, spec.output_schema], ensure_ascii=False, default=str)  # lone surrogates too
    return len(spec.name) + len(spec.description) + len(schemas)
