"""The replica registry's rows (table ``replicas``; docs/scaling.md, Replicas and leases): one row per instance id,
its ``epoch`` counting its starts, its lease and its state.

``ReplicaRegistry`` is the resource's interface; ``sqlite_registry`` and ``pg_registry`` implement it. Every
fenced write of the store (``fenced_write``) checks an ``Incarnation`` against these rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

LIVE_STATES = ("live", "draining")
"""Registry states of an incarnation that may own and write jobs."""


@dataclass(frozen=True)
class Incarnation:
    """One start of one replica: ``(instance_id, epoch)``; every job write of the process carries it.

    Attributes:
        instance_id: ``PTC_INSTANCE_ID`` (or its default).
        epoch: how many times this instance id has registered, this start included (1 for the first).
    """

    instance_id: str
    epoch: int


@dataclass(frozen=True)
class Registration:
    """What a replica registers at start-up (``ReplicaRegistry.register``).

    Attributes:
        instance_id: its instance id.
        internal_url: where the other replicas reach it (``http://host:port``).
        work_dir_token: SHA-256 (hex) of its work dir's ``replica.token``: the same work dir restarting.
        version: the service's version.
        lease_s: the lease's length from the registration (s).
    """

    instance_id: str
    internal_url: str
    work_dir_token: str
    version: str
    lease_s: float


@dataclass(frozen=True)
class Replica:
    """One row of the registry (``ReplicaRegistry.all``).

    Attributes:
        instance_id / epoch: its newest incarnation.
        internal_url: where it is reached.
        version: its service version.
        state: ``live``, ``draining``, ``left`` or ``expired``.
        lease_left_s: seconds until its lease passes, by the store's clock at the read (negative: passed).
    """

    instance_id: str
    epoch: int
    internal_url: str
    version: str
    state: str
    lease_left_s: float

    @property
    def incarnation(self) -> Incarnation:
        """``(instance_id, epoch)``."""
        return Incarnation(self.instance_id, self.epoch)

    @property
    def holds_lease(self) -> bool:
        """It is live or draining and its lease has not passed."""
        return self.state in LIVE_STATES and self.lease_left_s > 0


def in_use_message(instance_id: str) -> str:
    """``InstanceIdInUse``'s message for an instance id held by another work dir."""
    return (
        f"instance id {instance_id} is held by a live replica with another work dir; give each replica its own "
        "PTC_INSTANCE_ID"
    )


class ReplicaRegistry(Protocol):
    """The registry of service processes sharing the store. Coroutines, safe to call concurrently."""

    async def register(self, registration: Registration) -> int:
        """Register a start of ``registration.instance_id`` (one transaction, its row locked); returns its epoch: 1
        for a new instance id, else one more than the row's. With PostgreSQL it notifies ``ptc_replicas``.

        Raises:
            InstanceIdInUse: the row is live, its lease holding, with another work dir's token (two replicas were
                given one instance id); or, on SQLite, another instance id is live on the same file.
        """
        ...

    async def renew(self, incarnation: Incarnation, lease_s: float) -> bool:
        """Extend the incarnation's lease to ``lease_s`` from now (the store's clock); False when no row matched:
        the incarnation was expired (or has left), and the replica is fenced."""
        ...

    async def set_state(self, incarnation: Incarnation, state: str) -> bool:
        """Move a live incarnation to ``draining`` or ``left`` (``left`` also sets ``ended_at``); False when it
        is no longer live or draining."""
        ...

    async def all(self) -> list[Replica]:
        """Every row of the registry, newest incarnation per instance id."""
        ...

    async def expire(self, by: str) -> dict[Incarnation, float]:
        """Mark ``expired`` every live or draining incarnation whose lease passed (store time), recording ``by``
        (the expiring instance id); returns those this call expired (each by one caller, however many race), each
        with the seconds from its last heartbeat to its expiry (store time). With PostgreSQL it notifies
        ``ptc_replicas``. SQLite serves one replica: nothing to expire (``{}``)."""
        ...
