"""The composition root: everything the service runs, built from settings in order and wired (used by
``create_app``, whose app only installs middleware and routers and runs the lifespan).

``open_services`` builds and starts, in order: the sandbox backend (``engine_table.docker_backend`` unless given),
the endpoint clients, the store, the replica's registration, the job service (``assembly.build_jobs``, started by
``JobManager.start``), idempotency, the peers' client and the store's listener; ``Services`` holds them and closes
them in reverse. It is the one place that builds them: the other modules of ``service.composition`` are its steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from service.composition.assembly import build_jobs
from service.composition.engine_table import ENGINES, EngineFactory, docker_backend
from service.composition.job_manager import JobManager
from service.egress import EgressPolicy, OwnAddress
from service.engines import CONTAINER
from service.idempotency import IdempotencyKeys
from service.observability import telemetry
from service.observability.metrics import Metrics
from service.replicas.internal import Verifier
from service.replicas.notify import Listener, Waiters
from service.replicas.registration import Replicas
from service.replicas.remote import Remote
from service.sandbox.backend import SandboxBackend
from service.settings import Settings
from service.store import JobStore, job_store
from service.toolkit.endpoints import EndpointClients

log = logging.getLogger(__name__)


@dataclass
class Services:
    """Everything the app serves, in the order ``open_services`` started it; ``close`` ends it in reverse.

    Attributes:
        backend: the sandbox backend (the engines' sandboxes run on it).
        endpoints: the shared endpoint clients and egress rules.
        store: the job store, open.
        replicas: this replica's registration (started: its lease is renewed).
        jobs: the job service, started.
        idempotency: the ``Idempotency-Key`` claims and bindings.
        remote: the peers' client (with ``PTC_INTERNAL_SECRET``), else None.
        listener: the store's notifications (PostgreSQL), else None.
    """

    backend: SandboxBackend
    endpoints: EndpointClients
    store: JobStore
    replicas: Replicas
    jobs: JobManager
    idempotency: IdempotencyKeys
    remote: Remote | None
    listener: Listener | None

    async def close(self) -> None:
        """Stop the jobs, release the claims, leave the registry, flush the spans, close clients, store, backend."""
        if self.listener is not None:
            await self.listener.close()
        await self.jobs.close()
        await self.idempotency.drain()  # claims of requests that failed: released before the store closes
        await self.replicas.close()  # after its jobs' last saves: ``left``
        await asyncio.to_thread(telemetry.flush)  # the spans of the jobs just ended too
        await self.endpoints.aclose()
        if self.remote is not None:
            await self.remote.aclose()
        await self.store.close()
        await self.backend.close()


async def open_services(
    settings: Settings,
    metrics: Metrics,
    verifier: Verifier,
    secrets: list[bytes],
    *,
    backend: SandboxBackend | None = None,
    single_tenant: bool = False,
    engines: Mapping[str, EngineFactory] = ENGINES,
    default_engine: str = CONTAINER,
) -> Services:
    """Build and start everything the app serves, in order: the backend (``docker_backend`` unless given), the
    endpoint clients, the store (opened: migrations first), the replica's registration, the job service
    (``build_jobs``, started: recovery, the engines), the egress rules' refusal of the replicas' own addresses,
    idempotency, the peers' client (``secrets``: ``PTC_INTERNAL_SECRET``'s), and with PostgreSQL the listener.
    ``verifier`` is aimed at this replica's incarnation once it is registered.

    Raises:
        WorkDirBusy: another running instance holds the work dir.
        StoreUnavailable: the store cannot be opened (a PostgreSQL down refuses the start).
        ValueError: ``default_engine`` is not one of ``engines``.
    """
    backend = backend if backend is not None else docker_backend(settings)
    endpoints = EndpointClients(
        settings.tool_timeout_s,
        settings.max_tool_result_bytes,
        EgressPolicy(settings.egress_allow, own=[OwnAddress.of(settings.host, settings.port)]),
    )
    store = job_store(settings)
    await store.open()  # migrations first (docs/operations.md, Job store); a PostgreSQL down refuses the start
    replicas = Replicas(settings, store, on_count=metrics.set_replicas, on_renewal=metrics.lease_renewal)
    waiters = Waiters() if settings.store_url is not None else None
    if waiters is not None:
        waiters.on_replicas = replicas.refresh_soon
    jobs = build_jobs(
        settings, backend, endpoints, store, metrics, replicas, waiters,
        single_tenant=single_tenant, engines=engines, default_engine=default_engine,
    )  # fmt: skip
    await jobs.start()  # registers this replica (after the work-dir lock, before the sweep)
    incarnation = replicas.incarnation
    verifier.target = f"{incarnation.instance_id}.{incarnation.epoch}"  # signed calls to this incarnation only
    replicas.on_registry.append(
        lambda rows: endpoints.egress.refuse_peers(row.internal_url for row in rows if row.holds_lease)
    )  # the egress rules refuse every live replica's internal address, as this one's own
    endpoints.egress.refuse_peers(row.internal_url for row in replicas.registry.values() if row.holds_lease)
    replicas.start()
    idempotency = IdempotencyKeys(store, replicas.incarnation)  # claims carry this incarnation
    if waiters is not None:
        waiters.on_keys = idempotency.wake_digest  # ptc_keys: another replica bound or released a claim
    remote = None
    if secrets:
        remote = Remote(secrets[0], settings.instance(), single_tenant=single_tenant)
        remote.alive = lambda owner: replicas.holds_now(owner.instance_id, owner.epoch)
    listener = None
    if waiters is not None and settings.store_url is not None:  # LISTEN: wait on other replicas' jobs
        listener = Listener(
            settings.store_url.get_secret_value(), waiters, settings.store_timeout_s, metrics.listener_reconnected
        )
        listener.start()
        try:  # a wait must not miss an end for want of a listener; a slow store only delays it
            await asyncio.wait_for(listener.listening.wait(), settings.store_timeout_s)
        except TimeoutError:
            log.warning("the store's notifications are not received yet: waits on other replicas' jobs lag")
    return Services(backend, endpoints, store, replicas, jobs, idempotency, remote, listener)
