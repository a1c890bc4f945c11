"""API keys: their hashes, the key ring that tells which key a token is, and the ``Caller`` a request acts as.

Keys are configured by their SHA-256 (``PTC_API_KEYS`` = ``name:hex,name:hex``,
and/or ``PTC_API_KEYS_FILE`` with one ``name:hex`` per line), never by the token
itself: the service's environment and config hold nothing that would let a
reader call it. ``ptc-sandbox hash-key NAME`` makes the entry for a token.
A token is identified by comparing its SHA-256 with every configured hash by
``hmac.compare_digest`` — all of them, whether or not one matched already — so
the time taken does not depend on which key, or which byte of it, matched.

Owners: every job, session and toolset belongs to the key name that created it
(``IMPLICIT_OWNER`` when authentication is disabled); a request acts only on what
its ``Caller`` owns, except for the keys named in ``PTC_ADMIN_KEYS`` (the admin
role), which act on everything. With authentication disabled there is one
implicit owner, and it has the admin role (it sees what keys created before too).

``PTC_AUTH=disabled`` turns keys off, for development: ``configure`` logs it as a
warning, and refuses it (``InsecureConfig``) when ``PTC_HOST`` is not a loopback
address unless ``PTC_AUTH_FORCE_INSECURE=true``. The HTTP side (the bearer
header, the middleware that refuses before a body is read) is ``service.api.auth``;
the job service imports this module, never that one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from service.errors import InsecureConfig
from service.settings import Settings

log = logging.getLogger(__name__)

IMPLICIT_OWNER = "anonymous"  # the owner of everything created while authentication is disabled
KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # bounded, safe as a log field and a metrics label
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


def hash_token(token: str | bytes) -> str:
    """The SHA-256 (hex) of a token, as ``PTC_API_KEYS`` holds it; a str token is UTF-8 encoded."""
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """One configured key: its name and the SHA-256 digest (32 bytes) of its token."""

    name: str
    digest: bytes


def named_entries(text: str, source: str, what: str) -> Iterator[tuple[str, str]]:
    """The ``(name, value)`` of each ``name:value`` entry in ``text``, entries separated by commas or newlines.

    A line starting with ``#`` is a comment; names are key names (``KEY_NAME``); values are stripped.

    Raises:
        ValueError: an entry has no ``:``, a name that is not a key name, or an empty value (the message names
            ``source`` and ``what`` a value should be, never the value).
    """
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        for entry in line.split(","):
            entry = entry.strip()
            if not entry:
                continue
            name, sep, value = entry.partition(":")
            name, value = name.strip(), value.strip()
            if not sep or not KEY_NAME.match(name) or not value:
                raise ValueError(f"{source}: an entry is not name:{what} (name: letters, digits, _ . -)")
            yield name, value


def parse_keys(text: str, source: str = "PTC_API_KEYS") -> list[ApiKey]:
    """Parse ``name:sha256hex`` entries separated by commas or newlines (``#`` starts a comment line).

    Raises:
        ValueError: an entry is malformed (names ``source`` and the entry's name, never the hash).
    """
    keys = []
    for name, digest in named_entries(text, source, "sha256hex"):
        if not _HEX_DIGEST.match(digest):
            raise ValueError(f"{source}: the hash of key {name!r} is not 64 hex digits (see ptc-sandbox hash-key)")
        keys.append(ApiKey(name, bytes.fromhex(digest)))
    return keys


@dataclass(frozen=True)
class Caller:
    """Who makes a request: the owner of what it creates, and whether it has the admin role.

    Attributes:
        owner: the key's name (``IMPLICIT_OWNER`` with authentication disabled).
        admin: sees and acts on what every owner created (legacy rows with no owner included).
    """

    owner: str
    admin: bool = False
    internal: bool = False
    """The request came signed from another replica (``service.replicas.internal``): it is never forwarded again."""

    def may_access(self, owner: str | None) -> bool:
        """Whether this caller may see and act on something owned by ``owner`` (None: saved before owners were)."""
        return self.admin or (owner is not None and owner == self.owner)

    @property
    def only_owner(self) -> str | None:
        """The owner a listing is restricted to; None for an admin (everything)."""
        return None if self.admin else self.owner


class KeyRing:
    """The configured keys; ``identify`` tells which one a token is, ``caller`` what it may do.

    Args:
        keys: at least one key.
        admins: names of the keys with the admin role.
        scrapers: names of the keys that may read ``/metrics`` besides the admins (``PTC_METRICS_KEYS``).
    """

    def __init__(self, keys: Iterable[ApiKey], admins: Iterable[str] = (), scrapers: Iterable[str] = ()) -> None:
        self._keys = tuple(keys)
        if not self._keys:
            raise ValueError("a key ring needs at least one key")
        self.admins = frozenset(admins)
        self.scrapers = frozenset(scrapers)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def tenants(self) -> int:
        """How many owners the keys make (several tokens of one name, e.g. while rotating, are one owner)."""
        return len({key.name for key in self._keys})

    def identify(self, token: bytes) -> str | None:
        """The name of the key whose token is ``token``, or None.

        Constant time in the token: its digest is compared with every key's digest by
        ``hmac.compare_digest``, with no early exit, whichever key matches.
        """
        digest = hashlib.sha256(token).digest()
        found: str | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key.name
        return found


def caller(keys: KeyRing | None, key_name: str | None, internal: bool = False) -> Caller:
    """The ``Caller`` of a request whose key is ``key_name`` (None: authentication disabled, the implicit owner);
    ``internal``: a signed request of another replica (the admin role still comes from this replica's keys).

    Raises:
        ValueError: ``key_name`` is None while authentication is on (an open path has no caller).
    """
    if keys is None:
        return Caller(IMPLICIT_OWNER, admin=True, internal=internal)
    if key_name is None:
        raise ValueError("no API key on this request")
    return Caller(key_name, admin=key_name in keys.admins, internal=internal)


def single_tenant(keys: KeyRing | None) -> bool:
    """Whether the service has one tenant: authentication disabled (``IMPLICIT_OWNER``), or keys of one name.

    Then the per-key quotas that default to a share of the host default to the whole host (``service.quotas``).
    """
    return keys is None or keys.tenants == 1


def may_scrape(keys: KeyRing | None, key_name: str | None) -> bool:
    """Whether a request whose key is ``key_name`` may read ``/metrics``.

    Yes with authentication disabled, on an open ``/metrics`` (``PTC_METRICS_AUTH=open``: no key is
    identified there, ``key_name`` is None), and for the admin role and ``PTC_METRICS_KEYS``; no for any
    other key (the metrics name every tenant's tools and count everyone's jobs).
    """
    if keys is None or key_name is None:
        return True
    return key_name in keys.admins or key_name in keys.scrapers


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes the service to this machine only (``localhost`` or a loopback address)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def key_names(settings: Settings) -> frozenset[str] | None:
    """The names of the configured API keys (``PTC_API_KEYS``, ``PTC_API_KEYS_FILE``); None with authentication
    disabled. For what outlives a request (a durable job resumed at start-up: its owner's key must still exist).

    Raises:
        InsecureConfig: a key entry is malformed, or the keys file cannot be read (as ``configure``).
    """
    return frozenset(key.name for key in _keys(settings)) if settings.auth == "required" else None


def _keys(settings: Settings) -> list[ApiKey]:
    """The key entries of ``PTC_API_KEYS`` and ``PTC_API_KEYS_FILE``; raises InsecureConfig (malformed, unreadable)."""
    try:
        keys = parse_keys(settings.api_keys or "")
        if settings.api_keys_file is not None:
            keys += parse_keys(settings.api_keys_file.read_text(), f"PTC_API_KEYS_FILE ({settings.api_keys_file})")
    except (OSError, ValueError) as exc:
        raise InsecureConfig(str(exc)) from exc
    return keys


def configure(settings: Settings) -> KeyRing | None:
    """The key ring the service authenticates with, or None when authentication is disabled.

    Raises:
        InsecureConfig: ``PTC_AUTH=required`` without any key, or ``PTC_AUTH=disabled`` on a
            non-loopback ``PTC_HOST`` without ``PTC_AUTH_FORCE_INSECURE``; or a key entry is malformed.
    """
    keys = _keys(settings)
    if settings.auth == "required":
        if not keys:
            raise InsecureConfig(
                "PTC_AUTH=required but no API keys are configured: set PTC_API_KEYS (entries from "
                "`ptc-sandbox hash-key NAME`), or PTC_AUTH=disabled for development on a loopback address"
            )
        names = {k.name for k in keys}
        for setting, named in (("PTC_ADMIN_KEYS", settings.admin_keys), ("PTC_METRICS_KEYS", settings.metrics_keys)):
            unknown = sorted(set(named) - names)
            if unknown:
                raise InsecureConfig(f"{setting} names {', '.join(unknown)}, which is no configured API key")
        log.info("authentication: %d API key(s): %s", len(keys), ", ".join(sorted(names)))
        if settings.admin_keys:
            log.info("admin role (sees every owner's jobs and sessions): %s", ", ".join(sorted(settings.admin_keys)))
        if settings.metrics_keys:
            log.info("may read /metrics besides the admin role: %s", ", ".join(sorted(settings.metrics_keys)))
        return KeyRing(keys, settings.admin_keys, settings.metrics_keys)
    if not is_loopback(settings.host):
        if not settings.auth_force_insecure:
            raise InsecureConfig(
                f"PTC_AUTH=disabled while bound to {settings.host}, which is not a loopback address: anyone who "
                "reaches it could run code; configure PTC_API_KEYS, or set PTC_AUTH_FORCE_INSECURE=true"
            )
        log.critical("!!! AUTHENTICATION DISABLED on non-loopback %s (PTC_AUTH_FORCE_INSECURE) !!!", settings.host)
    log.warning(
        "!!! AUTHENTICATION DISABLED (PTC_AUTH=disabled): any caller on %s can run code; development only !!!",
        settings.host,
    )
    return None
