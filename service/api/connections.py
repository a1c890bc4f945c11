"""Slow and greedy HTTP clients: read deadlines and connection caps, below the ASGI app.

uvicorn's only timer is ``timeout_keep_alive``, which runs between requests
and stops at the first byte of the next one, so a client that sends half a
request line and then nothing (or a byte every few seconds: slowloris) keeps
its connection, and a slot, for ever; and ASGI middleware cannot help, as it
runs only once a request's headers are complete. So the service runs
uvicorn's h11 protocol (``GuardedH11Protocol``, made by ``guarded_protocol``)
with, per connection:

- a **header deadline**: a request's line and headers must be complete
  within ``header_timeout_s`` of the moment the connection may send them (it
  opened, or the previous response ended); past it the connection gets a
  ``408`` and is closed (silently when nothing of a new request had come);
- a **body deadline**: its body must be complete within ``body_timeout_s``
  of its headers; past it the connection is closed (the app sees a
  disconnect). Time during which the service itself stopped reading (its
  body buffer full, the app slow to take it) does not count against the
  client: the deadline is extended then;
- **connection caps** (``ConnectionGuard``): at most ``max_connections``
  open at once, and at most ``max_per_address`` from one client address;
  past them a new connection gets a ``503`` (total) or ``429`` (per address)
  problem+json with ``Retry-After`` and is closed at once. A client address is an IPv4
  address, or an IPv6 address's /64 (a host is given a whole /64 and may
  use any address in it; an IPv4-mapped IPv6 address counts as its IPv4
  address): ``client_key``. Addresses in ``exempt`` (the reverse proxies in
  front of the service, whose connections carry many clients') are counted
  in the total only.

The deadlines do not apply while a request is being answered: a long
``wait_s`` or an event stream is never cut.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

PAUSED_RECHECK_S = 1.0  # while reading is paused by the service, the body deadline is looked at again this often
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


IPV6_CLIENT_PREFIX = 64  # an IPv6 client is its /64: the smallest block a host is given (RFC 6177, SLAAC)


def client_key(address: str) -> str:
    """What the per-address cap counts ``address`` as.

    An IPv4 address as itself; an IPv4-mapped IPv6 address (``::ffff:192.0.2.1``) as its IPv4
    address; any other IPv6 address as its /64 network (``2001:db8::/64``), so rotating within the
    block a host is given yields no new caps; text that is no IP address as itself.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_CLIENT_PREFIX), strict=False))
    return str(ip)


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDR networks (``10.0.0.5``, ``10.0.0.0/24``, ``::1``) as networks; raises ValueError."""
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip())


class ConnectionGuard:
    """Counts open HTTP connections in total and per client address, and refuses those past the caps.

    Args:
        max_connections: connections open at once (0 = no cap).
        max_per_address: connections open at once from one client address, as ``client_key`` counts it
            (an IPv6 client is its /64; 0 = no cap).
        exempt: client networks not subject to ``max_per_address`` (trusted reverse proxies).

    Used from the server's event loop only.
    """

    def __init__(self, max_connections: int, max_per_address: int, exempt: Iterable[Network] = ()) -> None:
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self._exempt = tuple(exempt)
        self._open = 0
        self._by_address: dict[str, int] = {}
        self.refused = 0
        self.timed_out = 0

    @property
    def open(self) -> int:
        """Connections admitted and not yet closed."""
        return self._open

    def admit(self, address: str | None) -> int | None:
        """Count a new connection from ``address`` (None: not an IP client, e.g. a unix socket).

        Returns:
            None when admitted (``release`` it when it closes), else the HTTP status to refuse it with:
            503 past ``max_connections``, 429 past ``max_per_address``.
        """
        if self.max_connections and self._open >= self.max_connections:
            self.refused += 1
            return 503
        key = client_key(address) if address is not None else None
        if key is not None and address is not None and self.max_per_address and not self._is_exempt(address):
            if self._by_address.get(key, 0) >= self.max_per_address:
                self.refused += 1
                return 429
        self._open += 1
        if key is not None:
            self._by_address[key] = self._by_address.get(key, 0) + 1
        return None

    def release(self, address: str | None) -> None:
        """Forget an admitted connection that closed."""
        self._open -= 1
        if address is not None:
            key = client_key(address)
            left = self._by_address.get(key, 0) - 1
            if left > 0:
                self._by_address[key] = left
            else:
                self._by_address.pop(key, None)

    def _is_exempt(self, address: str) -> bool:
        if not self._exempt:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self._exempt)


@dataclass(frozen=True)
class _Answers:
    """The complete problem+json responses written below the app (``problems.raw_answer``)."""

    refusals: dict[int, bytes]  # by the status ConnectionGuard.admit gives
    timed_out: bytes
    bad_request: bytes


@functools.cache
def _answers() -> _Answers:
    """Made once, at the first connection: ``service.api`` imports the settings, which import this module."""
    from service.api.problems import (
        BAD_REQUEST,
        REQUEST_TIMEOUT,
        TOO_MANY_CONNECTIONS,
        TOO_MANY_CONNECTIONS_FROM_ADDRESS,
        raw_answer,
    )

    return _Answers(
        refusals={
            503: raw_answer(TOO_MANY_CONNECTIONS, "too many open connections", retry_after_s=1),
            429: raw_answer(
                TOO_MANY_CONNECTIONS_FROM_ADDRESS, "too many open connections from this address", retry_after_s=1
            ),
        },
        timed_out=raw_answer(REQUEST_TIMEOUT, "the request's headers did not arrive in time"),
        bad_request=raw_answer(
            BAD_REQUEST,
            "not a valid HTTP/1.1 request (a malformed request line, or a header name or value with a character"
            " HTTP forbids there, such as a CR or LF)",
        ),
    )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body deadlines and the connection caps (module doc).

    ``guarded_protocol`` makes a subclass bound to one guard and its timeouts; this base has none.
    """

    guard: ConnectionGuard | None = None
    header_timeout_s: float = 0.0
    body_timeout_s: float = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._admitted = False
        self._address: str | None = None
        self._phase: str | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._phase_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else None
        if self.guard is not None:
            refusal = self.guard.admit(self._address)
            if refusal is not None:
                log.debug("refused a connection from %s: %d", self._address, refusal)
                transport.write(_answers().refusals[refusal])
                transport.close()
                return
            self._admitted = True
        self._follow()

    def send_400_response(self, msg: str) -> None:
        """A request that is not HTTP (h11 refused it): a ``bad-request`` problem, not uvicorn's text (none
        when a response was under way: the connection is only closed)."""
        if self.conn.our_state is h11.IDLE:
            self.transport.write(_answers().bad_request)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        if self._admitted and self.guard is not None:
            self._admitted = False
            self.guard.release(self._address)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._phase_bytes += len(data)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Arm the deadline of what the client owes now: headers (their side idle), a body, or nothing."""
        if self.transport.is_closing():
            self._set_phase(None)
            return
        state = self.conn.their_state
        self._set_phase("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._phase = phase
        self._phase_bytes = 0
        timeout = {"headers": self.header_timeout_s, "body": self.body_timeout_s}.get(phase or "", 0.0)
        if timeout > 0:
            self._deadline_timer = self.loop.call_later(timeout, self._expired, phase)

    def _expired(self, phase: str | None) -> None:
        self._deadline_timer = None
        if self.transport.is_closing() or phase != self._phase:
            return
        if phase == "body" and self.flow.read_paused:  # the service is not reading: not the client's delay
            self._deadline_timer = self.loop.call_later(PAUSED_RECHECK_S, self._expired, phase)
            return
        if self.guard is not None:
            self.guard.timed_out += 1
        if phase == "headers":
            log.debug("closing a connection from %s: request headers not complete in time", self._address)
            if self._phase_bytes and self.conn.our_state is h11.IDLE:
                self.transport.write(_answers().timed_out)
        else:
            log.debug("closing a connection from %s: request body not complete in time", self._address)
        self._phase = None
        self.transport.close()


def guarded_protocol(
    guard: ConnectionGuard, header_timeout_s: float, body_timeout_s: float
) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` class bound to ``guard`` and the deadlines (s; 0 = none), for uvicorn's ``http=``."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"guard": guard, "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
