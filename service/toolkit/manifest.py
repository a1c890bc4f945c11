"""Tool manifests: the entries a request sends, parsed into ``ToolSpec``s.

Accepted entry shapes:

- ours: ``{"name", "description", "parameters", "endpoint", ...}``;
- OpenAI function tools: ``{"type": "function", "function": {"name", "description", "parameters"}}``
  and the flat Responses form ``{"type": "function", "name", ...}``;
- Anthropic tools: ``input_schema`` in place of ``parameters``;
- MCP ``tools/list`` entries: ``inputSchema`` (and ``outputSchema``);
- BFCL function docs (``parameters`` in BFCL's dialect, see ``schema``).

``endpoint`` may sit on the entry in any of these shapes; it is required.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import jsonschema
import jsonschema._keywords as _jsonschema_keywords
import orjson
import referencing
import referencing.exceptions
import regex
from jsonschema.exceptions import ValidationError

from service import exactjson
from service.egress import header_problem, url_problem
from service.errors import CheckTooCostly, ManifestError
from service.toolkit.schema import JsonSchema, json_depth, to_json_schema
from service.toolkit.validation import budget_left, budgeted, canonical, enum_keyword, running_budget_s, tick

MAX_TOOL_NAME = 256
MAX_NAME_SEGMENTS = 16
MAX_SCHEMA_DEPTH = 64
MAX_ERRORS_EXAMINED = 50
PATTERN_TIMEOUT_S = 0.05  # one regex search (or what is left of the check's budget, if less)
PATTERN_SHOWN = 100  # characters of a pattern or value an error message shows
MAX_PATTERN_COST = 20_000  # a pattern's size with its counted repeats' mandatory copies unrolled (pattern_cost)
MAX_PATTERNS_COST = 200_000  # the same, summed over a schema's patterns
MAX_PATTERN_GROUPS_DEPTH = 100  # groups nested in a pattern (deeper: the compiler's recursion limit)
ERROR_KEYS_SHOWN = 20  # unexpected keys an error message lists
HINT_NAME_MAX = 64

# No "$ref" is ever fetched: a manifest could otherwise make the service GET any URL, and block on it.
_NO_RETRIEVAL: referencing.Registry[Any] = referencing.Registry()


def _search(pattern: str, text: str) -> bool:
    """``re.search`` semantics with a time bound (the ``regex`` module), so a pattern cannot stall the broker.

    The bound is ``PATTERN_TIMEOUT_S`` or what is left of the running check's CPU budget, if less.

    Raises:
        CheckTooCostly: the search ran out of time (the call is refused, ``limit_exceeded``), or the budget was
            already spent; a search bounded by what was left of the budget reports the budget, not its remainder.
        regex.error: ``pattern`` is not a valid pattern (the keywords below turn it into a validation error).
    """
    limit = budget_left(PATTERN_TIMEOUT_S)
    tick()
    try:
        return regex.search(pattern, text, timeout=limit) is not None
    except TimeoutError:
        budget_left(PATTERN_TIMEOUT_S)  # the check's budget is spent: say so
        budget_s = running_budget_s()
        if budget_s is not None and limit < PATTERN_TIMEOUT_S:  # the search had only what was left of the budget
            raise CheckTooCostly(budget_s) from None
        shown = pattern if len(pattern) <= PATTERN_SHOWN else pattern[:PATTERN_SHOWN] + "..."
        raise CheckTooCostly(
            limit, f"matching the pattern {shown!r} against one value took more than {limit:g} s"
        ) from None


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


def _bad_pattern(pattern: str, exc: regex.error) -> ValidationError:
    return ValidationError(f"the tool's schema has an invalid pattern {pattern[:PATTERN_SHOWN]!r}: {exc}")


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    try:
        found = _search(pattern, instance)
    except regex.error as exc:
        yield _bad_pattern(pattern, exc)
        return
    if not found:
        shown = instance if len(instance) <= PATTERN_SHOWN else instance[:PATTERN_SHOWN] + "..."
        yield ValidationError(f"{shown!r} does not match {pattern!r}")


# Keywords that loop over an instance's members count each member against the check's budget (``tick``): the
# keyword itself ticks once per call, but a loop over 100,000 keys or items costs 100,000 times more.


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            try:
                found = _search(pattern, key)
            except regex.error as exc:
                yield _bad_pattern(pattern, exc)
                return
            if found:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _extra_keys(instance: dict[str, Any], schema: Any) -> list[str] | ValidationError:
    """The keys of ``instance`` that neither ``properties`` nor ``patternProperties`` cover (regex searches bounded,
    each key counted); a ValidationError for an invalid pattern. (jsonschema's own uses ``re`` without a bound.)"""
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = []
    for key in instance:
        tick()
        if key in properties:
            continue
        try:
            if any(_search(pattern, key) for pattern in patterns):
                continue
        except regex.error as exc:
            return _bad_pattern(str(patterns), exc)
        extras.append(key)
    return extras


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    extras = _extra_keys(instance, schema)
    if isinstance(extras, ValidationError):
        yield extras
        return
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        listed = ", ".join(repr(k[:PATTERN_SHOWN]) for k in sorted(extras)[:ERROR_KEYS_SHOWN])
        more = f" and {len(extras) - ERROR_KEYS_SHOWN} more" if len(extras) > ERROR_KEYS_SHOWN else ""
        if "patternProperties" in schema:
            patterns = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            yield ValidationError(f"{listed}{more} match none of the patterns {patterns}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({listed}{more} {verb} unexpected)")


def _property_names(validator: Any, names: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for key in instance:
        tick()
        yield from validator.descend(instance=key, schema=names)


def _items(validator: Any, items: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    prefix = len(schema.get("prefixItems", []))
    extra = len(instance) - prefix
    if extra <= 0:
        return
    if items is False:
        yield ValidationError(f"expected at most {prefix} items but found {extra} extra")
        return
    for index in range(prefix, len(instance)):
        tick()
        yield from validator.descend(instance=instance[index], schema=items, path=index)


def _contains(validator: Any, contains: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    tick(len(instance) if validator.is_type(instance, "array") else 1)
    keyword: Any = _jsonschema_keywords.contains
    yield from keyword(validator, contains, instance, schema)


def _unevaluated(name: str) -> Any:
    """jsonschema's ``unevaluatedItems`` / ``unevaluatedProperties``, every member counted first. (Their search for
    evaluated keys uses ``re`` without a bound: a manifest may not combine them with ``patternProperties``.)"""
    keyword = getattr(_jsonschema_keywords, name)

    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        tick(len(instance) if isinstance(instance, (list, dict)) else 1)
        yield from keyword(validator, value, instance, schema)

    return counted


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """uniqueItems in linear time (jsonschema's own compares every pair)."""
    if unique and validator.is_type(instance, "array"):
        seen: set[Any] = set()
        for item in instance:
            tick()  # an item's canonical form costs its size: count it against the check's budget
            key = canonical(item, counted=True)
            if key in seen:
                yield ValidationError(f"{item!r} appears more than once; items must be unique")
                return
            seen.add(key)


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """jsonschema's ``multipleOf``, exact (``Fraction``) where it would convert an integer past a float's range
    (10**400 against 0.5: jsonschema raises OverflowError, and the call failed as the service's fault)."""
    keyword: Any = _jsonschema_keywords.multipleOf
    try:
        yield from keyword(validator, divisor, instance, schema)
    except (OverflowError, ValueError):  # ValueError: a NaN quotient (an infinite divisor: the API's reader lets
        # ``Infinity``, ``NaN`` and ``1e400`` into a tool's schema, and the meta-schema's exclusiveMinimum passes NaN)
        try:
            failed = (Fraction(instance) / Fraction(divisor)).denominator != 1
        except (OverflowError, ValueError):  # an infinite or NaN float: a multiple of nothing
            failed = True
        if failed:
            yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


_KEYWORDS: dict[str, Any] = {
    **jsonschema.Draft202012Validator.VALIDATORS,
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "propertyNames": _property_names,
    "items": _items,
    "contains": _contains,
    "unevaluatedItems": _unevaluated("unevaluatedItems"),
    "unevaluatedProperties": _unevaluated("unevaluatedProperties"),
    "uniqueItems": _unique_items,
    "enum": enum_keyword,
    "multipleOf": _multiple_of,
}
# Every keyword counts against the CPU budget of the check it runs in (service.toolkit.validation).
Validator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {name: budgeted(fn) for name, fn in _KEYWORDS.items()}
)
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


@dataclass(frozen=True)
class Endpoint:
    """Where a tool's calls go.

    Attributes:
        kind: ``echo`` (answer ``{"tool", "args"}`` without contacting anything),
            ``http`` (POST the arguments as a JSON object to ``url``) or
            ``mcp`` (MCP ``tools/call`` of ``tool`` on the MCP server at ``url``, Streamable HTTP).
        url: for ``http`` and ``mcp``, the absolute http(s) URL.
        headers: for ``http`` and ``mcp``, sent with every request; stay on the host.
        timeout_s: for ``http`` and ``mcp``, limit of one call in seconds (None = server default).
        tool: for ``mcp``, the tool's name on the MCP server (None = the manifest entry's name).
    """

    kind: str
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    tool: str | None = None


@dataclass(frozen=True)
class Approval:
    """When a tool's calls wait for a human's approval (the manifest's ``approval``), and for how long.

    Attributes:
        when: a JSON Schema (2020-12): a call needs approval when its validated arguments match it; None: every
            call does (``"always"``).
        validator: compiled validator of ``when`` (the arguments' validator, with the same CPU budget per keyword).
        timeout_s: how long a call waits for the decision (s); None: ``PTC_APPROVAL_TIMEOUT_S``.
    """

    when: JsonSchema | None = None
    validator: jsonschema.protocols.Validator | None = field(default=None, repr=False, compare=False)
    timeout_s: float | None = None

    def needed(self, args: dict[str, Any]) -> bool:
        """Whether a call with these (validated) arguments needs approval. Runs the rule within the running check's
        CPU budget (run it on the check threads); a rule that cannot be evaluated (an unresolvable ``$ref``, too
        deep) counts as a match: the call waits for a human rather than going out unapproved.

        Raises:
            CheckTooCostly: past the check's CPU budget.
        """
        if self.validator is None:
            return True
        try:
            return bool(self.validator.is_valid(args))
        except (referencing.exceptions.Unresolvable, RecursionError):
            return True


@dataclass(frozen=True)
class ToolSpec:
    """One tool of a manifest, normalized.

    Attributes:
        name: original name (may contain dots: ``math.factorial``).
        description: free text for the stub's docstring.
        parameters: the parameter object schema, mapped to JSON Schema 2020-12.
        endpoint: where calls go.
        validator: compiled validator for ``parameters``; rejects unknown
            arguments unless the schema sets ``additionalProperties``.
        output_schema: the result's schema (MCP ``outputSchema``, or ``output_schema``), if declared.
        output_validator: compiled validator for ``output_schema``.
        timeout_s: limit of one call (s); None = the endpoint's or the server's.
        idempotent: the tool may be called twice for one call (so failed calls may be retried).
        retries: extra attempts after a failure, for idempotent tools only (exponential backoff).
        max_concurrency: calls of this tool in flight at once per job; None = no limit of its own.
        callable_from_code: False when ``allowed_callers`` excludes code: the broker refuses its calls.
        approval: when its calls wait for a human's approval (``POST /jobs/{id}/calls/{call_id}/approve``); None:
            never.
        cheap_arguments: ``parameters`` is a cheap schema (``cheap_schema``) and no approval rule applies: the
            broker may check small arguments on the event loop (``service.broker.dispatch``).
        cheap_result: no output schema, or a cheap one: the broker may check small results on the event loop.
    """

    name: str
    description: str
    parameters: JsonSchema
    endpoint: Endpoint
    validator: jsonschema.protocols.Validator = field(repr=False, compare=False)
    output_schema: JsonSchema | None = None
    output_validator: jsonschema.protocols.Validator | None = field(default=None, repr=False, compare=False)
    timeout_s: float | None = None
    idempotent: bool = False
    retries: int = 0
    max_concurrency: int | None = None
    callable_from_code: bool = True
    approval: Approval | None = None
    cheap_arguments: bool = False
    cheap_result: bool = False

    def check_arguments(self, args: Any) -> ArgumentCheck:
        """Validate ``args``; a string where an object or array is expected is parsed once as JSON if that helps.

        Returns:
            ``ArgumentCheck``: ``problem`` None when valid (then ``args`` are the arguments to send, repaired
            or not), else one message that names the parameter path at fault.
        """
        if not isinstance(args, dict):
            return ArgumentCheck(args, f"arguments must be a JSON object, got {type(args).__name__}")
        errors = self._errors(args)
        if isinstance(errors, str):
            return ArgumentCheck(args, errors)
        if not errors:
            return ArgumentCheck(args, None)
        repaired = _repair(args, errors)
        if repaired is not None and self._errors(repaired) == []:
            return ArgumentCheck(repaired, None, repaired=True)
        return ArgumentCheck(
            args,
            "; ".join(_describe(e, self) for e in errors[:3])
            + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""),
        )

    def _errors(self, args: dict[str, Any]) -> list[ValidationError] | str:
        try:
            found = list(itertools.islice(self.validator.iter_errors(args), MAX_ERRORS_EXAMINED))
        except referencing.exceptions.Unresolvable as exc:
            return f"the tool's schema has a $ref that cannot be resolved here: {exc}"
        except RecursionError:
            return "the arguments are nested too deeply to check"
        return sorted(found, key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))

    def check_result(self, result: Any) -> str | None:
        """None when there is no output schema or ``result`` fits it, else what is wrong (with its path)."""
        if self.output_validator is None:
            return None
        try:
            error = jsonschema.exceptions.best_match(
                itertools.islice(self.output_validator.iter_errors(result), MAX_ERRORS_EXAMINED)
            )
        except (referencing.exceptions.Unresolvable, RecursionError) as exc:
            return f"the result cannot be checked against the output schema: {type(exc).__name__}"
        if error is None:
            return None
        path = ".".join(str(p) for p in error.absolute_path)
        return f"result{'.' + path if path else ''}: {error.message}"


@dataclass(frozen=True)
class ArgumentCheck:
    """Outcome of ``ToolSpec.check_arguments``: the arguments to send, the problem if any, and whether repaired."""

    args: Any
    problem: str | None
    repaired: bool = False


def _repair(args: dict[str, Any], errors: list[ValidationError]) -> dict[str, Any] | None:
    """A copy of ``args`` with each string that failed a ``type: object/array`` check parsed as JSON, or None.

    Models often send a nested object as its JSON text; parsing it once is the only repair made.
    """
    fixes = []
    for error in errors:
        expected = error.validator_value if error.validator == "type" else None
        wanted = {expected} if isinstance(expected, str) else set(expected) if isinstance(expected, list) else set()
        if not isinstance(error.instance, str) or not wanted & {"object", "array"} or not error.absolute_path:
            continue
        try:
            parsed = exactjson.loads(error.instance)
        except ValueError:
            continue
        if isinstance(parsed, (dict, list)):
            fixes.append((list(error.absolute_path), parsed))
    if not fixes:
        return None
    repaired: dict[str, Any] = orjson.loads(orjson.dumps(args))  # a deep copy in C (deepcopy walks it in Python)
    for path, value in fixes:
        node: Any = repaired
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return repaired


def _describe(error: ValidationError, tool: ToolSpec) -> str:
    path = ".".join(str(p) for p in error.absolute_path)
    where = f"argument {path!r}" if path else "arguments"
    if error.validator == "required" and not path:
        missing = str(error.message).split("'")[1] if "'" in error.message else error.message
        return f"missing required argument {missing!r}"
    if error.validator == "additionalProperties" and not path:
        known = list(tool.parameters.get("properties", {}))
        extra = [k for k in error.instance if k not in known] if isinstance(error.instance, dict) else []
        hints = [_with_hint(name, known) for name in extra[:3]]
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        listed = ", ".join(map(repr, known[:50])) or "none"
        return f"unexpected argument {', '.join(hints)}{more}; parameters are {listed}"
    if error.validator == "type":  # what was given, by its JSON type: '3' (a string) for an integer
        return f"{where}: {error.message} (got {_json_kind(error.instance)})"
    return f"{where}: {error.message}"


def _json_kind(value: Any) -> str:
    """The JSON type of a value, as a schema names it."""
    if value is None:
        return "null"
    for kind, types in (("boolean", bool), ("integer", int), ("number", float), ("string", str)):
        if isinstance(value, types):
            return kind
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__


def _with_hint(name: str, known: list[str]) -> str:
    """``'nme' (did you mean 'name'?)``; no hint for long names (difflib is quadratic)."""
    shown = repr(name[:HINT_NAME_MAX] + ("..." if len(name) > HINT_NAME_MAX else ""))
    if len(name) > HINT_NAME_MAX or len(known) > 1000:
        return shown
    close = difflib.get_close_matches(name, known, n=1)
    return shown + (f" (did you mean {close[0]!r}?)" if close else "")


def _check_name(name: str, loc: tuple[str | int, ...]) -> None:
    if len(name.split(".")) > MAX_NAME_SEGMENTS:
        raise ManifestError(f"a tool name may have at most {MAX_NAME_SEGMENTS} dotted parts", loc)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestError("the name contains a lone surrogate, which no call could carry", loc) from None


def _as_mapping(entry: Any, loc: tuple[str | int, ...]) -> Mapping[str, Any]:
    if not isinstance(entry, Mapping):
        raise ManifestError("a manifest entry must be a JSON object", loc)
    return entry


def parse_endpoint(raw: Any, loc: tuple[str | int, ...]) -> Endpoint:
    """Validate one ``endpoint`` object; raises ManifestError naming the field."""
    raw = _as_mapping(raw, loc) if raw is not None else None
    if raw is None:
        raise ManifestError('endpoint is required (e.g. {"kind": "http", "url": ...} or {"kind": "echo"})', loc)
    kind = raw.get("kind")
    if kind in ("echo", "client"):
        return Endpoint(kind=kind)
    if kind in ("http", "mcp"):
        url = raw.get("url")
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise ManifestError(f"an {kind} endpoint needs an absolute http(s) url", (*loc, "url"))
        problem = url_problem(url)
        if problem:
            raise ManifestError(problem, (*loc, "url"))
        headers = raw.get("headers") or {}
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and _HEADER_NAME.fullmatch(k) and isinstance(v, str) and _HEADER_VALUE.fullmatch(v)
            for k, v in headers.items()
        ):
            raise ManifestError(
                "headers must map header names (RFC 9110 tokens) to values without control characters",
                (*loc, "headers"),
            )
        for name in headers:
            problem = header_problem(name)
            if problem:
                raise ManifestError(problem, (*loc, "headers", name))
        timeout = raw.get("timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600
        ):
            raise ManifestError("timeout_s must be a number of seconds in (0, 3600]", (*loc, "timeout_s"))
        remote = raw.get("tool") if kind == "mcp" else None
        if remote is not None and (not isinstance(remote, str) or not remote or len(remote) > MAX_TOOL_NAME):
            raise ManifestError(
                f"tool must be a non-empty string of at most {MAX_TOOL_NAME} characters", (*loc, "tool")
            )
        return Endpoint(
            kind=kind, url=url, headers=dict(headers), timeout_s=float(timeout) if timeout else None, tool=remote
        )
    raise ManifestError(f"unknown endpoint kind {kind!r}; expected 'http', 'mcp', 'client' or 'echo'", (*loc, "kind"))


def parse_tool(entry: Any, loc: tuple[str | int, ...]) -> ToolSpec:
    """One manifest entry (any accepted shape) -> ToolSpec; raises ManifestError with its location."""
    outer = _as_mapping(entry, loc)
    inner = outer
    if outer.get("type") == "function" and isinstance(outer.get("function"), Mapping):
        inner = outer["function"]
    name = inner.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_TOOL_NAME:
        raise ManifestError(f"name must be a non-empty string of at most {MAX_TOOL_NAME} characters", (*loc, "name"))
    _check_name(name, (*loc, "name"))
    description = inner.get("description") or ""
    if not isinstance(description, str):
        raise ManifestError("description must be a string", (*loc, "description"))
    raw_params = next((inner[k] for k in ("parameters", "input_schema", "inputSchema") if k in inner), None)
    if raw_params is None:
        raw_params = {"type": "object", "properties": {}}
    if not isinstance(raw_params, Mapping):
        raise ManifestError("parameters must be a JSON Schema object", (*loc, "parameters"))
    if json_depth(raw_params, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ManifestError(f"parameters is nested deeper than {MAX_SCHEMA_DEPTH} levels", (*loc, "parameters"))
    parameters = to_json_schema(dict(raw_params))
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    parameters.setdefault("additionalProperties", False)
    for param in parameters["properties"]:
        _check_name(param, (*loc, "parameters", "properties"))
    problem = schema_problem(parameters)
    if problem is not None:
        where, message = problem
        raise ManifestError(
            f"parameters is not a valid JSON Schema at {where or 'top'}: {message}", (*loc, "parameters")
        )
    _refuse_unbounded_patterns(parameters, (*loc, "parameters"))
    endpoint = parse_endpoint(outer.get("endpoint", inner.get("endpoint")), (*loc, "endpoint"))
    output_schema = _output_schema(outer, inner, loc)
    approval = _approval(outer, inner, endpoint, loc)
    return ToolSpec(
        name=name,
        description=description,
        parameters=parameters,
        endpoint=endpoint,
        validator=Validator(parameters, registry=_NO_RETRIEVAL),
        output_schema=output_schema,
        output_validator=Validator(output_schema, registry=_NO_RETRIEVAL) if output_schema is not None else None,
        approval=approval,
        cheap_arguments=approval is None and cheap_schema(parameters),
        cheap_result=output_schema is None or cheap_schema(output_schema),
        **_policy(outer, inner, loc),
    )


def _approval(
    outer: Mapping[str, Any], inner: Mapping[str, Any], endpoint: Endpoint, loc: tuple[str | int, ...]
) -> Approval | None:
    """The entry's ``approval`` (``"never"``, the default; ``"always"``; or ``{"when": <JSON Schema>}``) and
    ``approval_timeout_s``; raises ManifestError naming the field."""
    raw = outer.get("approval", inner.get("approval"))
    timeout = outer.get("approval_timeout_s", inner.get("approval_timeout_s"))
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.001 <= timeout <= 3600
    ):
        raise ManifestError("approval_timeout_s must be a number in [0.001, 3600]", (*loc, "approval_timeout_s"))
    if raw is None or raw == "never":
        return None
    where = (*loc, "approval")
    if endpoint.kind == "client":
        raise ManifestError("a client-executed tool cannot require approval: its client answers it already", where)
    timeout_s = float(timeout) if timeout is not None else None
    if raw == "always":
        return Approval(timeout_s=timeout_s)
    if not isinstance(raw, Mapping) or set(raw) != {"when"}:
        raise ManifestError('approval must be "never", "always" or {"when": <JSON Schema of the arguments>}', where)
    when = raw["when"]
    if not isinstance(when, Mapping) or json_depth(when, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ManifestError(
            f"when must be a JSON Schema object nested at most {MAX_SCHEMA_DEPTH} deep", (*where, "when")
        )
    rule = dict(when)
    problem = schema_problem(rule)
    if problem is not None:
        raise ManifestError(f"when is not a valid JSON Schema at {problem[0] or 'top'}: {problem[1]}", (*where, "when"))
    _refuse_unbounded_patterns(rule, (*where, "when"))
    _refuse_invalid_patterns(rule, (*where, "when"))
    return Approval(rule, Validator(rule, registry=_NO_RETRIEVAL), timeout_s)


def _output_schema(outer: Mapping[str, Any], inner: Mapping[str, Any], loc: tuple[str | int, ...]) -> JsonSchema | None:
    raw = next((m[k] for m in (outer, inner) for k in ("outputSchema", "output_schema") if k in m), None)
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or json_depth(raw, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ManifestError("the output schema must be a JSON Schema object of bounded depth", (*loc, "outputSchema"))
    schema = to_json_schema(dict(raw))
    problem = schema_problem(schema)
    if problem is not None:
        raise ManifestError(f"the output schema is not a valid JSON Schema: {problem[1]}", (*loc, "outputSchema"))
    _refuse_unbounded_patterns(schema, (*loc, "outputSchema"))
    return schema


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


def _refuse_unbounded_patterns(schema: JsonSchema, loc: tuple[str | int, ...]) -> None:
    """jsonschema's ``unevaluatedProperties`` matches ``patternProperties`` with ``re``, which no time limit bounds
    (a pattern like ``^(a|a)+$`` would hold a check thread, and the GIL, for as long as the input makes it):
    a schema may use one or the other, not both. Nor may a pattern cost more to compile than ``pattern_cost``
    allows: no time limit bounds compiling (``_search``'s timeout bounds matching), nor its memory."""
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


def _refuse_invalid_patterns(schema: JsonSchema, loc: tuple[str | int, ...]) -> None:
    """Refuse a ``pattern`` or ``patternProperties`` key that is not a valid pattern (``regex``, as ``_search``
    compiles it; costly ones were refused before, by ``_refuse_unbounded_patterns``). For an approval rule this
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


_HEADER_NAME = regex.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = regex.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")

CODE_CALLERS = ("code", "code_execution", "programmatic")


def _policy(outer: Mapping[str, Any], inner: Mapping[str, Any], loc: tuple[str | int, ...]) -> dict[str, Any]:
    """The per-tool policy fields of an entry (on the entry itself, or inside an OpenAI ``function``)."""

    def get(key: str) -> Any:
        return outer.get(key, inner.get(key))

    def number(key: str, low: float, high: float, integer: bool) -> Any:
        value = get(key)
        if value is None:
            return None
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
            kind = "an integer" if integer else "a number"
            raise ManifestError(f"{key} must be {kind} in [{low:g}, {high:g}]", (*loc, key))
        return value

    idempotent = get("idempotent")
    if idempotent is not None and not isinstance(idempotent, bool):
        raise ManifestError("idempotent must be true or false", (*loc, "idempotent"))
    callers = get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or not all(isinstance(c, str) for c in callers)):
        raise ManifestError("allowed_callers must be a list of strings", (*loc, "allowed_callers"))
    timeout = number("timeout_s", 0.001, 3600, integer=False)
    return {
        "timeout_s": float(timeout) if timeout is not None else None,
        "idempotent": bool(idempotent),
        "retries": number("retries", 0, 10, integer=True) or 0,
        "max_concurrency": number("max_concurrency", 1, 1024, integer=True),
        "callable_from_code": callers is None or any(c.startswith(CODE_CALLERS) for c in callers),
    }


def parse_manifest(entries: Sequence[Any], loc: tuple[str | int, ...] = ("tools",)) -> dict[str, ToolSpec]:
    """A whole manifest -> tools by original name; raises ManifestError (duplicate names included)."""
    tools: dict[str, ToolSpec] = {}
    for i, entry in enumerate(entries):
        tick()  # a tool's parsing counts against the compile's budget, as its metaschema check does
        spec = parse_tool(entry, (*loc, i))
        if spec.name in tools:
            raise ManifestError(f"duplicate tool name {spec.name!r}", (*loc, i, "name"))
        tools[spec.name] = spec
    return tools


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
