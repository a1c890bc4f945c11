"""Egress rules: which hosts the service itself may contact for tool endpoints, MCP servers and callbacks.

A manifest names the URLs the broker calls, so without rules a manifest could
turn the service into a proxy into the operator's network (cloud metadata at
169.254.169.254, an admin panel on 10.0.0.1). Every outgoing HTTP request of
``http`` and ``mcp`` endpoints, of MCP ``tools/list`` at toolset registration and
of completion callbacks goes through ``EgressTransport``, which:

1. checks the URL's (scheme, host, port) against the allowlist (``PTC_EGRESS_ALLOW``);
2. resolves the host name once, for this request;
3. refuses every resolved address that is not public (private, loopback,
   link-local, shared, reserved, multicast, cloud metadata; IPv6 forms that embed
   an IPv4 address are judged by the IPv4 address inside: IPv4-mapped ``::ffff:0:0/96``,
   IPv4-compatible ``::/96``, NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``, 6to4
   ``2002::/16``) unless a rule names that address or its network;
   and refuses the service's own listening address (``PTC_HOST:PTC_PORT``) whatever the
   rules say: at that port, every loopback address, the unspecified addresses (0.0.0.0
   and ``::`` reach the local host), the bound address itself and, when the service binds
   every address (0.0.0.0, ``::``), any address of this host; so a tool call or callback
   can never reach the service's own API;
4. connects to an address that passed (never resolving the name again, so a
   second DNS answer cannot swap in another address: no DNS rebinding), with
   the original ``Host`` header and TLS server name, so certificates are still
   checked against the name.

Redirects are never followed by the service's clients (``follow_redirects=False``);
the MCP SDK follows redirects within the endpoint's origin only, and each such
request passes through the same checks.

Rule syntax (one per comma-separated entry): ``[scheme://]host[:port]``

- scheme: ``http``, ``https`` or ``*`` (both; also when omitted);
- host: a DNS name (``api.example.com``), a suffix wildcard (``*.example.com``:
  names below it), ``*`` (any name or address), an IPv4 address or network
  (``10.1.2.0/24``), or an IPv6 address or network in brackets (``[fd00::/8]``);
- port: a number, or ``*`` for any; omitted = the scheme's default (80, 443).

A name rule admits the public addresses the name resolves to; to reach a
non-public address, an address or network rule must cover it too.

There is no rule by default: a loopback or private address (another service on
this host, a database, Grafana, a balancer in front of the service) is reached
only when the operator names it, best with its port (``http://127.0.0.1:8765``).

Errors: ``EgressDenied`` (a ``PtcError``); the endpoint clients turn it into the
tool error type ``egress_denied``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from service.errors import PtcError
from service.settings.egress_syntax import SCHEME_DEFAULT_PORT, SCHEMES, IPNetwork, parse_rule

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_PORTS = {"http": 80, "https": 443}
# Cloud metadata services; the link-local and unique-local ones are refused as non-public anyway, the public
# ones (Azure's wireserver) only by this list. Sources: AWS IMDS (169.254.169.254, fd00:ec2::254), GCP, Azure
# (168.63.129.16), Alibaba Cloud (100.100.100.200), Oracle (192.0.0.192).
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "fd00:ec2::254", "168.63.129.16", "100.100.100.200", "192.0.0.192")
)
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))  # RFC 6052, RFC 8215
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated (RFC 4291 2.5.5.1), still ::a.b.c.d
_SIXTOFOUR = ipaddress.ip_network("2002::/16")  # RFC 3056: 2002:AABB:CCDD::/48 embeds AA.BB.CC.DD
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_UNSPECIFIED = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))
FORBIDDEN_HEADERS = frozenset(
    {"host", "transfer-encoding", "content-length", "connection", "keep-alive", "te", "trailer", "upgrade"}
)
"""Header names (lower case) a manifest may not set (nor any ``proxy-*``): the client frames and routes the
request itself; a manifest's own framing or hop-by-hop headers could smuggle a second request or reroute it."""
MAX_TLS_POOLS = 256  # https connection pools (one per name) an EgressTransport keeps


class EgressDenied(PtcError):
    """A request to a destination the egress rules do not allow; nothing was sent to it."""


def _normalized(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address embeds, else the address without its scope.

    Embedding forms: IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible (``::a.b.c.d``, not ``::`` nor ``::1``),
    NAT64 (``64:ff9b::a.b.c.d``, ``64:ff9b:1::/48`` with the IPv4 address in its last 32 bits), 6to4
    (``2002:AABB:CCDD::/48``).
    """
    address = _same_host(address)
    if isinstance(address, ipaddress.IPv6Address):
        if address.sixtofour is not None:
            return address.sixtofour
        if any(address in prefix for prefix in _NAT64) or (address in _IPV4_COMPATIBLE and int(address) > 1):
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def _same_host(address: IPAddress) -> IPAddress:
    """The address a connection to ``address`` reaches, as an address rule names it: an IPv4-mapped IPv6 address
    (``::ffff:a.b.c.d``) is ``a.b.c.d``; the other embedding forms (``_normalized``) name other hosts (a NAT64
    gateway, a 6to4 site), so a rule naming the IPv4 address does not admit them, though the deny checks judge
    them by it."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
    return address


def url_problem(url: str) -> str | None:
    """Why ``url`` may not name an endpoint or callback (credentials in it), or None.

    Credentials belong in the endpoint's ``headers`` (they stay on the host and out of logs and views);
    ``user:pass@`` in a URL would be shown wherever the URL is.
    """
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"not a valid URL: {exc}"
    if parsed.userinfo:
        return "credentials in the URL (user:password@) are not allowed; send them in headers"
    return None


def header_problem(name: str) -> str | None:
    """Why a manifest may not set header ``name`` (``FORBIDDEN_HEADERS``, ``Proxy-*``), or None."""
    lowered = name.lower()
    if lowered in FORBIDDEN_HEADERS or lowered.startswith("proxy-"):
        return f"header {name!r} is set by the service itself (framing and hop-by-hop headers are not allowed)"
    return None


def _is_local(address: IPAddress) -> bool:
    """Whether ``address`` is one of this host's own addresses (a socket can bind it)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class OwnAddress:
    """Where the service itself listens: ``host`` (None: every address, or a name) and ``port``."""

    host: IPAddress | None
    port: int

    @classmethod
    def of(cls, host: str, port: int) -> OwnAddress:
        """From ``PTC_HOST`` and ``PTC_PORT``; a name or an unspecified address means every local address."""
        address = _ip(host.strip("[]"))
        if address is not None:
            address = _normalized(address)
            if address in _UNSPECIFIED:
                address = None
        return cls(address, port)

    def covers(self, address: IPAddress, port: int) -> bool:
        """Whether a connection to (``address``, ``port``) could reach the service itself."""
        if port != self.port:
            return False
        address = _normalized(address)
        if address in _UNSPECIFIED or any(address in net for net in _LOOPBACK) or address == self.host:
            return True
        return self.host is None and _is_local(address)


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` is a globally routed unicast address that is no cloud metadata service."""
    address = _normalized(address)
    return address.is_global and not address.is_multicast and address not in METADATA_ADDRESSES


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True)
class EgressRule:
    """One allowlist entry (see the module docstring for its syntax).

    Attributes:
        schemes: the URL schemes it admits.
        name: a lower-case DNS name, ``*.suffix``, or ``*``; None for an address rule.
        network: the addresses it admits; None for a name rule.
        port: the port it admits; None for any; ``SCHEME_DEFAULT_PORT`` for the URL scheme's default (80, 443).
    """

    schemes: frozenset[str]
    name: str | None
    network: IPNetwork | None
    port: int | None

    @classmethod
    def parse(cls, text: str) -> EgressRule:
        """Parse one rule (``service.settings.egress_syntax``); raises ValueError saying what is wrong."""
        return cls(*parse_rule(text))

    def _port_ok(self, scheme: str, port: int) -> bool:
        if self.port is None:
            return True
        if self.port == SCHEME_DEFAULT_PORT:
            return port == DEFAULT_PORTS[scheme]
        return port == self.port

    def admits_target(self, scheme: str, host: str, port: int) -> bool:
        """Whether the URL's (scheme, host, port) matches this rule (host lower-case, no trailing dot)."""
        if scheme not in self.schemes or not self._port_ok(scheme, port):
            return False
        if self.network is not None:
            address = _ip(host)
            return address is not None and _same_host(address) in self.network
        assert self.name is not None
        if self.name == "*":
            return True
        if self.name.startswith("*."):
            return host.endswith(self.name[1:]) and _ip(host) is None
        return host == self.name

    def admits_address(self, scheme: str, address: IPAddress, port: int) -> bool:
        """Whether this is an address rule that names ``address`` (so a non-public address is allowed)."""
        return (
            self.network is not None
            and scheme in self.schemes
            and self._port_ok(scheme, port)
            and _same_host(address) in self.network
        )


def _naming_hint(address: IPAddress | None) -> str:
    """The end of a refusal of a non-public address: how an operator admits it."""
    if address is None or is_public(address):
        return ""
    return "; loopback and private addresses are reached only when the operator names them, address and port"


@dataclass(frozen=True)
class Target:
    """Where a URL points: lower-case scheme and host (no trailing dot) and the effective port."""

    scheme: str
    host: str
    port: int


PEER_NAMES_TTL_S = 30.0
"""How long the addresses of the replicas' internal host names are kept before they are resolved again (s)."""


class EgressPolicy:
    """The allowlist, and the checks every outgoing request of the service passes.

    Args:
        rules: rule texts (``PTC_EGRESS_ALLOW``); default: none (nothing may be contacted).
        own: where the service itself listens (``OwnAddress.of(PTC_HOST, PTC_PORT)``); refused whatever the
            rules say.

    Raises:
        ValueError: a rule cannot be parsed.
    """

    def __init__(self, rules: Iterable[str] = (), own: Iterable[OwnAddress] = ()) -> None:
        self.rules = tuple(EgressRule.parse(rule) for rule in rules if rule.strip())
        self.own = tuple(own)
        self.peers: tuple[OwnAddress, ...] = ()
        self._peer_names: frozenset[tuple[str, int]] = frozenset()
        self._named_peers: tuple[OwnAddress, ...] = ()  # the addresses _peer_names resolved to
        self._named_for: frozenset[tuple[str, int]] = frozenset()  # the names _named_peers were resolved from
        self._named_at = 0.0  # when (monotonic s)

    def refuse_peers(self, urls: Iterable[str]) -> None:
        """Refuse the other replicas' internal addresses as the service's own (each registered replica's internal
        URL, from the registry cache: ``Replicas.on_registry``); replaces the previous list."""
        addresses: list[OwnAddress] = []
        names: set[tuple[str, int]] = set()
        for url in urls:
            try:
                parsed = httpx.URL(url)
            except httpx.InvalidURL:
                continue
            host = parsed.host.lower().rstrip(".")
            port = parsed.port or DEFAULT_PORTS.get(parsed.scheme.lower(), 80)
            address = _ip(host)
            if address is None:
                names.add((host, port))
            else:
                addresses.append(OwnAddress(_normalized(address), port))
        self.peers, self._peer_names = tuple(addresses), frozenset(names)

    def target(self, url: str | httpx.URL) -> Target:
        """Check ``url`` against the rules without resolving it; returns where it points.

        Raises:
            EgressDenied: not http(s), no rule admits (scheme, host, port), or the host is an
                address that is not public and that no address rule names.
        """
        try:
            parsed = httpx.URL(url) if isinstance(url, str) else url
        except httpx.InvalidURL as exc:
            raise EgressDenied(f"not a valid URL: {exc}") from None
        scheme, host = parsed.scheme.lower(), parsed.host.lower().rstrip(".")
        if scheme not in SCHEMES:
            raise EgressDenied(f"scheme {scheme!r} is not allowed (http and https only)")
        if not host:
            raise EgressDenied("the URL has no host")
        port = parsed.port or DEFAULT_PORTS[scheme]
        where = f"{scheme}://{parsed.netloc.decode('ascii', 'replace').rpartition('@')[2]}"
        address = _ip(host)
        if (address is not None and self.is_own(address, port)) or (host, port) in self._peer_names:
            raise EgressDenied(f"{where} is this service's own address")
        if not any(rule.admits_target(scheme, host, port) for rule in self.rules):
            raise EgressDenied(f"{where} is not on the egress allowlist (PTC_EGRESS_ALLOW){_naming_hint(address)}")
        if address is not None and not self.address_allowed(scheme, address, port):
            raise EgressDenied(
                f"{where} is a non-public address that no egress rule names (PTC_EGRESS_ALLOW){_naming_hint(address)}"
            )
        return Target(scheme, host, port)

    def is_own(self, address: IPAddress, port: int) -> bool:
        """Whether (``address``, ``port``) could reach the service itself or another of its replicas
        (``OwnAddress.covers``; a replica whose internal URL names a host: the addresses it resolved to)."""
        return any(own.covers(address, port) for own in (*self.own, *self.peers, *self._named_peers))

    async def _resolve_peer_names(self) -> None:
        """Resolve the replicas' internal host names (``refuse_peers``) again when they changed or every
        ``PEER_NAMES_TTL_S``: a URL naming a peer by its address is refused as one naming it by its name."""
        names, now = self._peer_names, time.monotonic()
        if names == self._named_for and (not names or now - self._named_at < PEER_NAMES_TTL_S):
            return
        found: list[OwnAddress] = []
        for host, port in names:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                )
            except OSError:
                continue
            found.extend(OwnAddress(_normalized(ipaddress.ip_address(info[4][0])), port) for info in infos)
        self._named_peers, self._named_for, self._named_at = tuple(found), names, now

    def address_allowed(self, scheme: str, address: IPAddress, port: int) -> bool:
        """Whether a resolved ``address`` may be contacted: not the service's own, and public or named by an
        address rule."""
        if self.is_own(address, port):
            return False
        return is_public(address) or any(rule.admits_address(scheme, address, port) for rule in self.rules)

    async def resolve(self, url: str | httpx.URL) -> tuple[Target, list[IPAddress]]:
        """Check ``url`` and resolve its host once; returns the addresses that may be contacted, in DNS order.

        Raises:
            EgressDenied: as ``target``, or every address the name resolves to is refused.
            httpx.ConnectError: the name does not resolve.
        """
        await self._resolve_peer_names()
        target = self.target(url)
        literal = _ip(target.host)
        if literal is not None:
            return target, [literal]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
            )
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {target.host}: {exc}") from exc
        addresses: list[IPAddress] = []
        for *_, sockaddr in infos:
            address = ipaddress.ip_address(sockaddr[0])
            if address not in addresses:
                addresses.append(address)
        allowed = [a for a in addresses if self.address_allowed(target.scheme, a, target.port)]
        if not allowed:
            shown = ", ".join(map(str, addresses)) or "nothing"
            if any(self.is_own(a, target.port) for a in addresses):
                raise EgressDenied(f"{target.host} resolves to {shown}: this service's own address")
            raise EgressDenied(f"{target.host} resolves to {shown}: non-public addresses that no egress rule names")
        return target, allowed

    def transport(self, **kwargs: Any) -> EgressTransport:
        """An httpx transport that enforces these rules; ``kwargs`` go to ``httpx.AsyncHTTPTransport``."""
        return EgressTransport(self, **kwargs)


class EgressTransport(httpx.AsyncBaseTransport):
    """httpx transport: checks each request with an ``EgressPolicy`` and connects to the checked address.

    The request is sent to the resolved address (tried in DNS order while connecting fails) with its
    original ``Host`` header and, for https, the original name as TLS server name (so the certificate
    is verified against the name).

    Connection pools are keyed by address, so https gets one pool per name (up to ``MAX_TLS_POOLS``;
    names past that share a pool that keeps no connection open): a TLS connection verified for one
    name is never reused for another name on the same address. Plain http shares one pool (its
    ``Host`` header routes each request).

    Raises (from ``handle_async_request``):
        EgressDenied: before anything is sent.
        httpx.ConnectError: the name does not resolve, or no allowed address accepts a connection.
    """

    def __init__(self, policy: EgressPolicy, **kwargs: Any) -> None:
        self._policy = policy
        self._kwargs = kwargs
        self._plain = httpx.AsyncHTTPTransport(**kwargs)
        self._tls: dict[str, httpx.AsyncHTTPTransport] = {}
        limits: httpx.Limits = kwargs.get("limits", httpx.Limits())
        unpooled = httpx.Limits(max_connections=limits.max_connections, max_keepalive_connections=0)
        self._tls_overflow = httpx.AsyncHTTPTransport(**{**kwargs, "limits": unpooled})

    def _transport(self, target: Target) -> httpx.AsyncHTTPTransport:
        if target.scheme != "https":
            return self._plain
        transport = self._tls.get(target.host)
        if transport is None:
            if len(self._tls) >= MAX_TLS_POOLS:
                return self._tls_overflow
            transport = self._tls[target.host] = httpx.AsyncHTTPTransport(**self._kwargs)
        return transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target, addresses = await self._policy.resolve(request.url)
        extensions = dict(request.extensions)
        if target.scheme == "https":
            extensions["sni_hostname"] = target.host
        inner = self._transport(target)
        failure: httpx.ConnectError | None = None
        for address in addresses:
            pinned = httpx.Request(
                request.method,
                request.url.copy_with(host=str(address)),
                headers=request.headers,  # keeps Host: the original name
                stream=request.stream,
                extensions=extensions,
            )
            try:
                return await inner.handle_async_request(pinned)
            except httpx.ConnectError as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def aclose(self) -> None:
        for transport in (self._plain, self._tls_overflow, *self._tls.values()):
            await transport.aclose()
