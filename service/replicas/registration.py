"""This process as one replica of the service: its registration in the store's registry, its lease, the registry
cache, and fencing (docs/scaling.md, Replicas and leases; issue 17, point 2).

- **Registration** (``register``, at start-up after the work-dir lock, before the sweep): the store gives this
  start its epoch; ``(instance_id, epoch)`` is the ``Incarnation`` every job save carries (``JobRecords.save``).
  The work dir's ``replica.token`` (128 random bits, made once, mode 0600) tells a restart of the same work dir
  (which may take over its own live row at once) from a second replica given the same ``PTC_INSTANCE_ID``
  (refused: ``InstanceIdInUse``).
- **Heartbeat** (``start``): every ``PTC_REPLICA_HEARTBEAT_S`` the lease is renewed to ``PTC_REPLICA_LEASE_S``
  from the store's ``now()``, and the registry is read again (the cache ``registry``; also at once on a
  ``ptc_replicas`` notification: ``refresh_soon``). The **local deadline** is
  the time the last successful renewal was sent plus the lease, on ``CLOCK_BOOTTIME`` (it runs while the machine
  is suspended): it passes no later than the lease in the store.
- **Fencing** (``fence``): a renewal that matches no row, a save that matches no row (``LeaseLost``), or the
  local deadline passing: this incarnation may no longer act as an owner. It logs ``replica lease_lost`` once,
  answers ``/readyz`` 503, and runs the ``on_fenced`` callbacks: the service's removes every sandbox with this
  instance's labels, cancels its callback deliveries and exits with status 75 (``service.replicas.fencing``); its
  supervisor starts it again as a new incarnation. With SQLite the same code runs, and nothing ever expires the one
  replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path

from service import __version__
from service.errors import InsecureConfig, LeaseLost, StoreUnavailable
from service.observability import logs
from service.settings import Settings
from service.store import Incarnation, JobStore, Registration, Replica, StoredJob, StoredSession

log = logging.getLogger(__name__)

TOKEN_NAME = "replica.token"
"""The work dir's token file: 128 random bits (hex), made once."""


def boottime() -> float:
    """Seconds on ``CLOCK_BOOTTIME`` (monotonic, and counting while the machine is suspended)."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


def work_dir_token(work_dir: Path) -> str:
    """SHA-256 (hex) of ``work_dir/replica.token``, made (mode 0600) when missing. Blocking: a thread's work."""
    path = work_dir / TOKEN_NAME
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = secrets.token_hex(16)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
    return hashlib.sha256(token.encode()).hexdigest()


def internal_url(settings: Settings) -> str | None:
    """Where the other replicas reach this one: ``PTC_INTERNAL_URL``; else ``http://PTC_HOST:PTC_PORT`` when the
    host is not a wildcard; else the first non-loopback address the host name resolves to; None without any."""
    if settings.internal_url:
        return settings.internal_url.rstrip("/")
    host = settings.host
    if host not in ("", "0.0.0.0", "::"):
        return f"http://{_bracketed(host)}:{settings.port}"
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for *_, address in found:
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])
        if not ip.is_loopback and not ip.is_unspecified:
            return f"http://{_bracketed(str(ip))}:{settings.port}"
    return None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Replicas:
    """This replica's registration, lease and view of the others.

    Args:
        settings: ``instance()``, ``work_dir``, ``replica_heartbeat_s``, ``replica_lease_s``, the internal URL.
        store: the job store holding the registry.
        on_count: told the registry's counts by state (``live``, ``draining``) after each read (metrics).
        on_renewal: told each heartbeat's outcome (``ok``, ``error``, ``fenced``) and the lease left then (s).
    """

    def __init__(
        self,
        settings: Settings,
        store: JobStore,
        on_count: Callable[[dict[str, int]], None] | None = None,
        on_renewal: Callable[[str, float], None] | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._on_count = on_count
        self._on_renewal = on_renewal
        self._incarnation: Incarnation | None = None
        self._deadline = 0.0  # CLOCK_BOOTTIME seconds
        self._task: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self.fenced = False
        self.draining = False  # /readyz answers 503 (reason draining): no new work through the balancer
        self.on_fenced: list[Callable[[], None]] = []
        self.registry: dict[str, Replica] = {}
        self._registry_read = boottime()  # when ``registry`` was read (its rows' ``lease_left_s`` are as of then)
        self.on_registry: list[Callable[[list[Replica]], None]] = []  # told each registry read (egress rules)
        self.renewals: dict[str, int] = {"ok": 0, "error": 0, "fenced": 0}

    @classmethod
    def adopted(cls, settings: Settings, store: JobStore, incarnation: Incarnation) -> Replicas:
        """A replica already registered as ``incarnation`` (by another process part, or a test), not beating."""
        replicas = cls(settings, store)
        replicas._incarnation = incarnation
        replicas._deadline = boottime() + settings.replica_lease_s
        return replicas

    @property
    def incarnation(self) -> Incarnation:
        """This process's ``(instance_id, epoch)``; only after ``register``."""
        assert self._incarnation is not None, "the replica is not registered"
        return self._incarnation

    async def register(self) -> Incarnation:
        """Register this start in the store (see the module's docstring).

        Raises:
            InstanceIdInUse: another live replica holds this instance id (or, on SQLite, the store).
            StoreUnavailable: the store did not answer.
            InsecureConfig: a PostgreSQL store and no usable internal URL (``PTC_INTERNAL_URL``).
        """
        settings = self._settings
        url = internal_url(settings)
        if url is None:
            if self._store.shares_output:
                raise InsecureConfig(
                    "no address where the other replicas reach this one: set PTC_INTERNAL_URL (http://host:port)"
                )
            url = f"http://127.0.0.1:{settings.port}"
        token = await asyncio.to_thread(work_dir_token, settings.work_dir)
        sent = boottime()
        epoch = await self._store.replicas.register(
            Registration(settings.instance(), url, token, __version__, settings.replica_lease_s)
        )
        self._incarnation = Incarnation(settings.instance(), epoch)
        self._deadline = sent + settings.replica_lease_s
        logs.replica("registered", settings.instance(), epoch)
        await self.refresh()
        return self._incarnation

    def start(self) -> None:
        """Start the heartbeat (after ``register``; once: later calls do nothing). The start-up calls it right after
        the registration: a sweep of many sandboxes left behind may outlast the lease."""
        if self._task is None:
            self._task = asyncio.create_task(self._beat(), name="replica heartbeat")

    async def close(self) -> None:
        """Stop the heartbeat and leave the registry (``left``); a store that does not answer is logged."""
        for task in (self._task, self._refreshing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._refreshing = None
        if self._incarnation is not None and not self.fenced:
            try:
                await self._store.replicas.set_state(self._incarnation, "left")
            except StoreUnavailable:
                log.warning("replica %s could not record that it left", self._incarnation.instance_id)
            else:
                logs.replica("left", self._incarnation.instance_id, self._incarnation.epoch)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._settings.replica_heartbeat_s)
            await self.renew()
            if self.fenced:
                return

    async def renew(self) -> None:
        """One heartbeat: renew the lease, then read the registry; fences on a renewal that matches no row or a
        passed local deadline. Never raises (a store that does not answer is counted and retried next time)."""
        if self.fenced:
            return
        sent = boottime()
        try:
            renewed = await self._store.replicas.renew(self.incarnation, self._settings.replica_lease_s)
        except StoreUnavailable:
            self._renewed("error")
            if boottime() >= self._deadline:
                self.fence("the lease passed while the store did not answer")
            return
        if not renewed:
            self._renewed("fenced")
            self.fence("the registry no longer holds this incarnation as live")
            return
        self._deadline = sent + self._settings.replica_lease_s
        self._renewed("ok")
        with contextlib.suppress(StoreUnavailable):
            await self.refresh()

    def _renewed(self, outcome: str) -> None:
        self.renewals[outcome] += 1
        if self._on_renewal is not None:
            self._on_renewal(outcome, self.lease_left_s())

    async def refresh(self) -> None:
        """Read the registry into ``registry``, and give its counts to ``on_count``.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        asked = boottime()
        rows = await self._store.replicas.all()
        self.registry = {row.instance_id: row for row in rows}
        self._registry_read = asked
        for listener in self.on_registry:
            listener(rows)
        if self._on_count is not None:
            counts = {"live": 0, "draining": 0}
            for row in rows:
                if row.holds_lease:
                    counts[row.state] += 1
            self._on_count(counts)

    def refresh_soon(self) -> None:
        """Read the registry again in the background (a ``ptc_replicas`` notification); one read at a time."""
        if self._refreshing is not None and not self._refreshing.done():
            return

        async def refresh() -> None:
            with contextlib.suppress(StoreUnavailable):
                await self.refresh()

        self._refreshing = asyncio.create_task(refresh(), name="registry refresh")

    def lease_left_s(self) -> float:
        """Seconds until the local deadline (negative: passed)."""
        return self._deadline - boottime()

    def holds_lease(self) -> bool:
        """Whether this replica may still act as an owner: not fenced, its local deadline not passed (the broker
        asks before each tool call)."""
        return not self.fenced and self.lease_left_s() > 0

    def ready(self) -> str | None:
        """Why ``/readyz`` should answer 503 for the lease (fenced, or within one heartbeat of the local deadline);
        None when it should not."""
        if self.fenced:
            return "this replica lost its lease"
        if self._incarnation is not None and self.lease_left_s() < self._settings.replica_heartbeat_s:
            return "this replica's lease is about to pass (the job store is not answering its renewals)"
        return None

    def fence(self, why: str) -> None:
        """Stop acting as an owner (see the module's docstring); once."""
        if self.fenced:
            return
        self.fenced = True
        incarnation = self._incarnation
        epoch = incarnation.epoch if incarnation else None
        logs.replica("lease_lost", self._settings.instance(), epoch, logging.ERROR, reason=why)
        for callback in self.on_fenced:
            try:
                callback()
            except Exception:
                log.exception("a fencing callback failed")

    async def save(self, job: StoredJob) -> None:
        """Save a job this incarnation runs (``JobRecords.save``, fenced).

        Raises:
            LeaseLost: the save matched no row (the job is no longer this incarnation's): the replica is fenced.
            StoreUnavailable: the store did not answer.
        """
        if not await self._store.jobs.save(job, self.incarnation):
            self.fence(f"a save of job {job.job_id} matched no row")
            raise LeaseLost(f"job {job.job_id} is no longer this replica's")

    async def save_session(self, session: StoredSession) -> None:
        """Save a session this incarnation holds (``SessionRecords.save``, fenced).

        Raises:
            LeaseLost: the save matched no row: the replica is fenced.
            StoreUnavailable: the store did not answer.
        """
        if not await self._store.sessions.save(session, self.incarnation):
            self.fence(f"a save of session {session.session_id} matched no row")
            raise LeaseLost(f"session {session.session_id} is no longer this replica's")

    def holds_now(self, instance_id: str, epoch: int) -> bool:
        """Whether the incarnation ``(instance_id, epoch)`` still holds its lease by the registry cache, counting the
        time since the cache was read (a cache that could not be read again meanwhile ages out)."""
        row = self.registry.get(instance_id)
        return (
            row is not None
            and row.epoch == epoch
            and row.holds_lease
            and row.lease_left_s > boottime() - self._registry_read
        )

    def owner_here(self, instance_id: str, epoch: int | None) -> bool:
        """The job of ``(instance_id, epoch)`` is this incarnation's (a row saved before epochs: this instance)."""
        mine = self.incarnation
        return instance_id == mine.instance_id and epoch in (None, mine.epoch)

    def retry_after_s(self, instance_id: str) -> int:
        """Seconds after which a job of ``instance_id`` running elsewhere may be served (its lease passed plus a
        heartbeat: by then it has renewed, or will be expired); at least 1."""
        row = self.registry.get(instance_id)
        left = row.lease_left_s if row is not None and row.holds_lease else 0.0
        return max(1, int(left + self._settings.replica_heartbeat_s + 0.999))
