"""Manifest entries for client-executed tools from Python callables (their signatures as JSON Schema)."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ProblemError

_SCALARS: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def _schema(annotation: Any) -> dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema(a) for a in args]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if annotation is list or origin is list:
        return {"type": "array", "items": _schema(args[0])} if args else {"type": "array"}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    return {}


def schema_of(func: Callable[..., Any]) -> dict[str, Any]:
    """A JSON Schema (object) of ``func``'s keyword-callable parameters; ``*args``/``**kwargs`` are left out."""
    hints = typing.get_type_hints(func)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(func).parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ValueError(f"{name}: a tool's parameters are passed by name, not positional-only")
        properties[name] = _schema(hints.get(name, param.annotation))
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def client_manifest(
    tools: Mapping[str, Callable[..., Any]], schemas: Mapping[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Manifest entries ``{"name", "description", "parameters", "endpoint": {"kind": "client"}}``, one per callable;
    ``schemas`` overrides a tool's parameter schema."""
    return [
        {
            "name": name,
            "description": inspect.getdoc(func) or name,
            "parameters": (schemas or {}).get(name) or schema_of(func),
            "endpoint": {"kind": "client"},
        }
        for name, func in tools.items()
    ]


def refused_answer(error: ProblemError) -> dict[str, Any] | None:
    """The error answer sent in place of a tool's answer the service refused as a request (``413`` too large,
    ``422`` not valid), so the script gets ``tools.ToolError`` (``type`` ``AnswerRefused``) and runs on instead of
    waiting on its call until the job's timeout; None for any other problem (raised by the caller)."""
    if error.status not in (413, 422):
        return None
    message = f"the service refused this tool's answer: {error.status} {error.name}"
    return {"error": {"type": "AnswerRefused", "message": message}}


def call_error(error: BaseException) -> dict[str, Any]:
    """The ``{"error": {...}}`` answer of a callable that raised."""
    return {"error": {"type": type(error).__name__, "message": str(error)}}
