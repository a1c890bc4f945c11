"""Sync and async clients of the ptc-sandbox HTTP API (docs/client.md).

Every method raises :class:`~ptc_sandbox_client.errors.ProblemError` (or a subclass) for a problem+json answer and
``httpx.HTTPError`` for a transport failure that retries did not overcome. Retries (``max_retries``, default 2) are
made only where a second request cannot run anything twice: GETs, ``POST /jobs/{id}/wait`` (it only reads), and POSTs
that carry an ``Idempotency-Key``; on a connection error, ``429`` or ``503``, after ``Retry-After`` (at most
``max_retry_wait_s``) or an exponential back-off.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx

from ._sse import SSEParser
from ._tools import call_error, client_manifest, refused_answer
from .errors import ConflictError, ProblemError, problem_from_response, retry_after_s
from .models import Event, JobView, SessionFile, SessionView, Stream

logger = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({429, 503})
_MAX_SERVER_WAIT_S = 300.0
_STREAM_READ_S = 60.0  # an event stream silent this long is dead: the service pings every 15 s; resumed after
_WAIT_PATH = re.compile(r"/jobs/[^/?#]+/wait")


def _seg(value: str) -> str:
    """An id as one path segment: ``/``, ``?``, ``#``, ``%`` and the rest percent-encoded, so an id from elsewhere
    (a model's text) names no other route (``../execute``) and adds no query."""
    return quote(value, safe="")


def _path(value: str) -> str:
    """A file path as path segments: each encoded as by ``_seg``, ``.`` and ``..`` too (httpx would resolve them
    before sending: ``a/../../../execute``); the service refuses such a path itself."""
    return "/".join(
        quote(part, safe="") if part not in (".", "..") else part.replace(".", "%2E") for part in value.split("/")
    )


def _view_params(calls: str | None, fields: str | list[str] | None) -> dict[str, str]:
    params: dict[str, str] = {}
    if calls is not None:
        params["calls"] = calls
    if fields is not None:
        params["fields"] = fields if isinstance(fields, str) else ",".join(fields)
    return params


def _execute_body(script: str, tools: Any, toolset: str | None, wait_s: float | None, body: dict[str, Any]) -> Any:
    payload: dict[str, Any] = {"script": script, **{k: v for k, v in body.items() if v is not None}}
    if tools is not None:
        payload["tools"] = tools
    if toolset is not None:
        payload["toolset"] = toolset
    if wait_s is not None:
        payload["wait_s"] = wait_s
    return payload


class _Base:
    max_response_bytes: int = 256 * 1024 * 1024
    """Largest answer body read (bytes); a larger one raises ``httpx.ReadError`` (a broken or hostile server)."""
    body_time_factor: float = 4.0
    """An answer's body must be whole within this many times the request's timeout of its first byte, else
    ``httpx.ReadTimeout`` (a server dripping bytes would never trip the timeout between two reads)."""

    def __init__(
        self, base_url: str, token: str | None, timeout: float, max_retries: int, max_retry_wait_s: float
    ) -> None:
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_retry_wait_s = max_retry_wait_s

    def _url(self, path: str) -> str:
        """``path`` on ``base_url``: absolute, so a caller's own ``http=`` client needs no base URL of its own."""
        return self.base_url + path

    def _headers(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        """The token's ``Authorization`` and ``headers``: every request carries the token, a caller's own ``http=``
        client too."""
        return {**self.headers, **dict(headers or {})}

    @staticmethod
    def _safe(method: str, url: str, headers: Mapping[str, str] | None) -> bool:
        if method == "GET":
            return True
        if method == "POST" and _WAIT_PATH.fullmatch(url):  # not /jobs/{id}/calls/wait, an answer
            return True
        return method == "POST" and any(k.lower() == "idempotency-key" for k in headers or {})

    @staticmethod
    def _retry_status(response: httpx.Response) -> bool:
        if response.status_code in _RETRY_STATUSES:
            return True
        # The first request with this Idempotency-Key is still being admitted: the repeat answers as it does.
        return response.status_code == 409 and "idempotency-key-in-flight" in response.text[:300]

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        after = retry_after_s(response) if response is not None else None
        return min(after if after is not None else 0.5 * 2**attempt, self.max_retry_wait_s)

    def _take(self, response: httpx.Response, size: int, deadline: float) -> None:
        """Raise when the body read so far (``size`` bytes) is too large or late."""
        if size > self.max_response_bytes:
            raise httpx.ReadError(f"the answer exceeds {self.max_response_bytes} bytes", request=response.request)
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("the answer's body was not whole in time", request=response.request)

    @staticmethod
    def _whole(response: httpx.Response, body: bytes) -> httpx.Response:
        """``response`` with the ``body`` read (decoded: its encoding headers dropped)."""
        headers = [
            (k, v)
            for k, v in response.headers.multi_items()
            if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")
        ]
        return httpx.Response(
            response.status_code,
            headers=headers,
            content=body,
            request=response.request,
            extensions=response.extensions,
        )

    @staticmethod
    def _events(parser: SSEParser, text: str, response: httpx.Response) -> list[Event]:
        """The events a piece of an event stream completes; raises httpx.DecodingError (not resumed) for an event
        over the parser's ``max_event_chars``."""
        try:
            return parser.feed_text(text)
        except ValueError as error:
            raise httpx.DecodingError(str(error), request=response.request) from None

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        # A 3xx too: the API redirects nowhere, and following one could carry the token to another host.
        if response.status_code >= 300:
            raise problem_from_response(response)
        return response


class Client(_Base):
    """A synchronous client: ``Client("http://127.0.0.1:8080", token=...)``; use as a context manager or ``close()``.

    ``timeout`` is httpx's per-operation timeout in seconds (a server-side wait adds its own length to it).
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 2,
        max_retry_wait_s: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout, max_retries, max_retry_wait_s)
        self.http = http or httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """One request with safe retries; raises ``ProblemError`` for an error answer."""
        attempt = 0
        safe = self._safe(method, url, headers)
        while True:
            try:
                response = self._send(method, url, params, json, content, headers, timeout)
            except httpx.TransportError:
                if not safe or attempt >= self.max_retries:
                    raise
                time.sleep(self._delay(attempt, None))
                attempt += 1
                continue
            if safe and self._retry_status(response) and attempt < self.max_retries:
                time.sleep(self._delay(attempt, response))
                attempt += 1
                continue
            return self._check(response)

    def _send(
        self,
        method: str,
        url: str,
        params: Mapping[str, Any] | None,
        json: Any,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float | None,
    ) -> httpx.Response:
        """One request; its answer read whole, at most ``max_response_bytes`` within ``body_time_factor`` times
        its timeout (raises httpx.TransportError)."""
        seconds = timeout if timeout is not None else self.timeout
        request = self.http.build_request(
            method,
            self._url(url),
            params=params,
            json=json,
            content=content,
            headers=self._headers(headers),
            timeout=seconds,
        )
        response = self.http.send(request, stream=True)
        try:
            deadline, parts, size = time.monotonic() + self.body_time_factor * seconds, [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                self._take(response, size, deadline)
                parts.append(chunk)
        finally:
            response.close()
        return self._whole(response, b"".join(parts))

    # Jobs

    def execute(
        self,
        script: str,
        *,
        tools: list[dict[str, Any]] | None = None,
        toolset: str | None = None,
        wait_s: float | None = None,
        idempotency_key: str | None = None,
        calls: str | None = None,
        fields: str | list[str] | None = None,
        **body: Any,
    ) -> JobView:
        """``POST /execute``: the final view if the job ended within ``wait_s`` (server default 30), else the view so
        far. ``body`` takes the other fields (``language``, ``timeout_s``, ``limits``, ``image``, ``env``, ``metadata``,
        ``callback_url``, ``session_id``, ``files``, ...)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        timeout = self.timeout + (wait_s if wait_s is not None else 30.0)
        response = self.request(
            "POST",
            "/execute",
            json=_execute_body(script, tools, toolset, wait_s, body),
            params=_view_params(calls, fields),
            headers=headers,
            timeout=timeout,
        )
        return JobView.model_validate(response.json())

    def get(self, job_id: str, *, calls: str | None = None, fields: str | list[str] | None = None) -> JobView:
        """``GET /jobs/{id}``: the job's view."""
        return JobView.model_validate(
            self.request("GET", f"/jobs/{_seg(job_id)}", params=_view_params(calls, fields)).json()
        )

    def wait(
        self,
        job_id: str,
        timeout_s: float = 30.0,
        *,
        calls: str | None = None,
        fields: str | list[str] | None = None,
    ) -> JobView:
        """``POST /jobs/{id}/wait`` (repeated past the server's 300 s): the view once the job ended, waits for the
        caller (status ``waiting``), or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            step = min(left, _MAX_SERVER_WAIT_S)
            params = {**_view_params(calls, fields), "timeout_s": f"{step:.3f}"}
            view = JobView.model_validate(
                self.request("POST", f"/jobs/{_seg(job_id)}/wait", params=params, timeout=self.timeout + step).json()
            )
            if view.ended or view.status == "waiting" or time.monotonic() >= deadline:
                return view

    def stop(self, job_id: str, *, calls: str | None = None, fields: str | list[str] | None = None) -> JobView:
        """``POST /jobs/{id}/stop``: the view (final, unchanged, if the job had already ended)."""
        return JobView.model_validate(
            self.request("POST", f"/jobs/{_seg(job_id)}/stop", params=_view_params(calls, fields)).json()
        )

    def output(self, job_id: str, stream: Stream = "stdout", offset: int = 0, length: int | None = None) -> bytes:
        """``GET /jobs/{id}/output/{stream}``: the retained raw bytes from ``offset`` (``length`` of them, or all)."""
        params: dict[str, Any] = {"offset": offset}
        if length is not None:
            params["length"] = length
        return self.request("GET", f"/jobs/{_seg(job_id)}/output/{_seg(stream)}", params=params).content

    def job_file(self, job_id: str, path: str) -> bytes:
        """``GET /jobs/{id}/files/{path}``: an output file the view lists in ``files``."""
        return self.request("GET", f"/jobs/{_seg(job_id)}/files/{_path(path)}").content

    def answer_call(
        self, job_id: str, call_id: str, *, result: Any = None, error: Mapping[str, Any] | None = None
    ) -> JobView:
        """``POST /jobs/{id}/calls/{call_id}``: answers a client-executed call with ``result`` or ``error``
        (``{"type", "message"}``); raises ``ConflictError`` (``call-not-pending``) when it does not wait."""
        body = {"error": dict(error)} if error is not None else {"result": result}
        return JobView.model_validate(
            self.request("POST", f"/jobs/{_seg(job_id)}/calls/{_seg(call_id)}", json=body).json()
        )

    def stream(
        self,
        job_id: str,
        *,
        last_event_id: str | None = None,
        calls: str | None = None,
        fields: str | list[str] | None = None,
        max_reconnects: int = 5,
    ) -> Iterator[Event]:
        """``GET /jobs/{id}/events``: the events up to and including ``end``. A dropped connection is resumed with
        ``Last-Event-ID`` (the last id received; no event twice, none missing), at most ``max_reconnects`` times in a
        row without an event between."""
        parser = SSEParser(last_id=last_event_id, max_event_chars=self.max_response_bytes)
        failures = 0
        while True:
            headers = {"Last-Event-ID": parser.last_id} if parser.last_id else {}
            try:
                with self.http.stream(
                    "GET",
                    self._url(f"/jobs/{_seg(job_id)}/events"),
                    params=_view_params(calls, fields),
                    headers=self._headers(headers),
                    timeout=httpx.Timeout(self.timeout, read=max(self.timeout, _STREAM_READ_S)),
                ) as response:
                    if response.status_code == 204:
                        return
                    if response.status_code >= 400:
                        response.read()
                        self._check(response)
                    parser.reset()  # an event cut by a dropped connection comes again whole
                    for text in response.iter_text():
                        for event in self._events(parser, text, response):
                            failures = 0
                            yield event
                            if event.event == "end":
                                return
            except httpx.TransportError:
                pass
            failures += 1
            if failures > max_reconnects:
                raise httpx.ReadError(f"the event stream of {job_id} dropped {failures} times in a row")
            time.sleep(self._delay(failures - 1, None))

    def run_with_tools(
        self,
        script: str,
        tools: Mapping[str, Callable[..., Any]],
        *,
        schemas: Mapping[str, dict[str, Any]] | None = None,
        other_tools: list[dict[str, Any]] | None = None,
        wait_s: float = 30.0,
        timeout_s: float | None = None,
        poll_s: float = 0.5,
        **body: Any,
    ) -> JobView:
        """Runs ``script`` with ``tools`` (name → callable) as client-executed tools and answers each pending call
        with the callable's return value (``{"result": ...}``, JSON-serialisable) or, if it raises, an error
        (``{"type": <exception class>, "message": str(error)}``), until the job ends; the final view. Schemas come
        from the signatures unless ``schemas`` gives them; ``other_tools`` are manifest entries added as they are.
        While the job waits on something else (an approval, a tool not in ``tools``) the view is polled every
        ``poll_s`` seconds; a call that is no longer pending when answered (it timed out) is passed over. An answer
        the service refuses (``413``: larger than its body limit; ``422``) is replaced by the error ``{"type":
        "AnswerRefused", ...}``, so the script gets ``tools.ToolError`` rather than this call raising mid-job."""
        manifest = client_manifest(tools, schemas) + list(other_tools or [])
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        view = self.execute(script, tools=manifest, wait_s=wait_s, **body)
        while not view.ended:
            pending = [c for c in view.pending_calls if c.awaiting == "client" and c.tool in tools]
            if not pending:
                if view.status == "waiting":  # on an approval or another's tool: the server's wait answers at once
                    time.sleep(poll_s)
                    view = self.get(view.job_id)
                else:
                    view = self.wait(view.job_id, wait_s)
                continue
            for call in pending:
                try:
                    args = call.args if isinstance(call.args, dict) else {}
                    answer: dict[str, Any] = {"result": tools[call.tool](**args)}
                except Exception as error:  # the tool's failure goes to the script as a ToolError
                    answer = call_error(error)
                try:
                    try:
                        view = self.answer_call(view.job_id, call.call_id, **answer)
                    except ConflictError:
                        raise
                    except ProblemError as error:  # the answer itself refused (too large, not JSON the service takes)
                        if (refusal := refused_answer(error)) is None:
                            raise
                        view = self.answer_call(view.job_id, call.call_id, **refusal)
                except ConflictError:  # no longer pending (it timed out, or the job ended)
                    view = self.get(view.job_id)
        return view

    # Toolsets and stubs

    def register_toolset(
        self, tools: list[dict[str, Any]] | None = None, mcp_servers: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """``POST /toolsets``: registers a manifest (and MCP servers' tools); ``{"toolset_id", "tools"}``."""
        body = {k: v for k, v in (("tools", tools), ("mcp_servers", mcp_servers)) if v is not None}
        return dict(self.request("POST", "/toolsets", json=body).json())

    def stubs(self, tools: list[dict[str, Any]] | None = None, toolset: str | None = None) -> dict[str, Any]:
        """``POST /stubs``: ``{"module", "usage", "toolset_id"}``, the ``tools`` module a script imports and the usage
        text for a model's prompt."""
        body = {k: v for k, v in (("tools", tools), ("toolset", toolset)) if v is not None}
        return dict(self.request("POST", "/stubs", json=body).json())

    # Sessions

    def session(self, *, idempotency_key: str | None = None, **body: Any) -> Session:
        """``POST /sessions`` (``body``: ``limits``, ``image``, ``tools``, ``idle_timeout_s``, ``metadata``, ...);
        a :class:`Session`, a context manager that deletes the session on exit."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        response = self.request("POST", "/sessions", json=body, headers=headers, timeout=self.timeout + 120)
        return Session(self, SessionView.model_validate(response.json()))

    def get_session(self, session_id: str) -> SessionView:
        """``GET /sessions/{id}``."""
        return SessionView.model_validate(self.request("GET", f"/sessions/{_seg(session_id)}").json())

    def delete_session(self, session_id: str) -> SessionView:
        """``DELETE /sessions/{id}`` (idempotent)."""
        return SessionView.model_validate(self.request("DELETE", f"/sessions/{_seg(session_id)}").json())


class Session:
    """An open session: ``execute`` runs in it, files are put, got and listed; ``close()`` (or leaving the ``with``
    block) deletes it."""

    def __init__(self, client: Client, view: SessionView) -> None:
        self.client = client
        self.view = view
        self.session_id = view.session_id

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> SessionView:
        """Deletes the session (stops its running script)."""
        self.view = self.client.delete_session(self.session_id)
        return self.view

    def execute(self, script: str, **kwargs: Any) -> JobView:
        """``Client.execute`` with this session's ``session_id``."""
        return self.client.execute(script, session_id=self.session_id, **kwargs)

    def put_file(self, path: str, data: bytes | str) -> None:
        """``PUT /sessions/{id}/files/{path}``: writes ``data`` under the session's ``/tmp``."""
        content = data.encode() if isinstance(data, str) else data
        self.client.request("PUT", f"/sessions/{_seg(self.session_id)}/files/{_path(path)}", content=content)

    def get_file(self, path: str) -> bytes:
        """``GET /sessions/{id}/files/{path}``: the file's bytes."""
        return self.client.request("GET", f"/sessions/{_seg(self.session_id)}/files/{_path(path)}").content

    def list_files(self) -> list[SessionFile]:
        """``GET /sessions/{id}/files``: the files under ``/tmp``."""
        body = self.client.request("GET", f"/sessions/{_seg(self.session_id)}/files").json()
        return [SessionFile.model_validate(f) for f in body.get("files", [])]


class AsyncClient(_Base):
    """The asynchronous twin of :class:`Client` (same methods, awaited; ``stream`` is an async iterator; the
    callables of ``run_with_tools`` may be coroutine functions)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 2,
        max_retry_wait_s: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, token, timeout, max_retries, max_retry_wait_s)
        self.http = http or httpx.AsyncClient(base_url=self.base_url, timeout=timeout, headers=self.headers)
        self.stopping: set[asyncio.Task[None]] = set()  # stops of the jobs of cancelled run_with_tools, under way

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool, after the stops of cancelled ``run_with_tools`` jobs (at most ``timeout`` s)."""
        if self.stopping:
            await asyncio.wait(set(self.stopping), timeout=self.timeout)
        await self.http.aclose()

    def _stop_soon(self, job_id: str) -> None:
        """Stop the job in a task of its own (``stopping``): its waiter was cancelled, and the task cannot wait."""

        async def stop() -> None:
            try:
                await self.stop(job_id)
            except Exception:  # the job still ends at its timeout_s
                logger.warning("could not stop job %s of a cancelled run_with_tools", job_id, exc_info=True)

        task = asyncio.get_running_loop().create_task(stop())
        self.stopping.add(task)
        task.add_done_callback(self.stopping.discard)

    async def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (httpx's per-request timeout)
    ) -> httpx.Response:
        """One request with safe retries; raises ``ProblemError`` for an error answer."""
        attempt = 0
        safe = self._safe(method, url, headers)
        while True:
            try:
                response = await self._send(method, url, params, json, content, headers, timeout)
            except httpx.TransportError:
                if not safe or attempt >= self.max_retries:
                    raise
                await asyncio.sleep(self._delay(attempt, None))
                attempt += 1
                continue
            if safe and self._retry_status(response) and attempt < self.max_retries:
                await asyncio.sleep(self._delay(attempt, response))
                attempt += 1
                continue
            return self._check(response)

    async def _send(
        self,
        method: str,
        url: str,
        params: Mapping[str, Any] | None,
        json: Any,
        content: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float | None,  # noqa: ASYNC109 (httpx's per-request timeout)
    ) -> httpx.Response:
        """As :meth:`Client._send`."""
        seconds = timeout if timeout is not None else self.timeout
        request = self.http.build_request(
            method,
            self._url(url),
            params=params,
            json=json,
            content=content,
            headers=self._headers(headers),
            timeout=seconds,
        )
        response = await self.http.send(request, stream=True)
        try:
            deadline, parts, size = time.monotonic() + self.body_time_factor * seconds, [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                self._take(response, size, deadline)
                parts.append(chunk)
        finally:
            await response.aclose()
        return self._whole(response, b"".join(parts))

    async def execute(
        self,
        script: str,
        *,
        tools: list[dict[str, Any]] | None = None,
        toolset: str | None = None,
        wait_s: float | None = None,
        idempotency_key: str | None = None,
        calls: str | None = None,
        fields: str | list[str] | None = None,
        **body: Any,
    ) -> JobView:
        """As :meth:`Client.execute`."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        timeout = self.timeout + (wait_s if wait_s is not None else 30.0)
        response = await self.request(
            "POST",
            "/execute",
            json=_execute_body(script, tools, toolset, wait_s, body),
            params=_view_params(calls, fields),
            headers=headers,
            timeout=timeout,
        )
        return JobView.model_validate(response.json())

    async def get(self, job_id: str, *, calls: str | None = None, fields: str | list[str] | None = None) -> JobView:
        """As :meth:`Client.get`."""
        response = await self.request("GET", f"/jobs/{_seg(job_id)}", params=_view_params(calls, fields))
        return JobView.model_validate(response.json())

    async def wait(
        self,
        job_id: str,
        timeout_s: float = 30.0,
        *,
        calls: str | None = None,
        fields: str | list[str] | None = None,
    ) -> JobView:
        """As :meth:`Client.wait`."""
        deadline = time.monotonic() + timeout_s
        while True:
            step = min(max(0.0, deadline - time.monotonic()), _MAX_SERVER_WAIT_S)
            params = {**_view_params(calls, fields), "timeout_s": f"{step:.3f}"}
            response = await self.request(
                "POST", f"/jobs/{_seg(job_id)}/wait", params=params, timeout=self.timeout + step
            )
            view = JobView.model_validate(response.json())
            if view.ended or view.status == "waiting" or time.monotonic() >= deadline:
                return view

    async def stop(self, job_id: str, *, calls: str | None = None, fields: str | list[str] | None = None) -> JobView:
        """As :meth:`Client.stop`."""
        response = await self.request("POST", f"/jobs/{_seg(job_id)}/stop", params=_view_params(calls, fields))
        return JobView.model_validate(response.json())

    async def output(self, job_id: str, stream: Stream = "stdout", offset: int = 0, length: int | None = None) -> bytes:
        """As :meth:`Client.output`."""
        params: dict[str, Any] = {"offset": offset}
        if length is not None:
            params["length"] = length
        return (await self.request("GET", f"/jobs/{_seg(job_id)}/output/{_seg(stream)}", params=params)).content

    async def job_file(self, job_id: str, path: str) -> bytes:
        """As :meth:`Client.job_file`."""
        return (await self.request("GET", f"/jobs/{_seg(job_id)}/files/{_path(path)}")).content

    async def answer_call(
        self, job_id: str, call_id: str, *, result: Any = None, error: Mapping[str, Any] | None = None
    ) -> JobView:
        """As :meth:`Client.answer_call`."""
        body = {"error": dict(error)} if error is not None else {"result": result}
        return JobView.model_validate(
            (await self.request("POST", f"/jobs/{_seg(job_id)}/calls/{_seg(call_id)}", json=body)).json()
        )

    async def stream(
        self,
        job_id: str,
        *,
        last_event_id: str | None = None,
        calls: str | None = None,
        fields: str | list[str] | None = None,
        max_reconnects: int = 5,
    ) -> AsyncIterator[Event]:
        """As :meth:`Client.stream`."""
        parser = SSEParser(last_id=last_event_id, max_event_chars=self.max_response_bytes)
        failures = 0
        while True:
            headers = {"Last-Event-ID": parser.last_id} if parser.last_id else {}
            try:
                async with self.http.stream(
                    "GET",
                    self._url(f"/jobs/{_seg(job_id)}/events"),
                    params=_view_params(calls, fields),
                    headers=self._headers(headers),
                    timeout=httpx.Timeout(self.timeout, read=max(self.timeout, _STREAM_READ_S)),
                ) as response:
                    if response.status_code == 204:
                        return
                    if response.status_code >= 400:
                        await response.aread()
                        self._check(response)
                    parser.reset()  # an event cut by a dropped connection comes again whole
                    async for text in response.aiter_text():
                        for event in self._events(parser, text, response):
                            failures = 0
                            yield event
                            if event.event == "end":
                                return
            except httpx.TransportError:
                pass
            failures += 1
            if failures > max_reconnects:
                raise httpx.ReadError(f"the event stream of {job_id} dropped {failures} times in a row")
            await asyncio.sleep(self._delay(failures - 1, None))

    async def run_with_tools(
        self,
        script: str,
        tools: Mapping[str, Callable[..., Any] | Callable[..., Awaitable[Any]]],
        *,
        schemas: Mapping[str, dict[str, Any]] | None = None,
        other_tools: list[dict[str, Any]] | None = None,
        wait_s: float = 30.0,
        timeout_s: float | None = None,
        poll_s: float = 0.5,
        max_concurrency: int = 16,
        **body: Any,
    ) -> JobView:
        """As :meth:`Client.run_with_tools`; a coroutine function's result is awaited, and the pending calls of one
        view run concurrently, at most ``max_concurrency`` at once (a script that gathers thousands of calls does not
        get thousands of tool runs at once in this process). When this call is cancelled (an agent's run cancelled)
        after the job started, the job is stopped in the background (``aclose`` waits for it) rather than left
        waiting on its calls until its ``timeout_s``."""
        manifest = client_manifest(tools, schemas) + list(other_tools or [])
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        view = await self.execute(script, tools=manifest, wait_s=wait_s, **body)
        try:
            return await self._answer_until_ended(view, tools, wait_s, poll_s, asyncio.Semaphore(max_concurrency))
        except asyncio.CancelledError:
            self._stop_soon(view.job_id)
            raise

    async def _answer_until_ended(
        self,
        view: JobView,
        tools: Mapping[str, Callable[..., Any] | Callable[..., Awaitable[Any]]],
        wait_s: float,
        poll_s: float,
        slots: asyncio.Semaphore,
    ) -> JobView:
        """Answer ``view``'s pending calls with ``tools`` (as many at once as ``slots`` lets) until the job ends; its
        final view."""

        async def run(name: str, args: Any) -> dict[str, Any]:
            async with slots:
                try:
                    value = tools[name](**(args if isinstance(args, dict) else {}))
                    return {"result": await value if inspect.isawaitable(value) else value}
                except Exception as error:  # the tool's failure goes to the script as a ToolError
                    return call_error(error)

        while not view.ended:
            pending = [c for c in view.pending_calls if c.awaiting == "client" and c.tool in tools]
            if not pending:
                if view.status == "waiting":  # on an approval or another's tool: the server's wait answers at once
                    await asyncio.sleep(poll_s)
                    view = await self.get(view.job_id)
                else:
                    view = await self.wait(view.job_id, wait_s)
                continue
            answers = await asyncio.gather(*(run(c.tool, c.args) for c in pending))
            for call, answer in zip(pending, answers, strict=True):
                try:
                    try:
                        view = await self.answer_call(view.job_id, call.call_id, **answer)
                    except ConflictError:
                        raise
                    except ProblemError as error:  # the answer itself refused (too large, not JSON the service takes)
                        if (refusal := refused_answer(error)) is None:
                            raise
                        view = await self.answer_call(view.job_id, call.call_id, **refusal)
                except ConflictError:  # no longer pending (it timed out, or the job ended)
                    view = await self.get(view.job_id)
        return view

    async def register_toolset(
        self, tools: list[dict[str, Any]] | None = None, mcp_servers: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """As :meth:`Client.register_toolset`."""
        body = {k: v for k, v in (("tools", tools), ("mcp_servers", mcp_servers)) if v is not None}
        return dict((await self.request("POST", "/toolsets", json=body)).json())

    async def stubs(self, tools: list[dict[str, Any]] | None = None, toolset: str | None = None) -> dict[str, Any]:
        """As :meth:`Client.stubs`."""
        body = {k: v for k, v in (("tools", tools), ("toolset", toolset)) if v is not None}
        return dict((await self.request("POST", "/stubs", json=body)).json())

    async def session(self, *, idempotency_key: str | None = None, **body: Any) -> AsyncSession:
        """As :meth:`Client.session`: ``async with await client.session(...) as s:``."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        response = await self.request("POST", "/sessions", json=body, headers=headers, timeout=self.timeout + 120)
        return AsyncSession(self, SessionView.model_validate(response.json()))

    async def get_session(self, session_id: str) -> SessionView:
        """As :meth:`Client.get_session`."""
        return SessionView.model_validate((await self.request("GET", f"/sessions/{_seg(session_id)}")).json())

    async def delete_session(self, session_id: str) -> SessionView:
        """As :meth:`Client.delete_session`."""
        return SessionView.model_validate((await self.request("DELETE", f"/sessions/{_seg(session_id)}")).json())


class AsyncSession:
    """The asynchronous twin of :class:`Session`."""

    def __init__(self, client: AsyncClient, view: SessionView) -> None:
        self.client = client
        self.view = view
        self.session_id = view.session_id

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> SessionView:
        """Deletes the session."""
        self.view = await self.client.delete_session(self.session_id)
        return self.view

    async def execute(self, script: str, **kwargs: Any) -> JobView:
        """``AsyncClient.execute`` with this session's ``session_id``."""
        return await self.client.execute(script, session_id=self.session_id, **kwargs)

    async def put_file(self, path: str, data: bytes | str) -> None:
        """As :meth:`Session.put_file`."""
        content = data.encode() if isinstance(data, str) else data
        await self.client.request("PUT", f"/sessions/{_seg(self.session_id)}/files/{_path(path)}", content=content)

    async def get_file(self, path: str) -> bytes:
        """As :meth:`Session.get_file`."""
        return (await self.client.request("GET", f"/sessions/{_seg(self.session_id)}/files/{_path(path)}")).content

    async def list_files(self) -> list[SessionFile]:
        """As :meth:`Session.list_files`."""
        body = (await self.client.request("GET", f"/sessions/{_seg(self.session_id)}/files")).json()
        return [SessionFile.model_validate(f) for f in body.get("files", [])]
