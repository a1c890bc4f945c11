"""The syntax of one ``PTC_EGRESS_ALLOW`` rule, read when the settings are (``service.egress`` matches the rules).

A rule is ``[scheme://]host[:port]``: ``scheme`` ``http``, ``https`` or ``*`` (the default: both); ``host`` a
DNS name, ``*.suffix``, ``*``, an address or a CIDR network (IPv6 in ``[ ]``); ``port`` 1-65535, ``*`` (any), or
none (the scheme's default port). See ``service.egress`` for what a rule admits.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SCHEMES = frozenset({"http", "https"})
SCHEME_DEFAULT_PORT = -1  # the port of a rule without one: each scheme's default port


class RuleParts(NamedTuple):
    """One rule's parts: ``schemes``; ``name`` (lower case) or ``network``; ``port`` (None: any,
    ``SCHEME_DEFAULT_PORT``: the scheme's default)."""

    schemes: frozenset[str]
    name: str | None
    network: IPNetwork | None
    port: int | None


def parse_rule(text: str) -> RuleParts:
    """The parts of one rule; raises ValueError saying what is wrong (naming the rule)."""
    entry = text.strip()
    scheme, sep, rest = entry.partition("://")
    if not sep:
        scheme, rest = "*", entry
    scheme = scheme.lower()
    if scheme not in ({"*"} | SCHEMES):
        raise ValueError(f"egress rule {text!r}: scheme must be http, https or *")
    if rest.startswith("["):
        host, bracket, port_text = rest[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError(f"egress rule {text!r}: unbalanced [ ] around an IPv6 address")
        port_text = port_text[1:]
    elif ":" in rest:
        host, _, port_text = rest.rpartition(":")
    else:
        host, port_text = rest, ""
    host = host.lower().rstrip(".")
    if not host:
        raise ValueError(f"egress rule {text!r}: no host")
    schemes = SCHEMES if scheme == "*" else frozenset({scheme})
    port: int | None
    if not port_text:
        port = SCHEME_DEFAULT_PORT
    elif port_text == "*":
        port = None
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise ValueError(f"egress rule {text!r}: port must be 1-65535 or *")
    network: IPNetwork | None
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError:
        network = None
    if network is None and ("/" in host or not _valid_name_pattern(host)):
        raise ValueError(f"egress rule {text!r}: {host!r} is neither a host name nor an address or network")
    return RuleParts(schemes, None if network else host, network, port)


def _valid_name_pattern(host: str) -> bool:
    if host == "*":
        return True
    labels = host[2:].split(".") if host.startswith("*.") else host.split(".")
    return all(label and len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label) for label in labels)
