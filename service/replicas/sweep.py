"""``ptc-sandbox sweep --instance ID``: remove the sandboxes a retired replica left on this engine
(docs/operations.md, Replicas).

A replica sweeps its own instance's containers at each start; one that never starts again (a host renamed, a
replica scaled down for good) leaves its containers running or stopped on the engine. This command removes every
container labelled with that instance (``labels.instance_labels``: ``io.ptc-sandbox.managed=1`` and
``io.ptc-sandbox.instance=ID``), and only after the store's registry says the instance is not live:

- its row is ``left`` or ``expired``, or its lease has passed (by the store's clock): removed;
- its row is ``live`` or ``draining`` with its lease holding: refused (its containers run its jobs);
- no row (it never registered on this store, e.g. a replica on another SQLite file): refused, unless the
  operator vouches that it is not running (``unregistered=True``, ``--unregistered``).

A replica that starts between the check and the removal sweeps its own leftovers first and creates its
sandboxes after registering, so the window is the time of one engine list; stop a retired replica for good
before sweeping it.
"""

from __future__ import annotations

from service.errors import InstanceIdInUse
from service.sandbox.backend import SandboxBackend
from service.sandbox.labels import instance_labels
from service.store import JobStore


async def sweep_instance(store: JobStore, backend: SandboxBackend, instance_id: str, unregistered: bool = False) -> int:
    """Remove every sandbox of ``instance_id`` once the registry shows it is not live; returns how many.

    Args:
        store: the open job store holding the registry.
        backend: the engine holding the sandboxes.
        instance_id: the retired replica's instance id (``PTC_INSTANCE_ID``).
        unregistered: proceed when the registry has no row of it (the caller vouches that it is not running).

    Raises:
        InstanceIdInUse: the registry shows the instance live (its lease holding), or has no row of it and
            ``unregistered`` is false.
        StoreUnavailable: the store did not answer.
        SandboxError: the engine did not answer.
    """
    rows = {row.instance_id: row for row in await store.replicas.all()}
    row = rows.get(instance_id)
    if row is None and not unregistered:
        raise InstanceIdInUse(
            f"instance {instance_id!r} is not in this store's registry, so whether it runs is unknown; "
            "give --unregistered if you know it is not running"
        )
    if row is not None and row.holds_lease:
        raise InstanceIdInUse(
            f"instance {instance_id!r} is {row.state} in the registry (epoch {row.epoch}, lease left "
            f"{row.lease_left_s:.1f} s): its sandboxes run its jobs; stop it first (or wait for its lease to pass)"
        )
    return await backend.remove_labelled(instance_labels(instance_id))
