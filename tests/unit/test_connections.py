"""Slow and greedy HTTP clients (service.api.connections): header and body deadlines, connection caps.

Issue 11, item 12: connections that never finished their headers stayed open for ever. Raw sockets to
127.0.0.1 play the slow clients; a normal client (from 127.0.0.2 where the per-address cap is tested) is served
meanwhile.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.api.connections import ConnectionGuard, client_key, parse_networks
from service.api.problems import BAD_REQUEST, REQUEST_TIMEOUT, TOO_MANY_CONNECTIONS_FROM_ADDRESS
from service.settings import Settings
from tests.conftest import Service, start_service

HEADER_TIMEOUT_S = 2
DEFAULT_HEADER_TIMEOUT_S = Settings.model_fields["header_timeout_s"].default  # 10 s
PER_ADDRESS = 60
SLOW_CLIENTS = 50


@pytest.fixture(scope="module")
def guarded(scratch: Path) -> Iterator[Service]:
    service = start_service(
        f"pytest-conn-{secrets.token_hex(4)}",
        scratch / f"conn-{secrets.token_hex(4)}",
        probe="/healthz",
        PTC_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        PTC_BODY_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        PTC_MAX_CONNECTIONS_PER_ADDRESS=str(PER_ADDRESS),
        PTC_WARM_POOL_SIZE="0",
    )
    yield service
    service.stop()


def _connect(service: Service, source: str = "127.0.0.1") -> socket.socket:
    host, port = service.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15, source_address=(source, 0))
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it does not)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def problem_type(answer: bytes) -> str:
    """The ``type`` of a raw HTTP answer that must be problem+json (before: text/plain)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"\r\ncontent-type: application/problem+json\r\n" in head.lower(), head
    problem = json.loads(body)
    assert problem["status"] == int(head.split()[1]), problem
    return str(problem["type"])


def test_a_request_that_is_not_http_gets_a_bad_request_problem(guarded: Service) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and problem_type(answer) == BAD_REQUEST.uri


def test_partial_headers_are_closed_after_the_header_timeout_and_others_are_served(guarded: Service) -> None:
    started = time.monotonic()  # before the first connection: each one's deadline starts after this
    slow = [_connect(guarded) for _ in range(SLOW_CLIENTS)]
    try:
        for sock in slow:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
        with guarded.client(timeout=10) as client:
            assert client.get("/healthz").status_code == 200  # served while the slow ones hang
        answers = [_read_until_closed(sock) for sock in slow]  # before: socket.timeout, they stayed open
        elapsed = time.monotonic() - started
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0]
        assert problem_type(answers[0]) == REQUEST_TIMEOUT.uri
        # well before the default deadline (10 s): a service that ignored PTC_HEADER_TIMEOUT_S would pass a looser bound
        assert HEADER_TIMEOUT_S - 0.05 < elapsed < HEADER_TIMEOUT_S + 5 < DEFAULT_HEADER_TIMEOUT_S, elapsed
    finally:
        for sock in slow:
            sock.close()


def test_an_unfinished_body_is_closed_after_the_body_timeout(guarded: Service) -> None:
    head = (
        "POST /stubs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
        f"Authorization: Bearer {guarded.token}\r\n\r\n"
    )
    with _connect(guarded) as sock:
        sock.sendall(head.encode() + b'{"tools": [')  # the app waits for the rest of the body, which never comes
        started = time.monotonic()
        _read_until_closed(sock)  # before: socket.timeout
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 10


def test_connections_past_the_per_address_cap_are_refused(guarded: Service) -> None:
    held = [_connect(guarded) for _ in range(PER_ADDRESS)]
    try:
        with _connect(guarded) as extra:
            answer = _read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in answer
        assert problem_type(answer) == TOO_MANY_CONNECTIONS_FROM_ADDRESS.uri
        transport = httpx.HTTPTransport(local_address="127.0.0.2")  # another address is not held back
        with httpx.Client(base_url=guarded.url, transport=transport, timeout=10) as other:
            assert other.get("/healthz").status_code == 200
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)  # the server notices the closes
    with guarded.client(timeout=10) as client:
        assert client.get("/healthz").status_code == 200


def test_the_guard_counts_per_address_and_in_total_and_exempts_trusted_proxies() -> None:
    guard = ConnectionGuard(max_connections=4, max_per_address=2, exempt=parse_networks(["10.0.0.0/24", "::1"]))
    assert [guard.admit("192.0.2.1") for _ in range(3)] == [None, None, 429]
    assert guard.admit("10.0.0.7") is None and guard.admit("::ffff:10.0.0.7") is None  # a proxy: no per-address cap
    assert guard.admit("10.0.0.7") == 503  # the total still applies
    guard.release("192.0.2.1")
    assert guard.admit("192.0.2.1") is None and guard.open == 4
    assert guard.admit(None) == 503
    assert parse_networks(["127.0.0.1"]) == (ipaddress.ip_network("127.0.0.1/32"),)
    with pytest.raises(ValueError):
        parse_networks(["not-an-address"])


def test_ipv6_clients_are_counted_by_their_64_and_mapped_ipv4_by_its_ipv4_address() -> None:
    guard = ConnectionGuard(max_connections=0, max_per_address=2)
    # rotating addresses within one /64 (a host may use any of them) gets no new caps
    assert [guard.admit(f"2001:db8:1:2::{n:x}") for n in range(1, 4)] == [None, None, 429]
    assert guard.admit("2001:db8:1:2:ffff:ffff:ffff:ffff") == 429
    assert guard.admit("2001:db8:1:3::1") is None  # another /64: another client
    guard.release("2001:db8:1:2::1")
    assert guard.admit("2001:db8:1:2::abcd") is None
    # an IPv4-mapped IPv6 address is its IPv4 address
    assert guard.admit("192.0.2.9") is None and guard.admit("::ffff:192.0.2.9") is None
    assert guard.admit("::ffff:c000:209") == 429 and guard.admit("192.0.2.9") == 429
    assert client_key("2001:DB8::1:2:3:4") == "2001:db8::/64"
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3" and client_key("10.1.2.3") == "10.1.2.3"
    assert client_key("not-an-ip") == "not-an-ip"
