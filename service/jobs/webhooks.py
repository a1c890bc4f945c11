"""Webhooks: the completion callback of a job, POSTed to its ``callback_url`` once its final view is saved.

Signing (Standard Webhooks: ``webhook-id`` is ``msg_<job id>``, the same in every attempt and after a restart),
retries and the wire format are ``service.callbacks``. Delivery uses a client of its own (at most
``CALLBACK_DELIVERIES`` connections, ``CALLBACK_DELIVERIES_PER_OWNER`` of them for one owner's callbacks, through
the egress rules of tool endpoints, no redirects); each attempt is
saved into the job's view as it happens. Deliveries still pending when the service stopped are resumed at
start-up. ``Webhooks.job_ended`` is the subscriber of ``events.JobEnded``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from service import callbacks, telemetry, views
from service.callbacks import CallbackSecrets
from service.egress import EgressPolicy
from service.jobs.events import JobEnded
from service.jobs.live import stored_job
from service.jobs.tasks import Tasks
from service.jobs.views import JobViews
from service.metrics import Metrics
from service.settings import Settings
from service.store import JobStore, StoredJob
from service.views import EncodedView, render_head

log = logging.getLogger(__name__)

CALLBACK_DELIVERIES = 32  # deliveries (and connections) at once
# One owner's deliveries at once: a key whose receivers hang (each delivery then holds its slot for its attempts,
# timeouts and backoff) takes at most this many of the slots; the rest stay for other keys' callbacks.
CALLBACK_DELIVERIES_PER_OWNER = 8


class Webhooks:
    """Delivers completion callbacks.

    Args:
        settings: attempts, backoff and timeout of deliveries.
        store: where each attempt is saved into the job's view.
        job_views: reads an ended job's final view.
        cache: ended jobs' views kept for reading (updated with each attempt).
        secrets: the callback secrets per owner.
        egress: the rules a callback's connection passes.
        metrics: counts attempts and outcomes.
        tasks: where deliveries are held.
        instance: this instance's id (its pending deliveries are resumed at start-up).
    """

    def __init__(
        self,
        settings: Settings,
        store: JobStore,
        job_views: JobViews,
        cache: views.ViewCache,
        secrets: CallbackSecrets,
        egress: EgressPolicy,
        metrics: Metrics,
        tasks: Tasks,
        instance: str,
    ) -> None:
        self._settings = settings
        self._store = store
        self._views = job_views
        self._cache = cache
        self._callback_secrets = secrets
        self._metrics = metrics
        self._tasks = tasks
        self._instance = instance
        self._http = httpx.AsyncClient(  # callbacks pass the egress rules of tool endpoints
            follow_redirects=False,
            transport=egress.transport(limits=httpx.Limits(max_connections=CALLBACK_DELIVERIES)),
        )
        self._callback_slots = asyncio.Semaphore(CALLBACK_DELIVERIES)
        self._owner_slots: dict[str, asyncio.Semaphore] = {}  # one per owner (API key name): as many as keys

    def job_ended(self, event: JobEnded) -> None:
        """Subscriber of ``JobEnded``: deliver the job's callback, if it has one, in the background."""
        if event.job.callback_url:
            trace_headers: dict[str, str] = {}
            telemetry.inject(trace_headers, event.job.span)  # the job's traceparent, when tracing is on
            delivery = self._deliver_callback(event.job.id, event.job.owner, trace_headers)
            self._tasks.spawn(delivery, f"callback {event.job.id}")

    async def resume(self) -> None:
        """Deliver the callbacks an earlier run of this instance left pending (in the background)."""
        for stored in await self._store.callbacks_pending(self._instance):
            owner = stored.owner or ""  # a job stored before owners were recorded: one bucket for them all
            self._tasks.spawn(self._deliver_callback(stored.job_id, owner), f"callback {stored.job_id}")

    async def close(self) -> None:
        """Close the client (deliveries are cancelled by the owner of ``tasks`` first)."""
        await self._http.aclose()

    async def _deliver_callback(self, job_id: str, owner: str, trace_headers: dict[str, str] | None = None) -> None:
        """Deliver the job's completion callback (at most ``CALLBACK_DELIVERIES`` at once, and
        ``CALLBACK_DELIVERIES_PER_OWNER`` of ``owner``'s), saving each attempt; ``trace_headers``: its
        ``traceparent`` (none for callbacks resumed at start-up)."""
        owner_slots = self._owner_slots.setdefault(owner, asyncio.Semaphore(CALLBACK_DELIVERIES_PER_OWNER))
        async with owner_slots, self._callback_slots:  # the owner's slot first: waiting for it takes no shared one
            await self._deliver_callback_now(job_id, trace_headers or {})

    async def _deliver_callback_now(self, job_id: str, trace_headers: dict[str, str]) -> None:
        stored = await self._store.get(job_id)
        if stored is None:
            return
        secrets = self._callback_secrets.for_owner(stored.owner)
        if secrets is None:
            log.warning("job %s: its callback cannot be sent: no callback secret for its owner is set", job_id)
            return
        final = await self._views.encoded(job_id)
        view = dict(final.head)
        callback = view["callback"] = dict(view["callback"], attempts=list(view["callback"]["attempts"]))
        body = final.body
        pending: list[asyncio.Task[None]] = []

        def on_attempt(attempt: dict[str, Any]) -> None:
            self._metrics.callback_attempt(attempt)
            callback["attempts"].append(attempt)
            pending.append(asyncio.ensure_future(self._put_view(stored, view, final)))

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
        )
        callback["state"] = "delivered" if delivered else "failed"
        self._metrics.callback_done(delivered)
        for outcome in await asyncio.gather(*pending, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("job %s: saving a callback attempt into its view failed", job_id, exc_info=outcome)
        await self._put_view(stored, view, final)
        if not delivered:
            log.warning(
                "job %s: callback to its callback_url failed after %d attempts", job_id, len(callback["attempts"])
            )

    async def _put_view(self, stored: StoredJob, head: dict[str, Any], final: EncodedView) -> None:
        """Save an ended job's view with a new ``head`` (its call records as they were); keep it for reading."""
        encoded = await views.encode(render_head(head), list(final.records()), final.summaries)
        await self._store.put(stored_job(encoded.head, len(encoded.spans), encoded.body, stored.instance_id))
        self._cache.put(stored.job_id, encoded)
