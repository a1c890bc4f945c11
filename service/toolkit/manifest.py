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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from service.errors import ManifestError
from service.toolkit.schema import JsonSchema, to_json_schema

MAX_TOOL_NAME = 256


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
        errors = sorted(
            self.validator.iter_errors(args), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path)))
        )
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
        hints = []
        for name in extra:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"unexpected argument {', '.join(hints)}; parameters are {', '.join(map(repr, known)) or 'none'}"
    return f"{where}: {error.message}"


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
    description = inner.get("description") or ""
    if not isinstance(description, str):
        raise ManifestError("description must be a string", (*loc, "description"))
    raw_params = next((inner[k] for k in ("parameters", "input_schema", "inputSchema") if k in inner), None)
    if raw_params is None:
        raw_params = {"type": "object", "properties": {}}
    if not isinstance(raw_params, Mapping):
        raise ManifestError("parameters must be a JSON Schema object", (*loc, "parameters"))
    parameters = to_json_schema(dict(raw_params))
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    parameters.setdefault("additionalProperties", False)
    validator_cls = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
    try:
        validator_cls.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ManifestError(
            f"parameters is not a valid JSON Schema at {where or 'top'}: {exc.message}", (*loc, "parameters")
        ) from exc
    endpoint = parse_endpoint(outer.get("endpoint", inner.get("endpoint")), (*loc, "endpoint"))
    return ToolSpec(
        name=name,
        description=description,
        parameters=parameters,
        endpoint=endpoint,
        validator=validator_cls(parameters),
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
