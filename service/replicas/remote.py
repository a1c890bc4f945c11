"""The peers' client: a request relayed to the replica that owns its job or session, signed (``replicas.internal``),
its answer streamed back (docs/scaling.md, Internal calls; issue 17, step 3).

One ``httpx.AsyncClient`` for every peer: connect within ``CONNECT_S``, no read timeout (a relayed ``wait`` or
event stream lasts as long as it lasts; the caller's own connection bounds it), no proxies from the environment,
no egress rules (peers are the one destination the egress rules refuse to scripts' tools and callbacks). A peer
refused, reset or silent before its answer's headers is ``OwnerUnavailable`` (503 ``owner-unavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import httpx
import orjson

from service.errors import OwnerElsewhere, QuotaExceeded
from service.replicas import internal

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_S = 1.0
"""Longest wait for a connection to a peer (s)."""
MAX_CONNECTIONS = 256
"""Connections open to the peers at most (all together)."""
MAX_PER_CALLER = MAX_CONNECTIONS // 4
"""Relayed requests of one caller (key name) open at once at most, event streams and waits included: one key's
held streams cannot take every connection to the peers (past it: 429 ``relayed_requests``)."""
WATCH_S = 0.5
"""How often a relay still waiting for its owner looks whether the owner still holds its lease (s): a paused or
hung owner accepts connections (the kernel does) and answers nothing, and a relay has no read timeout."""
POOL_S = 10.0
"""Longest wait for a free connection to the peers (s); past it the request is ``OwnerUnavailable`` (503), never
an endless wait."""
SENT_HEADERS = ("content-type", "idempotency-key", "last-event-id", "traceparent")
"""The caller's headers a relayed request carries besides the internal ones (never its bearer token)."""
RELAYED_HEADERS = (
    "content-type",
    "content-length",
    "location",
    "retry-after",
    "idempotent-replayed",
    "cache-control",
    "x-offset",
    "x-content-sha256",
    "content-disposition",
    "x-content-type-options",
)
"""The owner's answer headers relayed back to the caller."""


class Remote:
    """Requests to the other replicas.

    Args:
        secret: the first ``PTC_INTERNAL_SECRET`` (signs every request).
        source: this replica's instance id (``Ptc-Internal-Source``).
        transport: a transport for tests (default: httpx's own, over TCP).
        single_tenant: one tenant (``auth.single_tenant``): its relays are not capped per key (``MAX_PER_CALLER``),
            only by the connections (``MAX_CONNECTIONS``), since there is no other key to leave them to.
    """

    def __init__(
        self,
        secret: bytes,
        source: str,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        single_tenant: bool = False,
    ) -> None:
        self._secret = secret
        self._per_caller = None if single_tenant else MAX_PER_CALLER
        self._source = source
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_S, pool=POOL_S),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=32),
            trust_env=False,
            follow_redirects=False,
            transport=transport,
        )
        self._open: dict[str, int] = {}  # caller -> relayed requests whose answer is not closed yet
        self.alive: Callable[[OwnerElsewhere], bool] | None = None
        """Whether an owner's incarnation still holds its lease (the registry cache; set by the app): a relay to
        one that lost it ends (``OwnerUnavailable`` before the answer's headers; the body cut after)."""

    async def open(
        self,
        owner: OwnerElsewhere,
        method: str,
        path: str,
        caller: str | None,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send one signed request to ``owner`` and return its answer once its headers arrived; the body is read
        by the caller (``aiter_raw``), which must close it (``aclose``).

        Args:
            owner: where the job or session is (``OwnerElsewhere``: internal URL, incarnation).
            method, path: the public route's method and raw path with its query string.
            caller: the caller's key name (None: authentication disabled).
            body: the raw body to send.
            headers: the caller's headers to send along (only ``SENT_HEADERS`` are).

        Raises:
            OwnerUnavailable: the owner could not be reached, or failed before its answer's headers, or no
                connection to the peers was free within ``POOL_S``.
            QuotaExceeded: ``caller`` has ``MAX_PER_CALLER`` relayed requests open already (reason
                ``relayed_requests``; never with one tenant: authentication disabled, or one key name).
        """
        who = caller or ""
        cap = self._per_caller
        if who and cap is not None and self._open.get(who, 0) >= cap:  # "": authentication disabled, one tenant
            raise QuotaExceeded(
                f"at most {cap} requests of one key are relayed to other replicas at once (event streams "
                "and waits included); retry when one has ended",
                "relayed_requests",
                cap,
                1,
            )
        self._open[who] = self._open.get(who, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self._open.pop(who) - 1
                if left:
                    self._open[who] = left

        sent = {name: value for name, value in (headers or {}).items() if name.lower() in SENT_HEADERS}
        sent["accept-encoding"] = "identity"
        request = self._client.build_request(method, owner.url + path, content=body, headers=sent)
        raw_path = request.url.raw_path.decode("ascii")
        request.headers.update(
            internal.signed_headers(
                self._secret,
                method,
                raw_path,
                caller,
                self._source,
                owner.target,
                body,
                request.headers.get("idempotency-key"),
                request.headers.get("last-event-id"),
            )
        )
        alive = self.alive
        try:
            answer = await _watched(self._client.send(request, stream=True), lambda: alive is None or alive(owner))
        except httpx.HTTPError as exc:
            release()
            log.warning("the owner %s could not be reached: %s", owner.target, type(exc).__name__)
            raise owner.unavailable() from exc
        except BaseException:
            release()
            raise
        if answer is None:
            release()
            log.warning("the owner %s lost its lease before answering", owner.target)
            raise owner.unavailable()
        assert isinstance(answer.stream, httpx.AsyncByteStream)  # an async client's
        answer.stream = _Released(answer.stream, release, lambda: alive is None or alive(owner))
        return answer

    def relaying(self, caller: str | None) -> int:
        """How many relayed requests of ``caller`` have an answer not closed yet."""
        return self._open.get(caller or "", 0)

    async def call_json(
        self, owner: OwnerElsewhere, method: str, path: str, caller: str | None
    ) -> tuple[int, dict[str, Any]]:
        """One bodiless signed request whose answer is JSON (a view, or a problem): ``(status, parsed body)``.

        Raises:
            OwnerUnavailable: as ``open``, or the answer was cut or is not a JSON object.
        """
        response = await self.open(owner, method, path, caller)
        try:
            data = await response.aread()
        except httpx.HTTPError as exc:
            raise owner.unavailable() from exc
        finally:
            await response.aclose()
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise owner.unavailable()
        return response.status_code, parsed

    async def aclose(self) -> None:
        """Close the connections."""
        await self._client.aclose()


async def _watched(step: Awaitable[T], alive: Callable[[], bool]) -> T | None:
    """``step``'s result, or None (``step`` cancelled) once ``alive()`` says false, asked every ``WATCH_S``."""
    task = asyncio.ensure_future(step)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_S)
            if done:
                return task.result()
            if not alive():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return None
    except BaseException:
        task.cancel()
        raise


class _Released(httpx.AsyncByteStream):
    """An answer's body that ends when its owner loses its lease (``alive``) and calls ``release`` once when it is
    closed (``Response.aclose``)."""

    def __init__(self, stream: httpx.AsyncByteStream, release: Callable[[], None], alive: Callable[[], bool]) -> None:
        self._stream = stream
        self._release = release
        self._alive = alive

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._stream)
        while True:
            try:
                chunk = await _watched(anext(chunks), self._alive)
            except StopAsyncIteration:
                return
            if chunk is None:
                log.warning("a relayed answer was cut: its owner lost its lease")
                return
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._release()
