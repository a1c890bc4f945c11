"""A manifest's tools as the service holds them: ``ToolSpec`` (with its ``Endpoint`` and ``Approval``), and the
check of a call's arguments (``ArgumentCheck``: the one repair made, the message that names the parameter at fault).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import orjson
import referencing
import referencing.exceptions
from jsonschema.exceptions import ValidationError

from service import exactjson
from service.toolkit.schema import JsonSchema

MAX_ERRORS_EXAMINED = 50
HINT_NAME_MAX = 64


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
