"""Egress rules (service/egress.py): what the broker's endpoint clients and callbacks may contact.

Refusals are shown to happen before any connection: private and metadata
addresses are never contacted (the inner transport is replaced by one that
fails the test if reached), and destinations off the allowlist are real
listeners on this machine's loopback (127.0.0.2, other ports) that must see
no connection at all.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import callbacks
from service.egress import EgressDenied, EgressPolicy, EgressRule, OwnAddress, is_public
from service.settings import Settings
from service.toolkit.endpoints import EndpointClients, ToolCallFailed
from service.toolkit.manifest import parse_tool
from tests.conftest import missing
from tests.toolserver import ToolServer

METADATA_AND_PRIVATE = [
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://100.100.100.200/latest/meta-data/",
    "http://168.63.129.16/machine",
    "http://10.0.0.1/",
    "http://172.16.5.4:8080/",
    "http://192.168.1.1/",
    "http://[fd12:3456::1]/",
    "http://[fe80::1]/",
    "http://[::ffff:10.0.0.1]/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://0.0.0.0:8080/",
    "http://[::a9fe:a9fe]/",  # IPv4-compatible ::169.254.169.254
    "http://[::10.0.0.1]/",
    "http://[2002:a9fe:a9fe::1]/",  # 6to4 around 169.254.169.254
    "http://[64:ff9b:1::a9fe:a9fe]/",  # local-use NAT64
]


class Listener:
    """A TCP listener that counts the connections it accepts (and answers each with ``reply``, if any)."""

    def __init__(self, host: str, reply: bytes = b"") -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.host, self.port = host, int(self.sock.getsockname()[1])
        self.accepted = 0
        self.reply = reply
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/tool"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    if self.reply:
                        conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def off_list() -> Iterator[list[Listener]]:
    """Two listeners the tests' rules never admit: one on 127.0.0.2, one on another port of 127.0.0.1."""
    listeners = [Listener("127.0.0.2"), Listener("127.0.0.1")]
    yield listeners
    for listener in listeners:
        listener.close()


class NoConnection(httpx.AsyncBaseTransport):
    """Stands in for the real transport: any request reaching it fails the test."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a request reached the network: {request.url}")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any request that passes the egress checks fails the test instead of connecting."""
    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", NoConnection.handle_async_request)


def http_tool(url: str) -> Any:
    return parse_tool({"name": "t", "endpoint": {"kind": "http", "url": url, "timeout_s": 5}}, ("tools", 0))


def mcp_tool(url: str) -> Any:
    return parse_tool({"name": "t", "endpoint": {"kind": "mcp", "url": url, "timeout_s": 5}}, ("tools", 0))


async def refused(clients: EndpointClients, tool: Any) -> str:
    with pytest.raises(ToolCallFailed) as caught:
        await clients.call(tool, {})
    assert caught.value.type == "egress_denied", caught.value
    return caught.value.message


@pytest.mark.parametrize(
    ("rule", "url", "admitted"),
    [
        ("https://api.example.com", "https://api.example.com/x", True),
        ("https://api.example.com", "https://api.example.com:8443/x", False),
        ("https://api.example.com", "http://api.example.com/x", False),
        ("api.example.com", "http://api.example.com/x", True),
        ("api.example.com:*", "http://api.example.com:81/x", True),
        ("https://*.example.com", "https://a.b.example.com/x", True),
        ("https://*.example.com", "https://example.com/x", False),
        ("https://*.example.com", "https://evilexample.com/x", False),
        ("http://127.0.0.1:8765", "http://127.0.0.1:8765/x", True),
        ("http://127.0.0.1:8765", "http://127.0.0.2:8765/x", False),
        ("http://127.0.0.1:8765", "http://127.0.0.1:8766/x", False),
        ("*://127.0.0.0/8:*", "https://127.9.9.9:1/x", True),
        ("*://[::1]:*", "http://[::1]:9/x", True),
        ("*://[fd00::/8]:*", "http://[fd12::1]/x", True),
        ("*://*:*", "http://anything.test:1/x", True),
        ("API.Example.COM.", "http://api.example.com./x", True),
    ],
)
def test_rules_match_scheme_host_and_port(rule: str, url: str, admitted: bool) -> None:
    target = httpx.URL(url)
    host = target.host.rstrip(".")
    port = target.port or {"http": 80, "https": 443}[target.scheme]
    assert EgressRule.parse(rule).admits_target(target.scheme, host, port) is admitted


@pytest.mark.parametrize("rule", ["ftp://x", "http://", "http://x:0", "http://x:99999", "http://[::1", "a b", "x/y"])
def test_bad_rules_are_refused(rule: str) -> None:
    with pytest.raises(ValueError, match="egress rule"):
        EgressRule.parse(rule)


@pytest.mark.parametrize("url", METADATA_AND_PRIVATE)
def test_non_public_addresses_are_refused_even_by_a_wildcard_rule(url: str) -> None:
    with pytest.raises(EgressDenied, match="non-public"):
        EgressPolicy(["*://*:*"]).target(url)


def test_metadata_addresses_are_not_public_even_where_routable() -> None:
    import ipaddress

    assert not is_public(ipaddress.ip_address("168.63.129.16"))  # Azure wireserver: a public address
    assert not is_public(ipaddress.ip_address("169.254.169.254"))
    assert is_public(ipaddress.ip_address("93.184.216.34"))  # only compared, never contacted


def test_an_address_rule_admits_a_private_network() -> None:
    policy = EgressPolicy(["http://10.1.2.0/24:8080"])
    assert policy.target("http://10.1.2.3:8080/x").host == "10.1.2.3"
    with pytest.raises(EgressDenied):
        policy.target("http://10.1.3.3:8080/x")


def test_the_default_reaches_no_loopback_or_private_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``PTC_EGRESS_ALLOW`` nothing is allowed: another service on this host (any loopback port), a private
    or metadata address, a public name; the refusal of a non-public address says how an operator admits it."""
    monkeypatch.delenv("PTC_EGRESS_ALLOW", raising=False)
    assert Settings().egress_allow == []
    policy = EgressPolicy(Settings().egress_allow)
    loopback = (
        "http://127.0.0.1:8765/x",
        "http://127.0.0.1:3000/login",
        "https://127.0.0.2:8443/x",
        "http://[::1]:9/x",
    )
    for url in (*loopback, "https://localhost:8443/x", "http://example.com/x", "http://2130706433/x"):
        with pytest.raises(EgressDenied, match="not on the egress allowlist"):
            policy.target(url)
    for url in (*loopback, *METADATA_AND_PRIVATE):
        with pytest.raises(EgressDenied, match="reached only when the operator names them, address and port"):
            policy.target(url)


def test_naming_an_address_and_port_admits_that_one_only() -> None:
    policy = EgressPolicy(["http://127.0.0.1:8765", "http://10.1.2.3:8080"])
    assert policy.target("http://127.0.0.1:8765/triangle_area").port == 8765
    assert policy.target("http://10.1.2.3:8080/x").host == "10.1.2.3"
    for url in (
        "http://127.0.0.1:8766/x",
        "https://127.0.0.1:8765/x",
        "http://127.0.0.2:8765/x",
        "http://10.1.2.4:8080/x",
    ):
        with pytest.raises(EgressDenied):
            policy.target(url)


async def test_default_endpoint_clients_connect_to_no_other_loopback_service(off_list: list[Listener]) -> None:
    """A real listener on another port of 127.0.0.1 (say Grafana, a balancer): the call fails with
    ``egress_denied`` and the listener never sees a connection."""
    clients = EndpointClients(5, 1024 * 1024)
    try:
        for listener in off_list:
            assert "names them" in await refused(clients, http_tool(listener.url))
            assert "names them" in await refused(clients, mcp_tool(listener.url))
    finally:
        await clients.aclose()
    await asyncio.sleep(0.3)  # a connection would have been accepted by now (the listeners poll every 0.1 s)
    assert [listener.accepted for listener in off_list] == [0, 0]


def test_ipv6_forms_that_embed_an_ipv4_address_are_judged_by_it() -> None:
    import ipaddress

    for embedding in ("::ffff:127.0.0.1", "::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1"):
        with pytest.raises(EgressDenied):  # judged by the embedded address: loopback, named by no rule
            EgressPolicy(["*://*:*"]).target(f"http://[{embedding}]/x")
    # A rule naming an IPv4 address admits that host only: its IPv4-mapped form, not a NAT64 gateway, an
    # IPv4-compatible address or a 6to4 site (another host, reached over IPv6) that embeds it.
    assert EgressPolicy(["*://127.0.0.1:80"]).target("http://[::ffff:127.0.0.1]/x").host == "::ffff:127.0.0.1"
    for other in ("::127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1", "2002:7f00:1:abcd::5"):
        with pytest.raises(EgressDenied):
            EgressPolicy(["*://127.0.0.1:80"]).target(f"http://[{other}]/x")
        with pytest.raises(EgressDenied):
            EgressPolicy(["*://127.0.0.0/8:*"]).target(f"http://[{other}]/x")
    assert EgressPolicy(["*://10.0.0.0/8:*"]).target("http://[::ffff:10.1.2.3]/x").port == 80
    assert is_public(ipaddress.ip_address("::5db8:d822"))  # ::93.184.216.34: only compared, never contacted
    EgressPolicy(["*://[::1]:*"]).target("http://[::1]:9/x")  # ::1 and :: are no IPv4-compatible addresses
    with pytest.raises(EgressDenied):
        EgressPolicy(["*://*:*"]).target("http://[::]:9/x")


def _local_ipv6() -> str | None:
    """A global IPv6 address of this host's own interfaces (not loopback), if it has one."""
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hexa, *_, scope, _flags, name = line.split()
        if name != "lo" and scope == "00":
            return str(ipaddress_from_hex(hexa))
    return None


def ipaddress_from_hex(hexa: str) -> Any:
    import ipaddress

    return ipaddress.IPv6Address(int(hexa, 16))


@pytest.mark.parametrize("bound", ["127.0.0.1", "0.0.0.0", "::", "localhost"])
async def test_the_services_own_address_is_refused_whatever_the_rules(bound: str, no_network: None) -> None:
    own = OwnAddress.of(bound, 8080)
    policy = EgressPolicy(["*://*:*", "*://127.0.0.0/8:*", "*://[::1]:*", "*://0.0.0.0/0:*", "*://[::/0]:*"], [own])
    for url in (
        "http://127.0.0.1:8080/execute",
        "http://127.9.9.9:8080/execute",
        "http://[::1]:8080/execute",
        "http://[::ffff:127.0.0.1]:8080/execute",
        "http://[::127.0.0.1]:8080/execute",
        "http://0.0.0.0:8080/execute",
        "http://[::]:8080/execute",
    ):
        with pytest.raises(EgressDenied, match="own address"):
            policy.target(url)
    with pytest.raises(EgressDenied, match="own address"):
        await policy.resolve("http://localhost:8080/execute")
    assert policy.target("http://127.0.0.1:8081/x").port == 8081  # another port of the host is not the service
    local = _local_ipv6()
    if local is not None and bound in ("0.0.0.0", "::", "localhost"):  # every address of the host
        with pytest.raises(EgressDenied, match="own address"):
            policy.target(f"http://[{local}]:8080/x")
    if local is not None and bound == "127.0.0.1":
        assert policy.target(f"http://[{local}]:8080/x").port == 8080


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://127.0.0.1/", "ws://127.0.0.1/"])
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(EgressDenied, match="scheme"):
        EgressPolicy().target(url)


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Answers for made-up names (``*.test``), counted in ``answers['_calls']``; other names resolve as usual."""
    answers: dict[str, list[str]] = {"_calls": []}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".test"):
            answers["_calls"].append(host)
            return [
                (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port)))
                for a in answers[host]
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers


async def test_a_name_resolving_to_metadata_is_refused_before_any_connection(
    fake_dns: dict[str, list[str]], no_network: None
) -> None:
    fake_dns["metadata.test"] = ["169.254.169.254"]
    fake_dns["mixed.test"] = ["10.0.0.1", "fd00:ec2::254"]
    clients = EndpointClients(5, 1024 * 1024, EgressPolicy(["*://*:*"]))
    try:
        assert "169.254.169.254" in await refused(clients, http_tool("http://metadata.test/latest"))
        assert "non-public" in await refused(clients, http_tool("http://mixed.test/x"))
    finally:
        await clients.aclose()


async def test_names_are_resolved_once_per_call_and_the_checked_address_is_used(
    fake_dns: dict[str, list[str]], tool_server: ToolServer
) -> None:
    """No second lookup (so no DNS rebinding between check and connect); Host keeps the name."""
    port = int(tool_server.url("x").split(":")[2].split("/")[0])
    fake_dns["tools.test"] = ["127.0.0.1"]
    # The name is allowed; its loopback answer only because an address rule names 127.0.0.1 too.
    policy = EgressPolicy([f"http://tools.test:{port}", f"http://127.0.0.1:{port}"])
    clients = EndpointClients(5, 1024 * 1024, policy)
    try:
        result = await clients.call(http_tool(f"http://tools.test:{port}/triangle_area"), {"base": 2, "height": 3})
        assert result == 3.0
        assert fake_dns["_calls"] == ["tools.test"]
        assert tool_server.headers[-1]["Host"] == f"tools.test:{port}"
        # Without the address rule, the same name is refused: a name rule admits public addresses only.
        strict = EndpointClients(5, 1024 * 1024, EgressPolicy([f"http://tools.test:{port}"]))
        try:
            assert "non-public" in await refused(strict, http_tool(f"http://tools.test:{port}/triangle_area"))
        finally:
            await strict.aclose()
    finally:
        await clients.aclose()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An https server on 127.0.0.1 whose self-signed certificate names only ``tools.test``; (port, cert)."""
    if shutil.which("openssl") is None:
        missing("no openssl to make a certificate (deploy/local.sh setup installs it)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=tools.test",
         "-addext", "subjectAltName=DNS:tools.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip

    class Hello(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a pooled connection could be reused

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps({"host": self.headers["Host"]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1]), cert
    httpd.shutdown()
    httpd.server_close()


async def test_https_to_the_checked_address_verifies_the_certificate_against_the_name(
    fake_dns: dict[str, list[str]], tls_server: tuple[int, Path]
) -> None:
    port, cert = tls_server
    fake_dns["tools.test"] = ["127.0.0.1"]
    fake_dns["other.test"] = ["127.0.0.1"]  # same address, a name the certificate does not carry
    policy = EgressPolicy([f"https://tools.test:{port}", f"https://other.test:{port}", f"https://127.0.0.1:{port}"])
    async with httpx.AsyncClient(transport=policy.transport(verify=ssl.create_default_context(cafile=cert))) as c:
        response = await c.post(f"https://tools.test:{port}/x", json={})
        assert response.json() == {"host": f"tools.test:{port}"}
        with pytest.raises(httpx.ConnectError, match="certificate"):  # not the pooled tools.test connection
            await c.post(f"https://other.test:{port}/x", json={})


@pytest.mark.parametrize("url", METADATA_AND_PRIVATE)
async def test_http_endpoints_at_private_or_metadata_addresses_are_refused(url: str, no_network: None) -> None:
    clients = EndpointClients(5, 1024 * 1024)
    try:
        await refused(clients, http_tool(url))
        await refused(clients, mcp_tool(url))
    finally:
        await clients.aclose()


async def test_endpoints_off_the_allowlist_receive_nothing(off_list: list[Listener], tool_server: ToolServer) -> None:
    allowed = tool_server.url("triangle_area")
    clients = EndpointClients(5, 1024 * 1024, EgressPolicy([allowed.rsplit("/", 1)[0]]))
    try:
        assert await clients.call(http_tool(allowed), {"base": 1, "height": 4}) == 2.0
        for listener in off_list:
            assert "not on the egress allowlist" in await refused(clients, http_tool(listener.url))
            await refused(clients, mcp_tool(listener.url))
        with pytest.raises(ToolCallFailed) as caught:
            await clients.list_mcp_tools(off_list[0].url, {}, 5)
        assert caught.value.type == "egress_denied"
        await asyncio.sleep(0.3)
    finally:
        await clients.aclose()
    assert [listener.accepted for listener in off_list] == [0, 0]


async def test_redirects_to_a_host_off_the_list_are_not_followed(off_list: list[Listener]) -> None:
    target = off_list[0]
    location = f"http://{target.host}:{target.port}/stolen"
    reply = f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    redirector = Listener("127.0.0.1", reply.encode())
    clients = EndpointClients(5, 1024 * 1024, EgressPolicy([f"http://127.0.0.1:{redirector.port}"]))
    try:
        with pytest.raises(ToolCallFailed) as caught:
            await clients.call(http_tool(redirector.url), {})
        assert caught.value.type == "http_error" and "302" in caught.value.message
        await asyncio.sleep(0.3)
    finally:
        await clients.aclose()
        redirector.close()
    assert redirector.accepted == 1
    assert target.accepted == 0


async def test_callbacks_off_the_list_make_one_attempt_and_send_nothing(off_list: list[Listener]) -> None:
    attempts: list[dict[str, Any]] = []
    policy = EgressPolicy(["http://127.0.0.1:1"])
    async with httpx.AsyncClient(transport=policy.transport()) as client:
        started = time.monotonic()
        delivered = await callbacks.deliver(
            client,
            off_list[0].url,
            b"{}",
            (callbacks.CallbackSecret.parse("secret"),),
            msg_id="msg_job_1",
            max_attempts=5,
            backoff_s=1,
            timeout_s=5,
            on_attempt=attempts.append,
        )
    assert delivered is False
    assert time.monotonic() - started < 1  # not retried
    assert len(attempts) == 1 and attempts[0]["error"].startswith("egress_denied: ")
    assert off_list[0].accepted == 0
