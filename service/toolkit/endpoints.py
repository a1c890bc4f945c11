"""Endpoint clients: where the broker sends a validated tool call.

Dispatch is by ``Endpoint.kind`` through the table in ``EndpointClients``:

- ``echo``: returns ``{"tool": name, "args": args}`` without contacting anything.
- ``http``: POST the arguments as a
  JSON object to ``url`` with the endpoint's headers and the call's id as
  ``Idempotency-Key`` (the same on every attempt and every replay of the call:
  a tool may drop a repeat); a 2xx JSON body is the
  result; anything else is a ``ToolCallFailed`` carrying the status and a capped
  excerpt of the body. Redirects are not followed. The endpoint's ``timeout_s``
  bounds the whole call (connect, send, every read), not each read.
- ``mcp``: an MCP ``tools/call`` of ``Endpoint.tool`` (default: the tool's name)
  on the MCP server at ``url``, over Streamable HTTP with the official ``mcp``
  SDK (2.x: its ``httpx2`` client, bridged to the egress rules by ``mcp_http``).
  The result is the call's ``structuredContent`` when present, else its text
  (parsed when it is JSON; several text blocks give a list); ``isError``
  becomes ``ToolCallFailed("tool_error", text)``; an HTTP error status is
  ``http_error``. One MCP session per (url, headers) is kept open and shared
  by all calls (see ``_McpSession``).

Every HTTP request of ``http`` and ``mcp`` endpoints passes the egress rules (``service.egress``):
a destination they refuse fails with ``ToolCallFailed("egress_denied", ...)`` before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
from mcp import ClientSession, MCPError
from mcp import types as mcp_types
from mcp.client.streamable_http import streamable_http_client

from service import exactjson
from service.egress import EgressDenied, EgressPolicy
from service.observability import telemetry
from service.toolkit.mcp_http import mcp_client
from service.toolkit.specs import Endpoint, ToolSpec

log = logging.getLogger(__name__)

BODY_EXCERPT_BYTES = 500
ERROR_TEXT_CHARS = 2000  # an MCP tool's error text is cut to this many characters
MCP_MAX_SESSIONS = 64  # open MCP sessions kept; past it the least recently used idle one is closed
MCP_HTTP_TIMEOUT_S = 30.0  # connect / write / pool limit of the HTTP requests inside an MCP session
MCP_INIT_S = 30.0  # an MCP session that is not initialized by then fails (and the next call opens another)
MCP_HTTP_READ_S = 3660.0  # read limit inside a session: above any call's timeout_s (<= 3600 s)
MCP_CLOSE_S = 5.0  # how long closing one session may take before its task is cancelled
MCP_FAILURE_WAIT_S = 1.0  # how long a call whose connection closed waits to learn why
# What the SDK's transport answers for a request the server rejected with an HTTP error status: 404 once a session
# is established (unknown or expired), 404 before (no MCP endpoint there), any other status >= 400 (the status is
# not kept). A JSON-RPC error in the body of such an answer is raised as it is instead.
_MCP_SESSION_TERMINATED = (mcp_types.INVALID_REQUEST, "Session terminated")
_MCP_NOT_FOUND = (mcp_types.METHOD_NOT_FOUND, "Not Found")
_MCP_ERROR_STATUS = (mcp_types.INTERNAL_ERROR, "Server returned an error response")


@dataclass(frozen=True)
class RawJson:
    """An endpoint's answer as it came: JSON text not parsed yet (``EndpointClients.call(..., raw=True)``).

    The broker parses it on its check threads (``service.broker.checks.check_result``), never on the event loop:
    parsing and walking 8 MiB of ``[[],[],...]`` takes about a second of CPU.
    """

    body: bytes


class ToolCallFailed(Exception):
    """A call that reached (or tried to reach) its endpoint and got no result.

    Attributes:
        type: ``timeout`` | ``http_error`` | ``endpoint_unreachable`` | ``bad_response``
            | ``result_too_large`` | ``egress_denied`` | ``tool_error`` (an MCP tool's ``isError`` or a JSON-RPC error);
            becomes ``ToolError.type`` in the script.
        message: what happened, safe to show to the script (no credentials).
    """

    def __init__(self, type: str, message: str) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message
        self.attempts = 1  # set by the broker when an idempotent tool was retried


class _SessionExpired(Exception):
    """The MCP server no longer knows the session (HTTP 404): it did not run the call, which may be sent again."""


class _McpSession:
    """One MCP client session over Streamable HTTP, kept open by its own task and shared by calls from any task.

    The SDK's transport and ``ClientSession`` are anyio context managers that must be entered and left in
    one task: ``_run`` is that task. Requests from other tasks only use the session's memory streams, so
    several calls may be in flight at once (replies are matched by JSON-RPC id).

    When the transport fails (connection refused, a connection cut) the whole session ends: calls in flight
    then fail and the next call opens a new session. An HTTP error status fails only the call it answered
    (``http_error``; a 404 marks the session expired, and the call is sent once more on a new one).

    Args:
        url: the MCP endpoint (``http(s)://host:port/mcp``).
        headers: sent with every HTTP request of the session (credentials stay on the host).
        egress: the egress rules every request of the session passes.

    Attributes:
        ready: resolves to the initialized session, or fails with the ``ToolCallFailed`` that ended it.
        failure: why the session ended, once it has (None while it runs or after a normal close).
        in_flight: calls using it now (an idle session may be closed to keep ``MCP_MAX_SESSIONS``).
    """

    def __init__(self, url: str, headers: Mapping[str, str], egress: EgressPolicy) -> None:
        self.url = url
        self._headers = dict(headers)
        self._egress = egress
        self.ready: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
        self.failure: ToolCallFailed | None = None
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired = False
        self._closing = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name="mcp-session")
        self.task.add_done_callback(_retrieved)

    @property
    def ended(self) -> bool:
        """True once the session stopped, expired or was asked to stop (it takes no new calls)."""
        return self.task.done() or self._expired or self._closing.is_set()

    async def _run(self) -> None:
        timeout = httpx2.Timeout(MCP_HTTP_TIMEOUT_S, read=MCP_HTTP_READ_S)
        try:
            async with (
                mcp_client(self._headers, timeout, self._egress) as http,
                streamable_http_client(self.url, http_client=http) as (read, write),
                ClientSession(read, write) as session,
            ):
                try:
                    async with asyncio.timeout(MCP_INIT_S):
                        await session.initialize()
                except TimeoutError:
                    raise ToolCallFailed(
                        "timeout", f"the MCP server did not start a session within {MCP_INIT_S:g} s"
                    ) from None
                self.ready.set_result(session)
                await self._closing.wait()
        except Exception as exc:  # the SDK's task groups raise ExceptionGroups
            self.failure = _mcp_failure(exc, initializing=not self.ready.done())
            log.info("mcp: session to %s ended: %s", self.url, self.failure)
        finally:
            if not self.ready.done():
                self.ready.set_exception(
                    self.failure or ToolCallFailed("endpoint_unreachable", "the MCP session closed")
                )
                self.ready.exception()  # retrieved here: nobody may be waiting for it

    async def call(self, request: mcp_types.CallToolRequest) -> mcp_types.CallToolResult:
        """Send one ``tools/call``; raises ToolCallFailed, or _SessionExpired when it may be sent again."""
        self.in_flight += 1
        self._idle.clear()
        try:
            try:
                session = await asyncio.shield(self.ready)
            except ToolCallFailed as exc:  # shared by every waiter: each raises its own copy
                raise ToolCallFailed(exc.type, exc.message) from exc
            # ``send_request``, not ``call_tool``: the SDK's call_tool lists the server's tools first to check
            # results; the manifest's output schema is checked by the broker instead.
            call = asyncio.create_task(session.send_request(request, mcp_types.CallToolResult))
            call.add_done_callback(_retrieved)
            try:
                # Raced with the session: when its transport fails, the SDK cancels the session without
                # answering the requests in flight, which would otherwise wait for their timeout.
                await asyncio.wait({call, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                call.cancel()
            if call.done() and not call.cancelled():
                return call.result()
            raise self._ended_early()
        except MCPError as exc:
            code, message = exc.error.code, exc.error.message
            if (code, message) == _MCP_SESSION_TERMINATED:
                self._expired = True
                raise _SessionExpired from exc
            if code == mcp_types.CONNECTION_CLOSED:
                await asyncio.wait({self.task}, timeout=MCP_FAILURE_WAIT_S)
                raise self._ended_early() from exc
            if (code, message) == _MCP_ERROR_STATUS:
                raise ToolCallFailed("http_error", "the MCP server answered an HTTP error status") from exc
            raise ToolCallFailed("tool_error", f"MCP error {code}: {message[:ERROR_TEXT_CHARS]}") from exc
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _ended_early(self) -> ToolCallFailed:
        """The failure of a call whose session ended before the answer came (a copy: several calls raise it)."""
        if self.failure is not None:
            return ToolCallFailed(self.failure.type, self.failure.message)
        return ToolCallFailed("endpoint_unreachable", "the MCP session closed before the tool answered")

    async def aclose(self, drain_s: float = 0.0) -> None:
        """End the session (the SDK sends DELETE) after waiting up to ``drain_s`` for calls in flight to end;
        the session's task is cancelled when closing takes more than ``MCP_CLOSE_S``."""
        if drain_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_s):
                    await self._idle.wait()
        self._closing.set()
        await asyncio.wait({self.task}, timeout=MCP_CLOSE_S)
        if not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Done callback: mark the task's exception as seen (a call abandoned by its caller may still fail)."""
    if not task.cancelled():
        task.exception()


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _mcp_failure(exc: BaseException, initializing: bool) -> ToolCallFailed:
    """The ``ToolCallFailed`` for what ended an MCP session (``exc`` may be an ExceptionGroup)."""
    leaves = list(_leaves(exc))
    for leaf in leaves:
        if isinstance(leaf, ToolCallFailed):
            return leaf
        if isinstance(leaf, EgressDenied):
            return ToolCallFailed("egress_denied", str(leaf))
        if isinstance(leaf, httpx2.TimeoutException):
            return ToolCallFailed("timeout", "the MCP server did not answer in time")
        if isinstance(leaf, httpx2.HTTPError):
            return ToolCallFailed("endpoint_unreachable", f"cannot reach the MCP server: {type(leaf).__name__}")
        if isinstance(leaf, MCPError) and initializing:
            error = (leaf.error.code, leaf.error.message)
            if error in (_MCP_SESSION_TERMINATED, _MCP_NOT_FOUND):
                return ToolCallFailed("http_error", "HTTP 404 from the MCP server: no MCP endpoint at this url")
            if error == _MCP_ERROR_STATUS:
                return ToolCallFailed("http_error", "the MCP server answered an HTTP error status")
            return ToolCallFailed("bad_response", f"the MCP server refused to start a session: {leaf.error.message}")
    log.warning("mcp: session failed unexpectedly", exc_info=exc)
    return ToolCallFailed("endpoint_unreachable", f"the MCP session failed: {type(leaves[0]).__name__}")


def _json_or_text(text: str) -> Any:
    try:
        return exactjson.loads(text)
    except ValueError:
        return text


def _mcp_result(result: mcp_types.CallToolResult) -> Any:
    """The JSON result of a ``tools/call``: structured content, else the text (JSON-parsed), else the blocks."""
    texts = [block.text for block in result.content if isinstance(block, mcp_types.TextContent)]
    if result.is_error:
        text = "\n".join(texts) or "the MCP tool reported an error without text"
        more = " [...]" if len(text) > ERROR_TEXT_CHARS else ""
        raise ToolCallFailed("tool_error", text[:ERROR_TEXT_CHARS] + more)
    if result.structured_content is not None:
        return result.structured_content
    if len(texts) == len(result.content):
        return None if not texts else _json_or_text(texts[0]) if len(texts) == 1 else list(map(_json_or_text, texts))
    return [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content]


class EndpointClients:
    """Calls endpoints; owns the shared HTTP connection pool and the open MCP sessions.

    Args:
        default_timeout_s: limit of one http call when the endpoint sets none (s).
        max_result_bytes: larger response bodies fail with ``result_too_large``.
        egress: the egress rules of every http and mcp request; default: none (every request refused).
    """

    def __init__(self, default_timeout_s: float, max_result_bytes: int, egress: EgressPolicy | None = None) -> None:
        self._default_timeout_s = default_timeout_s
        self._max_result_bytes = max_result_bytes
        self.egress = egress or EgressPolicy()
        self._http = httpx.AsyncClient(
            follow_redirects=False,
            transport=self.egress.transport(limits=httpx.Limits(max_connections=512)),
        )
        telemetry.instrument_client(self._http)  # a span per http call, its traceparent sent (tracing on)
        self._mcp_sessions: dict[tuple[str, tuple[tuple[str, str], ...]], _McpSession] = {}  # oldest use first
        self._retiring: set[asyncio.Task[None]] = set()
        self._dispatch: dict[str, Callable[[ToolSpec, dict[str, Any], str | None], Awaitable[Any]]] = {
            "echo": self._echo,
            "http": self._post,
            "mcp": self._mcp,
        }

    async def aclose(self) -> None:
        """Close the MCP sessions and the HTTP pool."""
        sessions, self._mcp_sessions = list(self._mcp_sessions.values()), {}
        await asyncio.gather(*(session.aclose() for session in sessions), *self._retiring)
        await self._http.aclose()

    async def call(self, tool: ToolSpec, args: dict[str, Any], *, raw: bool = False, call_id: str | None = None) -> Any:
        # ``client`` endpoints never come here: the broker pauses those calls for the client to answer.
        """Run one call; returns the JSON result or raises ToolCallFailed.

        ``raw``: an ``http`` endpoint's answer is returned as ``RawJson`` (its body, unparsed), for the caller
        to parse off the event loop (the broker does); without it the body is parsed here, on the event loop
        (for small answers and tests). ``call_id``: sent to an ``http`` endpoint as ``Idempotency-Key``.

        Raises:
            ToolCallFailed: see its ``type``s; ``bad_response`` for a body that is not JSON (not ``raw``).
        """
        result = await self._dispatch[tool.endpoint.kind](tool, args, call_id)
        if isinstance(result, RawJson) and not raw:
            try:
                return exactjson.loads(result.body)
            except ValueError as exc:
                raise ToolCallFailed("bad_response", f"the endpoint's answer is not JSON: {exc}") from exc
        return result

    async def _echo(self, tool: ToolSpec, args: dict[str, Any], call_id: str | None) -> Any:
        return {"tool": tool.name, "args": args}

    async def _post(self, tool: ToolSpec, args: dict[str, Any], call_id: str | None) -> Any:
        endpoint: Endpoint = tool.endpoint
        assert endpoint.url is not None
        timeout = tool.timeout_s or endpoint.timeout_s or self._default_timeout_s
        headers = {"content-type": "application/json", **endpoint.headers}
        if call_id is not None:  # the service's, never one the manifest names
            headers = {name: value for name, value in headers.items() if name.lower() != "idempotency-key"}
            headers["idempotency-key"] = call_id
        telemetry.inject(headers)  # the current span's traceparent (the tool call's), when tracing is on
        try:
            self.egress.target(endpoint.url)  # refused at once, without resolving the name
            async with (
                asyncio.timeout(timeout),
                self._http.stream(
                    "POST", endpoint.url, content=exactjson.dumps(args), headers=headers, timeout=timeout
                ) as response,
            ):
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > self._max_result_bytes:
                        raise ToolCallFailed(
                            "result_too_large", f"the endpoint answered more than {self._max_result_bytes} bytes"
                        )
        except EgressDenied as exc:
            raise ToolCallFailed("egress_denied", str(exc)) from exc
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ToolCallFailed("timeout", f"the endpoint did not answer within {timeout:g} s") from exc
        except httpx.HTTPError as exc:
            raise ToolCallFailed("endpoint_unreachable", f"cannot reach the endpoint: {type(exc).__name__}") from exc
        if not 200 <= response.status_code < 300:
            excerpt = bytes(body[:BODY_EXCERPT_BYTES]).decode("utf-8", "replace")
            more = " [...]" if len(body) > BODY_EXCERPT_BYTES else ""
            raise ToolCallFailed("http_error", f"HTTP {response.status_code}: {excerpt}{more}")
        return RawJson(bytes(body)) if body else None  # parsed by the caller (``call``), off the loop if it wants

    async def _mcp(self, tool: ToolSpec, args: dict[str, Any], call_id: str | None) -> Any:
        endpoint: Endpoint = tool.endpoint
        assert endpoint.url is not None
        timeout = tool.timeout_s or endpoint.timeout_s or self._default_timeout_s
        params = mcp_types.CallToolRequestParams(name=endpoint.tool or tool.name, arguments=args)
        request = mcp_types.CallToolRequest(params=params)
        try:
            self.egress.target(endpoint.url)  # refused at once, before a session is opened
        except EgressDenied as exc:
            raise ToolCallFailed("egress_denied", str(exc)) from exc
        try:
            async with asyncio.timeout(timeout):
                try:
                    result = await self._mcp_session(endpoint.url, endpoint.headers).call(request)
                except _SessionExpired:  # the server forgot the session (restart, idle expiry): once more
                    try:
                        result = await self._mcp_session(endpoint.url, endpoint.headers).call(request)
                    except _SessionExpired as exc:
                        raise ToolCallFailed("endpoint_unreachable", "the MCP server ended the session") from exc
        except TimeoutError as exc:
            raise ToolCallFailed("timeout", f"the MCP server did not answer within {timeout:g} s") from exc
        value = _mcp_result(result)
        try:
            size = len(exactjson.strict_dumps(value))  # exact integers; NaN and infinities refused
        except ValueError as exc:
            raise ToolCallFailed("bad_response", f"the MCP result is not representable as JSON: {exc}") from exc
        if size > self._max_result_bytes:
            raise ToolCallFailed("result_too_large", f"the MCP result has more than {self._max_result_bytes} bytes")
        return value

    def _mcp_session(self, url: str, headers: Mapping[str, str]) -> _McpSession:
        """The open session for (url, headers), or a new one; marks it most recently used."""
        key = (url, tuple(sorted(headers.items())))
        session = self._mcp_sessions.pop(key, None)
        if session is not None and session.ended:
            self._retire(session, drain_s=MCP_CLOSE_S)  # an expired session's calls in flight are answered 404
            session = None
        if session is None:
            session = _McpSession(url, headers, self.egress)
        self._mcp_sessions[key] = session
        if len(self._mcp_sessions) > MCP_MAX_SESSIONS:
            idle = [k for k, s in list(self._mcp_sessions.items())[:-1] if s.in_flight == 0]
            for old in idle[: len(self._mcp_sessions) - MCP_MAX_SESSIONS]:
                self._retire(self._mcp_sessions.pop(old))
        return session

    async def list_mcp_tools(self, url: str, headers: Mapping[str, str], timeout_s: float) -> list[dict[str, Any]]:
        """``list_mcp_tools`` under these clients' egress rules."""
        return await list_mcp_tools(url, headers, timeout_s, egress=self.egress)

    def _retire(self, session: _McpSession, drain_s: float = 0.0) -> None:
        """Close ``session`` in the background (``aclose`` waits for it)."""
        task = asyncio.create_task(session.aclose(drain_s), name="mcp-session-close")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)


MCP_LIST_PAGES = 20


async def list_mcp_tools(
    url: str, headers: Mapping[str, str], timeout_s: float, *, egress: EgressPolicy
) -> list[dict[str, Any]]:
    """An MCP server's ``tools/list`` (all pages), as JSON entries (``name``, ``description``, ``inputSchema``, ...).

    Every request passes ``egress``.

    Raises:
        ToolCallFailed: ``timeout``, ``endpoint_unreachable``, ``http_error``, ``egress_denied`` or ``tool_error``
            (with the reason).
    """
    timeout = httpx2.Timeout(MCP_HTTP_TIMEOUT_S, read=timeout_s)
    entries: list[dict[str, Any]] = []
    try:
        egress.target(url)
    except EgressDenied as exc:
        raise ToolCallFailed("egress_denied", str(exc)) from exc
    try:
        async with (
            asyncio.timeout(timeout_s),
            mcp_client(headers, timeout, egress) as http,
            streamable_http_client(url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            cursor: str | None = None
            for _ in range(MCP_LIST_PAGES):
                params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await session.list_tools(params=params)
                entries += [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in page.tools]
                cursor = page.next_cursor
                if not cursor:
                    break
    except TimeoutError as exc:
        raise ToolCallFailed("timeout", f"the MCP server did not list its tools within {timeout_s:g} s") from exc
    except MCPError as exc:
        if (exc.error.code, exc.error.message) == _MCP_ERROR_STATUS:
            raise ToolCallFailed("http_error", "the MCP server answered an HTTP error status") from exc
        if (exc.error.code, exc.error.message) == _MCP_NOT_FOUND:
            raise ToolCallFailed("http_error", "HTTP 404 from the MCP server: no MCP endpoint at this url") from exc
        raise ToolCallFailed(
            "tool_error", f"MCP error {exc.error.code}: {exc.error.message[:ERROR_TEXT_CHARS]}"
        ) from exc
    except Exception as exc:  # the SDK's task groups raise ExceptionGroups
        raise _mcp_failure(exc, initializing=True) from exc
    return entries
