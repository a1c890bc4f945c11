"""Endpoint clients: where the broker sends a validated tool call.

Dispatch is by ``Endpoint.kind`` through the table in ``EndpointClients``:

- ``echo``: returns ``{"tool": name, "args": args}`` without contacting anything.
- ``http`` (DESIGN.md, "http endpoint protocol"): POST the arguments as a
  JSON object to ``url`` with the endpoint's headers; a 2xx JSON body is the
  result; anything else is a ``ToolCallFailed`` carrying the status and a capped
  excerpt of the body. Redirects are not followed. The endpoint's ``timeout_s``
  bounds the whole call (connect, send, every read), not each read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson

from service.toolkit.manifest import Endpoint, ToolSpec

BODY_EXCERPT_BYTES = 500


class ToolCallFailed(Exception):
    """A call that reached (or tried to reach) its endpoint and got no result.

    Attributes:
        type: ``timeout`` | ``http_error`` | ``endpoint_unreachable`` | ``bad_response``
            | ``result_too_large``; becomes ``ToolError.type`` in the script.
        message: what happened, safe to show to the script (no credentials).
    """

    def __init__(self, type: str, message: str) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message


class EndpointClients:
    """Calls endpoints; owns the shared HTTP connection pool.

    Args:
        default_timeout_s: limit of one http call when the endpoint sets none (s).
        max_result_bytes: larger response bodies fail with ``result_too_large``.
    """

    def __init__(self, default_timeout_s: float, max_result_bytes: int) -> None:
        self._default_timeout_s = default_timeout_s
        self._max_result_bytes = max_result_bytes
        self._http = httpx.AsyncClient(follow_redirects=False, limits=httpx.Limits(max_connections=512))
        self._dispatch: dict[str, Callable[[ToolSpec, dict[str, Any]], Awaitable[Any]]] = {
            "echo": self._echo,
            "http": self._post,
        }

    async def aclose(self) -> None:
        """Close the HTTP pool."""
        await self._http.aclose()

    async def call(self, tool: ToolSpec, args: dict[str, Any]) -> Any:
        """Run one call; returns the JSON result or raises ToolCallFailed."""
        return await self._dispatch[tool.endpoint.kind](tool, args)

    async def _echo(self, tool: ToolSpec, args: dict[str, Any]) -> Any:
        return {"tool": tool.name, "args": args}

    async def _post(self, tool: ToolSpec, args: dict[str, Any]) -> Any:
        endpoint: Endpoint = tool.endpoint
        assert endpoint.url is not None
        timeout = endpoint.timeout_s or self._default_timeout_s
        headers = {"content-type": "application/json", **endpoint.headers}
        try:
            async with (
                asyncio.timeout(timeout),
                self._http.stream(
                    "POST", endpoint.url, content=orjson.dumps(args), headers=headers, timeout=timeout
                ) as response,
            ):
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > self._max_result_bytes:
                        raise ToolCallFailed(
                            "result_too_large", f"the endpoint answered more than {self._max_result_bytes} bytes"
                        )
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ToolCallFailed("timeout", f"the endpoint did not answer within {timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise ToolCallFailed("endpoint_unreachable", f"cannot reach the endpoint: {type(exc).__name__}") from exc
        if not 200 <= response.status_code < 300:
            excerpt = bytes(body[:BODY_EXCERPT_BYTES]).decode("utf-8", "replace")
            more = " [...]" if len(body) > BODY_EXCERPT_BYTES else ""
            raise ToolCallFailed("http_error", f"HTTP {response.status_code}: {excerpt}{more}")
        try:
            return orjson.loads(body) if body else None
        except orjson.JSONDecodeError as exc:
            raise ToolCallFailed("bad_response", f"the endpoint's answer is not JSON: {exc}") from exc
