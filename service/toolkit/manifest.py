"""Tool manifests: the entries a request sends, parsed into ``ToolSpec``s.

Accepted entry shapes:

- ours: ``{"name", "description", "parameters", "endpoint", ...}``;
- OpenAI function tools: ``{"type": "function", "function": {"name", "description", "parameters"}}``
  and the flat Responses form ``{"type": "function", "name", ...}``;
- Anthropic tools: ``input_schema`` in place of ``parameters``;
- MCP ``tools/list`` entries: ``inputSchema`` (and ``outputSchema``);
- BFCL function docs (``parameters`` in BFCL's dialect, see ``schema``).

``endpoint`` may sit on the entry in any of these shapes; it is required.

A tool's shape is in ``service.toolkit.specs``, the checks of its schemas in ``service.toolkit.schema_checks``,
the keywords its arguments are checked with in ``service.toolkit.keywords``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import referencing
import referencing.exceptions
import regex

from service.egress import header_problem, url_problem
from service.errors import ManifestError
from service.toolkit.keywords import Validator
from service.toolkit.schema import JsonSchema, json_depth, to_json_schema
from service.toolkit.schema_checks import (
    cheap_schema,
    refuse_invalid_patterns,
    refuse_unbounded_patterns,
    schema_problem,
)
from service.toolkit.specs import Approval, Endpoint, ToolSpec
from service.toolkit.validation import tick

MAX_TOOL_NAME = 256
MAX_NAME_SEGMENTS = 16
MAX_SCHEMA_DEPTH = 64
MAX_CALL_S = 3600  # the largest timeout_s of a tool its endpoint answers (http, mcp)
MAX_PAUSE_S = 30 * 86400  # the largest timeout_s of a client-executed tool and approval_timeout_s (PTC_MAX_PARK_S cuts)

# No "$ref" is ever fetched: a manifest could otherwise make the service GET any URL, and block on it.
_NO_RETRIEVAL: referencing.Registry[Any] = referencing.Registry()


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
    refuse_unbounded_patterns(parameters, (*loc, "parameters"))
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
        **_policy(outer, inner, loc, MAX_PAUSE_S if endpoint.kind == "client" else MAX_CALL_S),
    )


def _approval(
    outer: Mapping[str, Any], inner: Mapping[str, Any], endpoint: Endpoint, loc: tuple[str | int, ...]
) -> Approval | None:
    """The entry's ``approval`` (``"never"``, the default; ``"always"``; or ``{"when": <JSON Schema>}``) and
    ``approval_timeout_s``; raises ManifestError naming the field."""
    raw = outer.get("approval", inner.get("approval"))
    timeout = outer.get("approval_timeout_s", inner.get("approval_timeout_s"))
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.001 <= timeout <= MAX_PAUSE_S
    ):
        message = f"approval_timeout_s must be a number in [0.001, {MAX_PAUSE_S}]"
        raise ManifestError(message, (*loc, "approval_timeout_s"))
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
    refuse_unbounded_patterns(rule, (*where, "when"))
    refuse_invalid_patterns(rule, (*where, "when"))
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
    refuse_unbounded_patterns(schema, (*loc, "outputSchema"))
    return schema


_HEADER_NAME = regex.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = regex.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")

CODE_CALLERS = ("code", "code_execution", "programmatic")


def _policy(
    outer: Mapping[str, Any], inner: Mapping[str, Any], loc: tuple[str | int, ...], max_timeout_s: float
) -> dict[str, Any]:
    """The per-tool policy fields of an entry (on the entry itself, or inside an OpenAI ``function``);
    ``max_timeout_s``: the largest ``timeout_s`` (``MAX_PAUSE_S`` for a client-executed tool, else ``MAX_CALL_S``)."""

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
    timeout = number("timeout_s", 0.001, max_timeout_s, integer=False)
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
