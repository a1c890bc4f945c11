"""The HTTP client of MCP endpoints, under the service's egress rules.

The ``mcp`` SDK (2.x) speaks ``httpx2``, a fork of ``httpx`` whose types and exceptions are its own; the egress
rules (``service.egress``) are an ``httpx`` transport. ``EgressBridge`` is an ``httpx2`` transport that carries
each request of an MCP session through that ``httpx`` transport, so MCP traffic passes the same rules (checked
destination, pinned address, TLS server name, one pool per name) as every ``http`` endpoint and callback, and
``mcp_client`` builds the ``httpx2.AsyncClient`` that ``streamable_http_client`` is given.

Errors cross the bridge translated: an ``httpx`` transport error becomes the ``httpx2`` error of the same name
(``ConnectError``, ``ReadTimeout``, ...; ``from`` the original), which the SDK and ``endpoints`` handle;
``EgressDenied`` passes through unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping

import httpx
import httpx2

from service.egress import EgressPolicy

__all__ = ["EgressBridge", "mcp_client"]

# The transport errors an httpx transport raises, each with its httpx2 twin; a subclass missing here becomes its
# nearest listed base (``NetworkError``, ``TransportError``).
_ERRORS: dict[type[httpx.TransportError], type[httpx2.TransportError]] = {
    httpx.ConnectTimeout: httpx2.ConnectTimeout,
    httpx.ReadTimeout: httpx2.ReadTimeout,
    httpx.WriteTimeout: httpx2.WriteTimeout,
    httpx.PoolTimeout: httpx2.PoolTimeout,
    httpx.TimeoutException: httpx2.TimeoutException,
    httpx.ConnectError: httpx2.ConnectError,
    httpx.ReadError: httpx2.ReadError,
    httpx.WriteError: httpx2.WriteError,
    httpx.CloseError: httpx2.CloseError,
    httpx.NetworkError: httpx2.NetworkError,
    httpx.LocalProtocolError: httpx2.LocalProtocolError,
    httpx.RemoteProtocolError: httpx2.RemoteProtocolError,
    httpx.ProtocolError: httpx2.ProtocolError,
    httpx.ProxyError: httpx2.ProxyError,
    httpx.UnsupportedProtocol: httpx2.UnsupportedProtocol,
    httpx.TransportError: httpx2.TransportError,
}


@contextlib.contextmanager
def _translated(request: httpx2.Request) -> Iterator[None]:
    """Re-raise an ``httpx`` transport error as its ``httpx2`` twin (``from`` it), for ``request``."""
    try:
        yield
    except httpx.TransportError as exc:
        twin = next(_ERRORS[cls] for cls in type(exc).__mro__ if cls in _ERRORS)
        raise twin(str(exc), request=request) from exc


class _RequestBody(httpx.AsyncByteStream):
    """An httpx2 request body as an httpx one."""

    def __init__(self, stream: httpx2.AsyncByteStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class _ResponseBody(httpx2.AsyncByteStream):
    """An httpx response body as an httpx2 one (errors while reading translated)."""

    def __init__(self, stream: httpx.AsyncByteStream, request: httpx2.Request) -> None:
        self._stream = stream
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _translated(self._request):
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        with _translated(self._request):
            await self._stream.aclose()


class EgressBridge(httpx2.AsyncBaseTransport):
    """httpx2 transport: sends each request through ``policy``'s httpx transport (``EgressPolicy.transport``).

    Method, URL, headers, body and extensions (the request's timeouts) pass unchanged; the answer's status,
    headers, extensions and streamed body come back unchanged.

    Raises (from ``handle_async_request`` and the answer's body):
        EgressDenied: the destination is refused; nothing was sent.
        httpx2.TransportError: the httpx2 twin of the transport's error (``httpx2.ConnectError`` for a name that
            does not resolve or an address that refuses, ``httpx2.ReadTimeout``, ...).
    """

    def __init__(self, policy: EgressPolicy) -> None:
        self._inner = policy.transport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        assert isinstance(request.stream, httpx2.AsyncByteStream)  # an AsyncClient's requests are
        sent = httpx.Request(
            request.method,
            str(request.url),
            headers=request.headers.raw,
            stream=_RequestBody(request.stream),
            extensions=dict(request.extensions),
        )
        with _translated(request):
            response = await self._inner.handle_async_request(sent)
        assert isinstance(response.stream, httpx.AsyncByteStream)  # a transport's answers are
        return httpx2.Response(
            response.status_code,
            headers=response.headers.raw,
            stream=_ResponseBody(response.stream, request),
            extensions=dict(response.extensions),
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def mcp_client(headers: Mapping[str, str], timeout: httpx2.Timeout, egress: EgressPolicy) -> httpx2.AsyncClient:
    """The ``httpx2.AsyncClient`` of one MCP session (``streamable_http_client(url, http_client=...)``): ``headers``
    on every request, ``timeout`` (s) per request phase, every request through ``egress``, no redirects of its
    own (the SDK follows only those that stay on the endpoint's origin, each again through ``egress``)."""
    return httpx2.AsyncClient(
        headers=dict(headers), timeout=timeout, follow_redirects=False, transport=EgressBridge(egress)
    )
