"""Request limits: sizes of scripts and manifests, tools per manifest, and the maxima of each API key.

Three layers, outermost first:

1. ``PTC_MAX_BODY_BYTES`` (default 8 MiB): the whole body, checked by the
   ``BodyLimit`` middleware from ``Content-Length`` and while reading, before
   anything is parsed -> 413.
2. ``PTC_MAX_SCRIPT_BYTES`` (1 MiB of UTF-8) and ``PTC_MAX_MANIFEST_BYTES``
   (4 MiB: ``tools`` and ``mcp_servers`` as compact JSON) -> 413 naming the field;
   ``PTC_MAX_TOOLS`` tools per manifest -> 422.
3. ``PTC_KEY_LIMITS``: per API key, maxima below the server's for ``timeout_s``
   and each of ``limits`` (a request asking more -> 422; one asking nothing gets
   the server default lowered to the key's maximum) and for the number of tools.

The server-wide maxima of ``timeout_s`` and ``limits`` (``PTC_MAX_*``) are
applied afterwards, by ``jobs.resolve_limits``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from service.errors import PayloadTooLarge, RequestLimitError
from service.files import check_files
from service.sandbox.images import image_name
from service.schemas.job_models import ExecuteRequest
from service.schemas.session_models import SessionRequest
from service.schemas.toolset_models import ManifestRequest
from service.settings import KeyLimits, Settings


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON (lone surrogates, which orjson refuses, counted as 3 bytes)."""
    try:
        return len(orjson.dumps(value))
    except (orjson.JSONEncodeError, TypeError):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        return len(text.encode("utf-8", "surrogatepass"))


def _key_limits(settings: Settings, key_name: str | None) -> KeyLimits | None:
    return settings.key_limits.get(key_name) if key_name is not None else None


def _check_manifest(tools: list[dict[str, Any]], extra: Any, settings: Settings, key_name: str | None) -> None:
    size = json_size(tools) + (json_size(extra) if extra else 0)
    if size > settings.max_manifest_bytes:
        raise PayloadTooLarge(
            f"the manifest has {size} bytes of JSON, more than the limit of {settings.max_manifest_bytes}",
            ("body", "tools"),
            settings.max_manifest_bytes,
        )
    check_tool_count(len(tools), settings, key_name)


def check_tool_count(count: int, settings: Settings, key_name: str | None, loc: str = "tools") -> None:
    """Refuse a manifest with more tools than the server (``PTC_MAX_TOOLS``) or the key allows.

    Raises:
        RequestLimitError: naming ``loc``.
    """
    key = _key_limits(settings, key_name)
    if key is not None and key.tools is not None and count > key.tools:
        raise RequestLimitError(f"{count} tools exceed the maximum of key {key_name!r}: {key.tools}", ("body", loc))
    if count > settings.max_tools:
        raise RequestLimitError(f"{count} tools exceed the server maximum of {settings.max_tools}", ("body", loc))


def check_manifest_request(body: ManifestRequest, settings: Settings, key_name: str | None) -> None:
    """Check the body of ``POST /stubs`` or ``POST /toolsets``.

    Raises:
        PayloadTooLarge: the manifest (tools and mcp_servers) is over ``max_manifest_bytes``.
        RequestLimitError: more tools than allowed.
    """
    servers = [server.model_dump() for server in body.mcp_servers]
    _check_manifest(body.tools, servers, settings, key_name)


def check_execute(body: ExecuteRequest, settings: Settings, key_name: str | None) -> None:
    """Check the body of ``POST /execute`` against the size limits and the key's maxima.

    A limit the request leaves unset while the server default exceeds the key's maximum is set to that
    maximum in ``body``.

    Raises:
        PayloadTooLarge: the script is over ``max_script_bytes``, the manifest over ``max_manifest_bytes``, or
            ``files`` past ``max_files`` / ``max_files_bytes``.
        RequestLimitError: a value, or the number of tools, over the key's or the server's maximum.
        UnknownImage: ``image`` is not a name in ``PTC_IMAGES`` (checked first: before any sandbox starts).
    """
    image_name(settings, body.image, body.language)
    script_bytes = len(body.script.encode("utf-8", "surrogatepass"))
    if script_bytes > settings.max_script_bytes:
        raise PayloadTooLarge(
            f"the script has {script_bytes} bytes, more than the limit of {settings.max_script_bytes}",
            ("body", "script"),
            settings.max_script_bytes,
        )
    _check_manifest(body.tools, None, settings, key_name)
    check_files(body.files, settings)
    _cap(body, settings, key_name)


def check_session(body: SessionRequest, settings: Settings, key_name: str | None) -> None:
    """Check the body of ``POST /sessions`` as ``check_execute`` checks ``/execute`` (manifest size and tools,
    the key's maxima of the sandbox limits; unset limits lowered to the key's maximum in ``body``).

    Raises:
        PayloadTooLarge: the manifest is over ``max_manifest_bytes``, or ``files`` past ``max_files`` /
            ``max_files_bytes``.
        RequestLimitError: a value, or the number of tools, over the key's or the server's maximum.
        UnknownImage: ``image`` is not a name in ``PTC_IMAGES``.
    """
    image_name(settings, body.image, body.language)
    _check_manifest(body.tools, None, settings, key_name)
    check_files(body.files, settings)
    _cap(body, settings, key_name)


def _cap(body: ExecuteRequest | SessionRequest, settings: Settings, key_name: str | None) -> None:
    """Apply the key's maxima to ``body``'s limits (and ``timeout_s``); raises RequestLimitError past one.

    The defaults compared are those of ``body``'s image (``Settings.image_defaults_of``).
    """
    key = _key_limits(settings, key_name)
    if key is None:
        return
    defaults = settings.image_defaults_of(image_name(settings, body.image, body.language))

    def capped(value: Any, default: Any, maximum: Any, loc: tuple[str, ...]) -> Any:
        if maximum is None:
            return value
        if value is None:
            return None if default <= maximum else maximum  # None keeps the default (and the warm pool)
        if value > maximum:
            raise RequestLimitError(f"{value} exceeds the maximum of key {key_name!r}: {maximum}", ("body", *loc))
        return value

    limits = body.limits
    if isinstance(body, ExecuteRequest):
        body.timeout_s = capped(body.timeout_s, defaults["timeout_s"], key.timeout_s, ("timeout_s",))
    limits.memory_mb = capped(limits.memory_mb, defaults["memory_mb"], key.memory_mb, ("limits", "memory_mb"))
    limits.cpus = capped(limits.cpus, defaults["cpus"], key.cpus, ("limits", "cpus"))
    limits.pids = capped(limits.pids, defaults["pids"], key.pids, ("limits", "pids"))
    limits.output_bytes = capped(
        limits.output_bytes, defaults["output_bytes"], key.output_bytes, ("limits", "output_bytes")
    )
    limits.tmp_mb = capped(limits.tmp_mb, defaults["tmp_mb"], key.tmp_mb, ("limits", "tmp_mb"))
