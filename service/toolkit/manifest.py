"""Tool manifests: the entries a request sends, parsed into ``ToolSpec``s.

Accepted entry shapes (DESIGN.md, "Tool manifest"):

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
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
import regex
from jsonschema.exceptions import ValidationError

from service.errors import ManifestError
from service.toolkit.schema import JsonSchema, json_depth, to_json_schema

MAX_TOOL_NAME = 256
MAX_NAME_SEGMENTS = 16
MAX_SCHEMA_DEPTH = 64
MAX_ERRORS_EXAMINED = 50
PATTERN_TIMEOUT_S = 0.05
HINT_NAME_MAX = 64

# No "$ref" is ever fetched: a manifest could otherwise make the service GET any URL, and block on it.
_NO_RETRIEVAL: referencing.Registry[Any] = referencing.Registry()


def _search(pattern: str, text: str) -> bool:
    """``re.search`` semantics with a time bound (the ``regex`` module), so a pattern cannot stall the broker."""
    try:
        return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        raise ValidationError(f"matching {pattern!r} took too long") from None
    except regex.error as exc:
        raise ValidationError(f"invalid pattern {pattern!r}: {exc}") from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


Validator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {"pattern": _pattern, "patternProperties": _pattern_properties}
)
_META_VALIDATOR = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)


@dataclass(frozen=True)
class Endpoint:
    """Where a tool's calls go.

    Attributes:
        kind: ``echo`` (answer ``{"tool", "args"}`` without contacting anything) or
            ``http`` (POST the arguments as a JSON object to ``url``).
        url: for ``http``, the absolute http(s) URL.
        headers: for ``http``, sent with every call; stay on the host.
        timeout_s: for ``http``, limit of one call in seconds (None = server default).
    """

    kind: str
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None


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
    """

    name: str
    description: str
    parameters: JsonSchema
    endpoint: Endpoint
    validator: jsonschema.protocols.Validator = field(repr=False, compare=False)

    def check_arguments(self, args: Any) -> str | None:
        """None when ``args`` are valid, else one message that names the parameter at fault."""
        if not isinstance(args, dict):
            return f"arguments must be a JSON object, got {type(args).__name__}"
        try:
            found = list(itertools.islice(self.validator.iter_errors(args), MAX_ERRORS_EXAMINED))
        except referencing.exceptions.Unresolvable as exc:
            return f"the tool's schema has a $ref that cannot be resolved here: {exc}"
        except RecursionError:
            return "the arguments are nested too deeply to check"
        errors = sorted(found, key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
        if not errors:
            return None
        return "; ".join(_describe(e, self) for e in errors[:3]) + (
            f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        )


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
    return f"{where}: {error.message}"


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
    if kind == "echo":
        return Endpoint(kind="echo")
    if kind == "http":
        url = raw.get("url")
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise ManifestError("an http endpoint needs an absolute http(s) url", (*loc, "url"))
        headers = raw.get("headers") or {}
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ManifestError("headers must map strings to strings", (*loc, "headers"))
        timeout = raw.get("timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600
        ):
            raise ManifestError("timeout_s must be a number of seconds in (0, 3600]", (*loc, "timeout_s"))
        return Endpoint(kind="http", url=url, headers=dict(headers), timeout_s=float(timeout) if timeout else None)
    raise ManifestError(f"unknown endpoint kind {kind!r}; expected 'http' or 'echo'", (*loc, "kind"))


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
    error = jsonschema.exceptions.best_match(_META_VALIDATOR.iter_errors(parameters))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ManifestError(
            f"parameters is not a valid JSON Schema at {where or 'top'}: {error.message}", (*loc, "parameters")
        )
    endpoint = parse_endpoint(outer.get("endpoint", inner.get("endpoint")), (*loc, "endpoint"))
    return ToolSpec(
        name=name,
        description=description,
        parameters=parameters,
        endpoint=endpoint,
        validator=Validator(parameters, registry=_NO_RETRIEVAL),
    )


def parse_manifest(entries: Sequence[Any], loc: tuple[str | int, ...] = ("tools",)) -> dict[str, ToolSpec]:
    """A whole manifest -> tools by original name; raises ManifestError (duplicate names included)."""
    tools: dict[str, ToolSpec] = {}
    for i, entry in enumerate(entries):
        spec = parse_tool(entry, (*loc, i))
        if spec.name in tools:
            raise ManifestError(f"duplicate tool name {spec.name!r}", (*loc, i, "name"))
        tools[spec.name] = spec
    return tools
