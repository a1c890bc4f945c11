"""Jobs of other replicas: ``wait`` woken by PostgreSQL notifications, and the answer for a running job that another
replica owns (docs/scaling.md, Serving any job from any replica; step 2, without forwarding).

- ``Listener``: one extra connection per replica that ``LISTEN``s on ``ptc_jobs`` (and ``ptc_replicas``: the
  registry cache is read again at once when a replica registers, drains or leaves; ``ptc_keys``: requests
  waiting on an idempotency claim wake when it is bound or released; and ``ptc_callbacks``: the callback worker
  claims a lost job's callback at once, ``service.jobs.webhooks``). Each save of an ended job (or
  of one waiting for its client) sends ``<job_id> ended`` (``waiting``) in the transaction that writes it
  (``PostgresJobRecords.save``), so a notification arrives only once the row is committed. A notification with no
  local waiter costs one dictionary lookup; ``ended`` also drops the job's cached view. A lost connection is
  re-opened (backoff up to 5 s) and wakes every waiter, which then reads the row again: nothing is missed.
- ``Elsewhere``: ``wait`` on a job that is not live here registers a waiter, then reads the row (closing the race
  with a notification sent before the waiter existed), then sleeps until a notification, its timeout, or a
  reconnection: no query while it waits, no polling. ``check`` raises ``OwnerElsewhere`` for a job saved as
  running by another live incarnation (``api.forward`` relays the request there: step 3), 503
  ``owner-unavailable`` when that incarnation's lease passed or the request came relayed already.

With SQLite there is no listener: every job is this replica's, ``wait`` uses the job's in-process events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import psycopg
import sqlalchemy as sa

from service.errors import JobNotFound, OwnerElsewhere, OwnerUnavailable
from service.replicas.registration import Replicas
from service.store import JobStore, StoredJob
from service.store.pg_db import CALLBACKS_CHANNEL, JOBS_CHANNEL, KEYS_CHANNEL, REPLICAS_CHANNEL
from service.tenancy import Caller

log = logging.getLogger(__name__)

RECONNECT_MAX_S = 5.0
"""Longest pause between two attempts to re-open the listening connection (s)."""
STOP_CHECK_S = 0.5
"""How often the listening loop looks whether it should stop (s): the longest ``notifies()`` wait."""


class Waiters:
    """Local waiters per job id: events set when the job's notification arrives (or on ``wake_all``).

    Attributes:
        on_ended: told the id of each job a notification says ended (drops its cached view).
        on_replicas: called on each ``ptc_replicas`` notification (the registry changed: read it again).
        on_keys: told each ``ptc_keys`` payload (an idempotency claim was bound or released:
            ``IdempotencyKeys.wake_digest``).
        on_callbacks: called on each ``ptc_callbacks`` notification (a callback is due for any replica to claim).
    """

    def __init__(self) -> None:
        self._events: dict[str, set[asyncio.Event]] = {}
        self.on_ended: Callable[[str], None] = lambda _: None
        self.on_replicas: Callable[[], None] = lambda: None
        self.on_keys: Callable[[str], None] = lambda _: None
        self.on_callbacks: Callable[[], None] = lambda: None

    def received(self, payload: str) -> None:
        """A ``ptc_jobs`` notification: ``<job_id> <word>``."""
        job_id, _, word = payload.partition(" ")
        if word in ("ended", "saved"):
            self.on_ended(job_id)
        self.wake(job_id)

    @contextlib.contextmanager
    def waiting(self, job_id: str) -> Iterator[asyncio.Event]:
        """A waiter for ``job_id`` (an ``asyncio.Event``) while the block runs."""
        event = asyncio.Event()
        self._events.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._events.get(job_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._events[job_id]

    def wake(self, job_id: str) -> None:
        """Wake the waiters of ``job_id`` (none: nothing to do)."""
        for event in self._events.get(job_id, ()):
            event.set()

    def wake_all(self) -> None:
        """Wake every waiter (the listener re-connected: notifications may have been missed)."""
        for events in self._events.values():
            for event in events:
                event.set()

    def __len__(self) -> int:
        return sum(len(events) for events in self._events.values())


class Listener:
    """The ``LISTEN`` connection of this replica (PostgreSQL store only).

    Args:
        url: the store's ``postgresql://`` URL (never logged).
        waiters: given the notifications.
        timeout_s: connect timeout (s).
        on_reconnect: called each time the connection is re-opened after a loss
            (``ptc_store_listener_reconnects_total``).
    """

    def __init__(
        self, url: str, waiters: Waiters, timeout_s: float = 5.0, on_reconnect: Callable[[], None] | None = None
    ) -> None:
        self._conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._waiters = waiters
        self._timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.listening = asyncio.Event()
        self.reconnects = 0
        self._on_reconnect = on_reconnect

    def start(self) -> None:
        """Start listening (a task; returns at once)."""
        self._task = asyncio.create_task(self._run(), name="store listener")

    async def close(self) -> None:
        """Stop listening: the loop sees ``_closing`` within ``STOP_CHECK_S`` and leaves psycopg's ``notifies()``
        between two waits. Cancelling the task inside ``notifies()`` instead left its connection's lock held by the
        suspended generator, and closing the connection could then wait for it for ever (a hung shutdown)."""
        if self._task is None:
            return
        self._closing.set()
        done, _ = await asyncio.wait({self._task}, timeout=STOP_CHECK_S + self._timeout_s + 1)
        if not done:  # a connect or a query that does not answer: cancelled, waited for a bounded time
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self._timeout_s)
        elif not self._task.cancelled() and (error := self._task.exception()) is not None:
            log.warning("store listener ended with %r", error)
        self._task = None

    async def _run(self) -> None:
        pause = 0.1
        first = True
        while not self._closing.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, connect_timeout=max(1, round(self._timeout_s))
                ) as conn:
                    await conn.execute(f"LISTEN {JOBS_CHANNEL}")
                    await conn.execute(f"LISTEN {REPLICAS_CHANNEL}")
                    await conn.execute(f"LISTEN {KEYS_CHANNEL}")
                    await conn.execute(f"LISTEN {CALLBACKS_CHANNEL}")
                    if not first:
                        self.reconnects += 1
                        if self._on_reconnect is not None:
                            self._on_reconnect()
                        self._waiters.wake_all()  # notifications may have been missed meanwhile
                        self._waiters.on_callbacks()
                    first, pause = False, 0.1
                    self.listening.set()
                    while not self._closing.is_set():  # notifications between two waits wait in psycopg's backlog
                        async for note in conn.notifies(timeout=STOP_CHECK_S):
                            self._dispatch(note.channel, note.payload)
                    return
            except (psycopg.Error, OSError) as exc:
                log.warning("store listener: connection lost (%s); re-opening", type(exc).__name__)
            self.listening.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), pause)
            pause = min(RECONNECT_MAX_S, pause * 2)

    def _dispatch(self, channel: str, payload: str) -> None:
        if channel == REPLICAS_CHANNEL:
            self._waiters.on_replicas()
        elif channel == KEYS_CHANNEL:
            self._waiters.on_keys(payload)
        elif channel == CALLBACKS_CHANNEL:
            self._waiters.on_callbacks()
        else:
            self._waiters.received(payload)


class Elsewhere:
    """Jobs this replica does not hold in memory: ``wait`` on notifications, 503 for running ones of others.

    Args:
        store: the job store.
        replicas: this replica (its incarnation, the registry cache).
        waiters: the listener's waiters (None: no listener, a SQLite store).
    """

    def __init__(self, store: JobStore, replicas: Replicas, waiters: Waiters | None) -> None:
        self._store = store
        self._replicas = replicas
        self._waiters = waiters

    @property
    def store(self) -> JobStore:
        """The job store."""
        return self._store

    @property
    def shared(self) -> bool:
        """Whether the store is shared with other replicas (PostgreSQL)."""
        return self._store.shares_output

    def _running_elsewhere(self, stored: StoredJob) -> bool:
        return (
            stored.ended_at is None
            and self._store.shares_output
            and not self._replicas.owner_here(stored.instance_id, stored.instance_epoch)
        )

    async def check(self, job_id: str, caller: Caller | None = None) -> None:
        """Raise OwnerElsewhere (the request is relayed) or OwnerUnavailable when the job (saved as running, not
        live here, the caller's access checked) runs on another replica; return when it is this incarnation's
        (served from its saved view)."""
        if not self._store.shares_output:
            return  # one replica (SQLite): every job is this one's
        stored = await self._store.jobs.get(job_id)
        if stored is not None and self._running_elsewhere(stored):
            raise self.owner(job_id, stored.instance_id, stored.instance_epoch, caller)

    def owner(
        self, resource_id: str, instance_id: str, epoch: int | None, caller: Caller | None, what: str = "job"
    ) -> OwnerElsewhere | OwnerUnavailable:
        """The error for a job (or session) another incarnation owns: ``OwnerElsewhere`` (relay the request) when
        that incarnation is live in the registry cache and the request did not come relayed already (a signed
        request is never forwarded again), else ``OwnerUnavailable`` (503, ``Retry-After``)."""
        retry_after_s = self._replicas.retry_after_s(instance_id)
        row = self._replicas.registry.get(instance_id)
        if (
            caller is not None
            and not caller.internal
            and row is not None
            and row.holds_lease
            and epoch is not None
            and row.epoch == epoch
        ):
            return OwnerElsewhere(what, resource_id, instance_id, epoch, row.internal_url, retry_after_s)
        if row is None or row.epoch != epoch:  # a replica this cache has not seen (re)start yet: read it again
            self._replicas.refresh_soon()
        return OwnerUnavailable(resource_id, retry_after_s, what)

    async def wait(self, job_id: str, caller: Caller, timeout_s: float) -> None:
        """Return when the job (not live here) has ended or waits for its client, or after ``timeout_s``.

        A row saved as ``waiting`` may lag behind its owner (a call answered since, the job running again: that
        flip is not always saved), so for such a row the wait itself is relayed to a live owner.

        Raises:
            JobNotFound: no such job, or another owner's (at once, before any wait).
            OwnerElsewhere: the row says ``waiting`` and its owner is live: relay the wait there; or the timeout
                passed with the job still running there: its view is one ``GET`` relayed there (``instead``).
            OwnerUnavailable: the timeout passed, the job still running on a replica that cannot be reached.
        """
        if self._waiters is None:
            return  # one replica: a job not live here has ended
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with self._waiters.waiting(job_id) as woken:
            while True:
                stored = await self._store.jobs.get(job_id)
                if stored is None or not caller.may_access(stored.owner):
                    raise JobNotFound(job_id)
                if not self._running_elsewhere(stored):
                    return
                if stored.status == "waiting":  # the row may lag (a call answered since): the owner waits
                    owner = self.owner(job_id, stored.instance_id, stored.instance_epoch, caller)
                    if isinstance(owner, OwnerElsewhere):
                        raise owner  # the same wait, relayed: its owner knows in memory
                    return
                left = deadline - loop.time()
                if left <= 0:  # still running there: its live view is one GET to its owner (or a 503)
                    error = self.owner(job_id, stored.instance_id, stored.instance_epoch, caller)
                    if isinstance(error, OwnerElsewhere):
                        error.instead = ("GET", f"/jobs/{job_id}")
                    raise error
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), left)
                woken.clear()
