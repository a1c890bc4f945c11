"""Checks of a tool's schemas when its manifest is parsed: what a schema may hold, and what checking against it costs.

- ``schema_problem``: a valid Draft 2020-12 JSON Schema (the metaschema; verdicts of property schemas cached);
- ``refuse_unbounded_patterns``, ``refuse_invalid_patterns``: patterns cheap to compile (``pattern_cost``), and
  valid where an invalid one would let calls through;
- ``cheap_schema``: whether a small instance may be checked against it on the event loop.

Every check counts against the running compile's CPU budget (``service.toolkit.validation.tick``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema
import orjson
import regex

from service.errors import ManifestError
from service.toolkit.keywords import PATTERN_SHOWN
from service.toolkit.schema import JsonSchema
from service.toolkit.validation import budgeted, tick

MAX_PATTERN_COST = 20_000  # a pattern's size with its counted repeats' mandatory copies unrolled (pattern_cost)
MAX_PATTERNS_COST = 200_000  # the same, summed over a schema's patterns
MAX_PATTERN_GROUPS_DEPTH = 100  # groups nested in a pattern (deeper: the compiler's recursion limit)

# The metaschema check of a manifest's schemas counts against the compile's CPU budget too (service.toolkit.cache).
_MetaValidator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator,
    {name: budgeted(fn) for name, fn in jsonschema.Draft202012Validator.VALIDATORS.items()},
)
_META_VALIDATOR = _MetaValidator(jsonschema.Draft202012Validator.META_SCHEMA)
META_CACHED = 4096  # distinct property schemas whose metaschema verdict is kept (by SHA-256 of canonical JSON)
_META_VERDICTS: OrderedDict[bytes, tuple[str, str] | None] = OrderedDict()
_META_LOCK = threading.Lock()


def schema_problem(schema: Any) -> tuple[str, str] | None:
    """Why ``schema`` is not a valid Draft 2020-12 JSON Schema, as ``(where, message)``, or None.

    Checking against the metaschema costs about 1 ms of CPU per property schema (jsonschema resolves its
    ``$dynamicRef``s in Python); manifests repeat the same property schemas across tools, so each property's
    schema is checked once and its verdict kept (``META_CACHED`` of them), and the object around them is
    checked with no properties. The check counts against the running compile's CPU budget (``tick``).
    ``where`` is a ``/``-joined path (empty: the top).
    """
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        return _meta_problem(schema)
    outer = _meta_problem({**schema, "properties": {}})  # even an empty schema costs ~1 ms to check
    if outer is not None:
        return outer
    for name, sub in properties.items():
        inner = _cached_meta_problem(sub)
        if inner is not None:
            where, message = inner
            return "/".join(p for p in ("properties", str(name), where) if p), message
    return None


def _cached_meta_problem(schema: Any) -> tuple[str, str] | None:
    try:
        key = hashlib.sha256(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)).digest()
    except orjson.JSONEncodeError:
        return _meta_problem(schema)
    with _META_LOCK:
        if key in _META_VERDICTS:
            _META_VERDICTS.move_to_end(key)
            return _META_VERDICTS[key]
    verdict = _meta_problem(schema)
    with _META_LOCK:
        _META_VERDICTS[key] = verdict
        while len(_META_VERDICTS) > META_CACHED:
            _META_VERDICTS.popitem(last=False)
    return verdict


def _meta_problem(schema: Any) -> tuple[str, str] | None:
    error = jsonschema.exceptions.best_match(_META_VALIDATOR.iter_errors(schema))
    if error is None:
        return None
    return "/".join(str(p) for p in error.absolute_path), error.message


_QUANTIFIER = regex.compile(r"\{(\d*)(?:,(\d*))?\}")
_BRACED_ESCAPES = frozenset("pPNxuUgo")  # \p{L}, \N{name}, \x{263a}...: the braces are the escape's, no repeat


def pattern_cost(pattern: str) -> tuple[int, int]:
    """What compiling ``pattern`` costs, bounded from above without compiling it: (size, groups depth).

    ``size`` counts each atom once and multiplies a counted repeat's body (``{n}``, ``{n,m}``, ``{n,}``) by its
    least count ``n``, nested repeats by each other: ``regex`` unrolls those copies when it compiles, so
    ``(?:(?:a{1000}){1000}){10}`` (26 characters) took 8 s and 2.9 GB to compile on the review's machine and
    ``{100}`` in place of ``{10}`` more than the memory there was; ``*``, ``+``, ``?`` and ranges from 0 or 1 are
    not unrolled. Character classes and escapes count 1; the scan stops early past ``MAX_PATTERN_COST``.
    """
    frames: list[list[int]] = [[0, 0]]  # per open group: [size so far, size of its last atom]
    depth = deepest = 0
    i, end = 0, len(pattern)
    while i < end:
        frame = frames[-1]
        char = pattern[i]
        if char == "\\":
            i += 2
            if i - 1 < end and pattern[i - 1] in _BRACED_ESCAPES and i < end and pattern[i] == "{":
                close = pattern.find("}", i)
                i = end if close < 0 else close + 1
            frame[0] += 1
            frame[1] = 1
            continue
        if char == "[":
            j = i + 1
            if j < end and pattern[j] == "^":
                j += 1
            if j < end and pattern[j] == "]":
                j += 1
            while j < end and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            frame[0] += 1
            frame[1] = 1
            continue
        if char == "(":
            frames.append([0, 0])
            depth += 1
            deepest = max(deepest, depth)
            i += 1
            continue
        if char == ")" and len(frames) > 1:
            inner = max(frames.pop()[0], 1)
            depth -= 1
            frames[-1][0] += inner
            frames[-1][1] = inner
            i += 1
            continue
        if char == "{" and (quantifier := _QUANTIFIER.match(pattern, i)) is not None:
            least = max(int(quantifier.group(1) or 0), 1)
            frame[0] += frame[1] * (least - 1)
            frame[1] *= least
            if frame[0] > MAX_PATTERN_COST:
                return frame[0], deepest
            i = quantifier.end()
            continue
        if char == "|":
            frame[1] = 0
        elif char not in "*+?":
            frame[0] += 1
            frame[1] = 1
        i += 1
    return sum(f[0] for f in frames), deepest


def _keywords_used(schema: Any) -> set[str]:
    """Every object key anywhere in ``schema`` (a superset of the keywords it uses; depth already bounded)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(k for k in node if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def refuse_unbounded_patterns(schema: JsonSchema, loc: tuple[str | int, ...]) -> None:
    """jsonschema's ``unevaluatedProperties`` matches ``patternProperties`` with ``re``, which no time limit bounds
    (a pattern like ``^(a|a)+$`` would hold a check thread, and the GIL, for as long as the input makes it):
    a schema may use one or the other, not both. Nor may a pattern cost more to compile than ``pattern_cost``
    allows: no time limit bounds compiling (the time bound of ``service.toolkit.keywords`` bounds matching), nor
    its memory."""
    used = _keywords_used(schema)
    if "unevaluatedProperties" in used and "patternProperties" in used:
        raise ManifestError("a schema may not combine unevaluatedProperties with patternProperties", loc)
    total = 0
    for pattern in _patterns(schema):
        tick()
        size, depth = pattern_cost(pattern)
        total += size
        if size > MAX_PATTERN_COST or depth > MAX_PATTERN_GROUPS_DEPTH:
            raise ManifestError(
                f"the pattern {pattern[:PATTERN_SHOWN]!r} is too costly to compile: more than {MAX_PATTERN_COST} "
                f"atoms once its counted repeats are unrolled, or groups nested over {MAX_PATTERN_GROUPS_DEPTH} deep",
                loc,
            )
        if total > MAX_PATTERNS_COST:
            raise ManifestError(
                f"the schema's patterns together are too costly to compile: more than {MAX_PATTERNS_COST} atoms", loc
            )


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def _patterns(schema: JsonSchema) -> Iterator[str]:
    """Every ``pattern`` and ``patternProperties`` key in ``schema`` (not in the data of ``_DATA_KEYWORDS``)."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from (k for k in node["patternProperties"] if isinstance(k, str))
        stack.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)


def refuse_invalid_patterns(schema: JsonSchema, loc: tuple[str | int, ...]) -> None:
    """Refuse a ``pattern`` or ``patternProperties`` key that is not a valid pattern (``regex``, as the keywords' search
    compiles it; costly ones were refused before, by ``refuse_unbounded_patterns``). For an approval rule this
    must be decided here: at call time an invalid pattern is a failed match, and a rule that never matches lets
    every call through unapproved.

    Raises:
        ManifestError: names the pattern (its first ``PATTERN_SHOWN`` characters) and the compiler's message.
    """
    for pattern in _patterns(schema):
        tick()
        try:
            regex.compile(pattern)
        except (regex.error, RecursionError) as exc:
            raise ManifestError(f"invalid pattern {pattern[:PATTERN_SHOWN]!r}: {exc}", loc) from None


# A schema is cheap when none of its schemas uses one of these keywords (regular expressions, references that may
# recurse, formats, and the ``unevaluated*`` keywords, whose search for evaluated keys is unbounded) ...
COSTLY_KEYWORDS = frozenset(
    {
        "pattern",
        "patternProperties",
        "format",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contentSchema",
    }
)
CHEAP_SCHEMA_NODES = 128  # ... and it holds at most this many JSON values (keys, names, enum members: all)
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})  # name -> schema
_SCHEMA_VALUES = frozenset(
    {"items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames", "additionalItems"}
)
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})


def cheap_schema(schema: JsonSchema) -> bool:
    """Whether checking a small instance against ``schema`` is cheap enough to try on the event loop: none of
    ``COSTLY_KEYWORDS`` in any of its schemas and at most ``CHEAP_SCHEMA_NODES`` JSON values in all. Each keyword
    it uses then costs at most a walk of the schema's own values per instance member (an ``enum``'s set is built
    from at most as many), so one ``tick`` is bounded; the broker still runs such a check within a small CPU
    budget (``service.broker.dispatch.INLINE_CHECK_BUDGET_S``) and hands it to the check threads past it."""
    nodes = 0
    schemas: list[Any] = [schema]
    data: list[Any] = []  # keywords' values that are not schemas: counted only
    while schemas or data:
        if data:
            node = data.pop()
            nodes += 1
            if isinstance(node, dict):
                nodes += len(node)
                data.extend(node.values())
            elif isinstance(node, list):
                data.extend(node)
        else:
            node = schemas.pop()
            nodes += 1
            if isinstance(node, dict):
                if not COSTLY_KEYWORDS.isdisjoint(node):
                    return False
                nodes += len(node)
                for key, value in node.items():
                    if key in _SCHEMA_MAPS and isinstance(value, dict):
                        nodes += len(value)
                        schemas.extend(value.values())
                    elif key in _SCHEMA_VALUES or (key in _SCHEMA_LISTS and isinstance(value, list)):
                        schemas.extend(value if isinstance(value, list) else [value])
                    else:
                        data.append(value)
            elif isinstance(node, list):
                schemas.extend(node)
        if nodes > CHEAP_SCHEMA_NODES:
            return False
    return True
