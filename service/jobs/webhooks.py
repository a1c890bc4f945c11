"""Webhooks: the completion callback of a job, POSTed to its ``callback_url`` once its final view is saved.

Signing (Standard Webhooks: ``webhook-id`` is ``msg_<job id>``, the same in every attempt, after a restart and from
any replica), retries and the wire format are ``service.callbacks``. Delivery uses a client of its own (at most
``CALLBACK_DELIVERIES`` connections, ``CALLBACK_DELIVERIES_PER_OWNER`` of them for one owner's callbacks, through
the egress rules of tool endpoints, no redirects); each attempt is saved into the job's view as it happens.

Exactly one replica delivers each callback (docs/scaling.md, Callbacks, exactly once): a job's callback is a row of
the store's ``callbacks`` table, written in the transaction that ends the job. The owner's final save writes it
``delivering``, claimed by itself, and ``Webhooks.job_ended`` (the subscriber of ``events.JobEnded``) delivers it at
once. A job marked lost (the start-up recovery, a reaper) gets it ``pending``; every replica's worker (``run``)
claims due rows, woken by ``ptc_callbacks`` and the registry's notifications (``wake``) and every
``PTC_REPLICA_HEARTBEAT_S`` (±20 %), up to its free delivery slots and each owner's, and takes over rows
``delivering`` by an incarnation that is no longer live or draining. Before each attempt the claimer checks its
lease (fenced, or its local deadline passed: it stops, writes nothing, and the claim passes on once its
incarnation is expired); the outcome is written fenced by the claim (``CallbackLedger.end``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from typing import Any

import httpx

from service import callbacks
from service.callbacks import CallbackPolicy
from service.errors import LeaseLost, StoreUnavailable
from service.jobs.events import JobEnded
from service.jobs.live import stored_job
from service.jobs.state import JobState
from service.observability import telemetry
from service.observability.metrics import Metrics
from service.replicas.registration import Replicas
from service.settings import Settings
from service.store import Incarnation, JobStore, StoredJob
from service.views import render
from service.views.read import JobViews
from service.views.render import EncodedView, render_head

log = logging.getLogger(__name__)

CALLBACK_DELIVERIES = 32  # deliveries (and connections) at once
# One owner's deliveries at once: a key whose receivers hang (each delivery then holds its slot for its attempts,
# timeouts and backoff) takes at most this many of the slots; the rest stay for other keys' callbacks (with one
# tenant, there are no other keys: it may take them all).
CALLBACK_DELIVERIES_PER_OWNER = 8


class Webhooks:
    """Delivers completion callbacks: its own jobs' at their end, and any due callback it claims from the store.

    Args:
        settings: attempts, backoff and timeout of deliveries; the scan interval (``replica_scan_s``).
        store: the ``callbacks`` rows, and where each attempt is saved into the job's view.
        job_views: reads an ended job's final view.
        state: its ``final_views`` (ended jobs' views kept for reading, updated with each attempt) and ``tasks``
            (where deliveries and the worker are held).
        callback_policy: the callback secrets per owner, the egress rules a callback's connection passes, and
            whether one tenant's callbacks may take every delivery slot (``single_tenant``).
        metrics: counts attempts and outcomes.
        replicas: this replica: its incarnation (every claim's) and its lease (checked before each attempt).
    """

    def __init__(
        self,
        settings: Settings,
        store: JobStore,
        job_views: JobViews,
        state: JobState,
        callback_policy: CallbackPolicy,
        metrics: Metrics,
        replicas: Replicas,
    ) -> None:
        self._settings = settings
        self._store = store
        self._views = job_views
        self._cache = state.final_views
        self._callback_secrets = callback_policy.secrets
        self._metrics = metrics
        self._tasks = state.tasks
        self._replicas = replicas
        self._http = httpx.AsyncClient(  # callbacks pass the egress rules of tool endpoints
            follow_redirects=False,
            transport=callback_policy.egress.transport(limits=httpx.Limits(max_connections=CALLBACK_DELIVERIES)),
        )
        self._slots = CALLBACK_DELIVERIES
        self._per_owner = CALLBACK_DELIVERIES if callback_policy.single_tenant else CALLBACK_DELIVERIES_PER_OWNER
        self._callback_slots = asyncio.Semaphore(self._slots)
        self._owner_slots: dict[str, asyncio.Semaphore] = {}  # one per owner (API key name): as many as keys
        self._held: Counter[str] = Counter()  # deliveries held here (running or waiting for a slot), per owner
        self._wake = asyncio.Event()
        self.claims: Counter[str] = Counter()  # callbacks claimed from the store: ``pending``, ``takeover``

    def job_ended(self, event: JobEnded) -> None:
        """Subscriber of ``JobEnded``: deliver the job's callback, if it has one, in the background (its row was
        written ``delivering``, claimed by this incarnation, by the final save)."""
        if event.job.callback_url:
            trace_headers: dict[str, str] = {}
            telemetry.inject(trace_headers, event.job.span)  # the job's traceparent, when tracing is on
            self._hold(event.job.id, event.job.owner or "", 0, trace_headers)

    async def resume(self) -> None:
        """Start the worker that claims due callbacks (at once: those an earlier run left, or a lost job's)."""
        self._tasks.spawn(self.run(), "callback worker")

    def wake(self) -> None:
        """Claim due callbacks now (a ``ptc_callbacks`` or ``ptc_replicas`` notification arrived)."""
        self._wake.set()

    async def run(self) -> None:
        """The worker: claim due callbacks, then sleep until woken or the scan interval passed; for ever (cancel
        it). A claim that fails (the store does not answer) is logged and tried again at the next scan."""
        while True:
            self._wake.clear()
            try:
                await self.claim()
            except StoreUnavailable:
                log.warning("claiming due callbacks failed: the store did not answer; again at the next scan")
            except Exception:
                log.exception("claiming due callbacks failed")
            interval = self._settings.replica_scan_s * random.uniform(0.8, 1.2)  # jitter
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    async def claim(self) -> int:
        """Claim due callbacks up to the free delivery slots (and each owner's) and deliver them in the background;
        returns how many were claimed.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        if self._replicas.fenced or self._replicas.lease_left_s() <= 0:
            return 0
        held = dict(self._held)  # a copy: the SQLite store calls ``room`` on its own thread

        def room(owner: str | None) -> int:
            return self._per_owner - held.get(owner or "", 0)

        free = self._slots - sum(held.values())
        claimed = await self._store.callbacks.claim(self._replicas.incarnation, free, room)
        for claim in claimed:
            how = "takeover" if claim.takeover else "pending"
            self.claims[how] += 1
            log.info("job %s: its callback is claimed here (%s)", claim.job_id, how)
            self._hold(claim.job_id, claim.owner or "", claim.attempts, {})
        return len(claimed)

    async def close(self) -> None:
        """Close the client (deliveries are cancelled by the owner of ``tasks`` first)."""
        await self._http.aclose()

    def _hold(self, job_id: str, owner: str, attempts: int, trace_headers: dict[str, str]) -> None:
        """Deliver a callback claimed by this incarnation in the background, held in ``owner``'s count."""
        self._held[owner] += 1

        async def deliver() -> None:
            try:
                await self._deliver_callback(job_id, owner, attempts, trace_headers)
            finally:
                self._held[owner] -= 1
                if not self._held[owner]:
                    del self._held[owner]
                self._wake.set()  # a slot is free: more due callbacks may be claimed

        self._tasks.spawn(deliver(), f"callback {job_id}")

    async def _deliver_callback(self, job_id: str, owner: str, attempts: int, trace_headers: dict[str, str]) -> None:
        """Deliver the job's completion callback (at most ``CALLBACK_DELIVERIES`` at once, and
        ``CALLBACK_DELIVERIES_PER_OWNER`` of ``owner``'s), saving each attempt; ``attempts``: recorded by earlier
        claimers; ``trace_headers``: its ``traceparent`` (none for a claimed callback)."""
        owner_slots = self._owner_slots.setdefault(owner, asyncio.Semaphore(self._per_owner))
        async with owner_slots, self._callback_slots:  # the owner's slot first: waiting for it takes no shared one
            while True:
                try:
                    return await self._deliver_callback_now(job_id, attempts, trace_headers)
                except LeaseLost:
                    log.warning("job %s: its callback delivery stopped: this replica's lease lapsed", job_id)
                # The claim stays this incarnation's: once expired, another replica takes it over; if the lease is
                # renewed instead (the store answered again in time), nobody else may, so this replica starts again.
                if not await self._lease_back():
                    return

    async def _lease_back(self) -> bool:
        """Wait (a heartbeat at a time) until the lease is held again (True) or the replica is fenced (False)."""
        while True:
            if self._replicas.fenced:
                return False
            if self._lease_held():
                return True
            await asyncio.sleep(self._settings.replica_heartbeat_s)

    def _lease_held(self) -> bool:
        """Whether this incarnation may still act (checked before each attempt)."""
        return not self._replicas.fenced and self._replicas.lease_left_s() > 0

    async def _deliver_callback_now(self, job_id: str, earlier: int, trace_headers: dict[str, str]) -> None:
        """Raises ``LeaseLost`` when the lease is lost before an attempt (nothing is written then)."""
        incarnation = self._replicas.incarnation
        stored = await self._store.jobs.get(job_id)
        if stored is None:
            return
        secrets = self._callback_secrets.for_owner(stored.owner)
        if secrets is None:
            log.warning("job %s: its callback cannot be sent: no callback secret for its owner is set", job_id)
            await self._store.callbacks.end(job_id, incarnation, "failed", earlier)
            return
        final = await self._views.encoded(job_id)
        view = dict(final.head)
        callback = view["callback"] = dict(view["callback"], attempts=list(view["callback"]["attempts"]))
        body = final.body
        pending: list[asyncio.Task[None]] = []
        made = 0

        def on_attempt(attempt: dict[str, Any]) -> None:
            nonlocal made
            made += 1
            self._metrics.callback_attempt(attempt)
            callback["attempts"].append(attempt)
            pending.append(asyncio.ensure_future(self._put_view(stored, view, final)))

        def before_attempt() -> None:
            if not self._lease_held():
                raise LeaseLost(f"callback of job {job_id}: the lease of {incarnation.instance_id} is lost")

        try:
            delivered = await callbacks.deliver(
                self._http,
                callback["url"],
                body,
                secrets,
                msg_id=callbacks.message_id(job_id),
                max_attempts=self._settings.callback_max_attempts,
                backoff_s=self._settings.callback_backoff_s,
                timeout_s=self._settings.callback_timeout_s,
                on_attempt=on_attempt,
                owner=stored.owner,
                trace_headers=trace_headers,
                before_attempt=before_attempt,
            )
        finally:
            for outcome in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.error("job %s: saving a callback attempt into its view failed", job_id, exc_info=outcome)
        state = "delivered" if delivered else "failed"
        self._metrics.callback_done(delivered)
        if not await self._recorded(job_id, incarnation, state, earlier + made):
            return
        callback["state"] = state
        await self._put_view(stored, view, final)
        if not delivered:
            log.warning(
                "job %s: callback to its callback_url failed after %d attempts", job_id, len(callback["attempts"])
            )

    async def _recorded(self, job_id: str, incarnation: Incarnation, state: str, attempts: int) -> bool:
        """Record the outcome fenced by the claim; False when another replica holds the claim now (its delivery's
        outcome is the one kept). A job without a row (its final save came after this delivery, or the store was
        made before callbacks had rows) counts as recorded."""
        if await self._store.callbacks.end(job_id, incarnation, state, attempts):
            return True
        if await self._store.callbacks.get(job_id) is None:
            return True
        log.warning("job %s: its callback's claim passed to another replica; this outcome is dropped", job_id)
        return False

    async def _put_view(self, stored: StoredJob, head: dict[str, Any], final: EncodedView) -> None:
        """Save an ended job's view with a new ``head`` (its call records as they were); keep it for reading."""
        encoded = await render.encode(render_head(head), list(final.records()), final.summaries)
        await self._store.jobs.put(stored_job(encoded.head, len(encoded.spans), encoded.body, stored.instance_id))
        self._cache.put(stored.job_id, encoded)
