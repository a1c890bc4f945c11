"""Attacks on the replicated mode (issue 17): a network peer that is not a replica, and a tenant pressing on the
resources the replicas share (the signed path's body read, the peers' connections)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress

import httpx
import pytest
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from service.api.auth import BearerAuth
from service.egress import EgressDenied, EgressPolicy
from service.errors import OwnerElsewhere, OwnerUnavailable, QuotaExceeded
from service.replicas import internal
from service.replicas import remote as remote_module
from service.replicas.remote import Remote
from service.tenancy import KeyRing, hash_token, parse_keys
from tests.conftest import TEST_EGRESS_RULES

SECRET = b"s" * 32


def refusal(reason: str) -> Response:
    return JSONResponse({"detail": reason}, status_code=401)


async def test_a_forged_signed_request_is_refused_before_its_body_is_read() -> None:
    """Any network peer may send ``Ptc-Internal-Signature``: its body (up to ``PTC_MAX_BODY_BYTES``) was read and
    held before the signature could be checked (it covers the body's digest), gathered by ``body += piece``
    (quadratic: a body trickled in small TCP segments cost minutes of CPU on the event loop). The signature now
    covers the digest announced in ``Ptc-Internal-Body-SHA256`` and is checked first: nothing of a forgery's body
    is read."""
    sent = 0

    async def receive() -> Message:
        nonlocal sent
        sent += 1
        return {"type": "http.request", "body": b"x" * 65536, "more_body": sent < 128}

    answers: list[Message] = []

    async def send(message: Message) -> None:
        answers.append(message)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("a forged request reached the app")

    verifier = internal.Verifier([SECRET])
    verifier.target = "t1.1"
    keys = KeyRing(parse_keys(f"alice:{hash_token('a' * 40)}"))
    auth = BearerAuth(app, keys, frozenset(), refusal, verifier, body_limit=64 << 20)
    forged = internal.signed_headers(b"w" * 32, "POST", "/execute", "alice", "t2", "t1.1", b"x" * (8 << 20))
    headers = [(name.encode(), value.encode()) for name, value in forged.items()]
    scope: Scope = {"type": "http", "method": "POST", "path": "/execute", "raw_path": b"/execute", "headers": headers}
    await auth(scope, receive, send)
    assert sent == 0
    assert answers[0]["status"] == 401
    assert verifier.counts == {"bad_signature": 1}

    # a replica's request: checked first, then its body read and compared with the digest it announced
    body = b"x" * 65536 * 128
    good = internal.signed_headers(SECRET, "POST", "/execute", "alice", "t2", "t1.1", body)
    reached: list[bytes] = []

    async def app_ok(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append((await receive())["body"])

    sent = 0
    scope["headers"] = [(name.encode(), value.encode()) for name, value in good.items()]
    await BearerAuth(app_ok, keys, frozenset(), refusal, verifier, body_limit=64 << 20)(scope, receive, send)
    assert reached == [body]
    assert verifier.counts == {"bad_signature": 1, "accepted": 1}


class HoldingPeer:
    """A peer on 127.0.0.1 answering ``/hold`` with the headers of an endless stream (a relayed event stream or
    wait) and anything else at once."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.held: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        for writer in self.held:
            writer.close()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /hold"):
                    writer.write(stream)
                    await writer.drain()
                    self.held.append(writer)
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def test_one_keys_held_relays_leave_the_peers_connections_to_the_others() -> None:
    """A tenant holding many relayed event streams (or waits) of its own jobs running on another replica must not
    take every connection of the peers' client: the others' relayed requests used to wait for one for ever (no
    pool timeout). One key holds at most ``MAX_PER_CALLER`` relays at once; past it a 429 (``relayed_requests``)."""
    async with HoldingPeer() as url:
        remote = Remote(SECRET, "t2")
        owner = OwnerElsewhere("job", "job_x", "t1", 1, url)
        held: list[httpx.Response] = []
        refused = 0
        try:
            for _ in range(remote_module.MAX_CONNECTIONS):
                try:
                    held.append(await asyncio.wait_for(remote.open(owner, "GET", "/hold", "mallory"), 30))
                except QuotaExceeded as exc:
                    assert exc.reason == "relayed_requests"
                    refused += 1
            assert refused > 0
            quick = await asyncio.wait_for(remote.call_json(owner, "GET", "/jobs/job_y", "alice"), 30)
            assert quick == (200, {})
            await held.pop().aclose()  # a stream that ends gives its place back
            held.append(await asyncio.wait_for(remote.open(owner, "GET", "/hold", "mallory"), 30))
        finally:
            for answer in held:
                await answer.aclose()
            await remote.aclose()


async def test_one_tenant_has_every_connection_to_the_peers() -> None:
    """With one tenant (one key name) there is no other key to leave connections to: its relays are not capped at
    ``MAX_PER_CALLER`` (issue 24 item 7: one tenant's quotas default to the whole)."""
    async with HoldingPeer() as url:
        remote = Remote(SECRET, "t2", single_tenant=True)
        owner = OwnerElsewhere("job", "job_x", "t1", 1, url)
        held: list[httpx.Response] = []
        try:
            for _ in range(remote_module.MAX_PER_CALLER + 1):
                held.append(await asyncio.wait_for(remote.open(owner, "GET", "/hold", "solo"), 30))
            assert remote.relaying("solo") == remote_module.MAX_PER_CALLER + 1
        finally:
            for answer in held:
                await answer.aclose()
            await remote.aclose()


class SilentPeer:
    """A peer on 127.0.0.1 that takes connections and answers nothing (a paused replica: its kernel still accepts)
    or, with ``headers``, the headers of a stream and then nothing."""

    def __init__(self, headers: bool) -> None:
        self.headers = headers
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        for writer in self.writers:
            writer.close()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            if self.headers:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                writer.write(b"6\r\nid: 1\n\r\n")
                await writer.drain()


async def test_a_relay_to_an_owner_that_stopped_answering_ends_when_its_lease_passes() -> None:
    """A paused (SIGSTOP) or hung owner still accepts connections and answers nothing: the relay, which has no read
    timeout (a relayed wait or event stream lasts its own time), waited for ever, past the owner's lease and its
    jobs being marked lost. Once the registry says the owner's lease passed: 503 before the answer's headers, the
    stream ended after them."""
    holds = [True]
    owner = OwnerElsewhere("job", "job_x", "t1", 1, "")
    for headers in (False, True):
        async with SilentPeer(headers) as url:
            remote = Remote(SECRET, "t2")
            remote.alive = lambda _: holds[0]
            owner.url = url
            holds[0] = True
            try:

                async def lease_passes() -> None:
                    await asyncio.sleep(1.0)
                    holds[0] = False

                passing = asyncio.create_task(lease_passes())
                if not headers:
                    with pytest.raises(OwnerUnavailable):
                        await asyncio.wait_for(remote.open(owner, "GET", "/jobs/job_x", "alice"), 30)
                else:
                    answer = await asyncio.wait_for(remote.open(owner, "GET", "/jobs/job_x/events", "alice"), 30)
                    chunks = await asyncio.wait_for(_read_all(answer), 30)
                    assert chunks == b"id: 1\n"
                    await answer.aclose()
                await passing
                assert remote.relaying("alice") == 0
            finally:
                await remote.aclose()


async def _read_all(answer: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in answer.aiter_raw()])


def test_one_keys_flood_of_relayed_requests_leaves_the_nonce_set_to_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every relayed request leaves its nonce in the owner's set for 60 s; one key relaying requests fast enough
    filled the whole set, and every key's relays to that owner were refused (503 ``busy``) until nonces expired. A key
    now has at most ``MAX_NONCES_PER_CALLER`` of them: past it its own relays are refused, the others' are not."""
    monkeypatch.setattr(internal, "MAX_NONCES", 40)
    monkeypatch.setattr(internal, "MAX_NONCES_PER_CALLER", 10, raising=False)
    checker = internal.Verifier([SECRET])
    checker.target = "t1.1"

    def relayed(caller: str) -> str | None:
        headers = internal.signed_headers(SECRET, "GET", "/jobs/j", caller, "t2", "t1.1", b"")
        return checker.verify("GET", "/jobs/j", headers, b"")

    admitted = 0
    with pytest.raises(internal.InternalRefused) as flooded:
        for _ in range(internal.MAX_NONCES + 1):
            assert relayed("mallory") == "mallory"
            admitted += 1
    assert flooded.value.outcome == "busy"
    assert admitted == internal.MAX_NONCES_PER_CALLER  # refused at its own bound, not at the whole set's
    assert relayed("alice") == "alice"


async def test_a_replica_named_by_host_name_is_refused_by_its_address_too() -> None:
    """A replica whose ``PTC_INTERNAL_URL`` names a host (``http://localhost:7002``): a tool call or callback aimed
    at its address (``http://127.0.0.1:7002``, ``http://[::ffff:127.0.0.1]:7002``) reached it, only the name was
    refused."""
    policy = EgressPolicy(TEST_EGRESS_RULES)  # the rules admit the peer's address: only its being one refuses it
    policy.refuse_peers(["http://localhost:7002"])
    for url in ("http://localhost:7002/x", "http://127.0.0.1:7002/x", "http://[::ffff:127.0.0.1]:7002/x"):
        with pytest.raises(EgressDenied):
            await policy.resolve(url)
    target, addresses = await policy.resolve("http://127.0.0.1:7003/x")  # another port: not a replica
    assert (target.host, target.port, addresses) == ("127.0.0.1", 7003, [ipaddress.ip_address("127.0.0.1")])


async def test_without_authentication_relays_are_bounded_by_the_connections_only() -> None:
    """With ``PTC_AUTH=disabled`` every request is the one tenant's (caller None): the per-key bound does not apply."""
    async with HoldingPeer() as url:
        remote = Remote(SECRET, "t2")
        owner = OwnerElsewhere("job", "job_x", "t1", 1, url)
        held: list[httpx.Response] = []
        try:
            for _ in range(remote_module.MAX_PER_CALLER + 1):
                held.append(await asyncio.wait_for(remote.open(owner, "GET", "/hold", None), 30))
        finally:
            for answer in held:
                await answer.aclose()
            await remote.aclose()
