"""Durable jobs on the job service's side (docs/durability.md): the run spec a resume is made from, and the broker's
call log (``service.broker.durable``) stored in the job store (``store.runs``).

A durable job's run spec is written once its sandbox is ready and before its script starts (its interpreter's
string-hash seed is known then): the request as admitted (script, files, env, manifest or toolset, limits, image,
metadata, callback), its owner, engine and creation time. At start-up a job this instance left unfinished is
resumed from its spec and its call log when it has both (``Intake.readmit``), else it is marked ``lost`` as before.
Both are dropped once the job's final view is saved.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson

from service.broker.durable import CallLogPort, DurableLog, Logged
from service.jobs.events import Events, JobParked
from service.jobs.live import LiveJob, now
from service.jobs.model import ErrorType, Failure
from service.jobs.parking import ParkedJob, ParkedJobs, only_waits
from service.schemas.job_models import ExecuteRequest
from service.store import JobStore, StoredJob
from service.store.call_log import LoggedCall

if TYPE_CHECKING:
    from service.broker import Broker
    from service.jobs.admission import Admitted

log = logging.getLogger(__name__)

SPEC_VERSION = 1


@dataclass(frozen=True)
class RunSpec:
    """What a durable job's runs are made from (see the module)."""

    job_id: str
    owner: str
    admin: bool
    engine: str
    image: str
    created_at: datetime
    hash_seed: int | None
    request: ExecuteRequest
    resumes: tuple[dict[str, Any], ...] = ()  # the earlier resumes its last saved view lists (not stored here)
    stored: StoredJob | None = None  # its row as last saved, when read back to resume it (not stored here)
    parked: bool = False  # its last saved view says it was parked, when read back (not stored here)
    waits: ParkedJob | None = None  # parked waiting for the harness: for what, when read back (not stored here)
    active_s: float = 0.0  # the time its runs took as its last saved view says (``active_ms``; not stored here)

    def encode(self) -> bytes:
        """The spec as stored (JSON)."""
        return orjson.dumps(
            {
                "version": SPEC_VERSION,
                "job_id": self.job_id,
                "owner": self.owner,
                "admin": self.admin,
                "engine": self.engine,
                "image": self.image,
                "created_at": self.created_at.isoformat(),
                "hash_seed": self.hash_seed,
                "request": self.request.model_dump(mode="json"),
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> RunSpec:
        """A stored spec. Raises ValueError (and pydantic's ValidationError, a ValueError) for one this version
        cannot read."""
        spec = orjson.loads(data)
        if not isinstance(spec, dict) or spec.get("version") != SPEC_VERSION:
            raise ValueError("a run spec of another version")
        return cls(
            job_id=spec["job_id"],
            owner=spec["owner"],
            admin=bool(spec["admin"]),
            engine=spec["engine"],
            image=spec["image"],
            created_at=datetime.fromisoformat(spec["created_at"]),
            hash_seed=spec["hash_seed"],
            request=ExecuteRequest.model_validate(spec["request"]),
        )


async def keep_spec(store: JobStore, admitted: Admitted, hash_seed: int | None) -> None:
    """Store the run spec of an admitted durable job whose sandbox is ready (its interpreter's ``hash_seed``
    known), before its script starts (not again for a resumed one: it is stored); raises what the store raises."""
    job = admitted.job
    if not job.durable or admitted.resumed:
        return
    job.hash_seed = hash_seed
    spec = RunSpec(
        job.id, job.owner, admitted.admin, job.engine, job.image, job.created_at, hash_seed, admitted.request
    )
    await store.runs.put_spec(job.id, spec.encode())
    job.spec_kept = True


def stop_diverged(job: LiveJob, message: str) -> None:
    """A resumed job's replay diverged from its call log (the broker's ``on_diverged``): stop it; it ends
    ``failed``, ``replay_diverged`` (``Runner._finish``)."""
    if job.diverged is None:
        job.diverged = Failure(ErrorType.REPLAY_DIVERGED, message)
        job.stop_reason = "its replay diverged from its call log"
        job.stop_requested.set()


async def park(
    admitted: Admitted,
    store: JobStore,
    save: Callable[[LiveJob], Awaitable[None]],
    events: Events,
    parked: ParkedJobs,
) -> None:
    """Leave a durable job unfinished in the store, its run spec and call log with it, for a resume by replay: at
    the next start (the service is stopping: ``JobManager.close``), or when a call it waits for is answered or
    expires (it waited for the harness: ``service.jobs.parking``); its view says when (``parked_at``), saved
    through ``save`` (``Runner.save``), then ``JobParked`` is published. A job parked before its script started
    has its spec stored now (no hash seed: its resume is its first run). The calls it waits for
    (``LiveJob.parked_calls``) stay ``pending`` in its records; a job that waits for the harness joins ``parked``
    (an answer or an expiry resumes it, not the next start), in the place it reserved. Never raises."""
    job = admitted.job
    job.parked_at = now()
    waited = {call["call_id"] for call in job.parked_calls}
    for record in job.calls:  # closing the broker cancelled their waits: they still wait, for the harness now
        if record.get("call_id") in waited:
            record.update(status="pending", error=None)
    try:
        if not job.spec_kept:
            await keep_spec(store, admitted, None)
        await save(job)
    except Exception:  # its last saved row is unfinished still: it is resumed all the same
        log.exception("job %s: could not save it parked", job.id)
    if job.parked_calls:
        log.info("job %s parked: an answer to a call it waits for resumes it by replay", job.id)
        calls = {c["call_id"]: (c["awaiting"], c["expires_at"]) for c in job.parked_calls}
        parked.add(ParkedJob(job.id, job.owner, calls, job.active_s), reserved=job.park_reserved)
    else:
        log.warning("job %s parked: it is resumed by replay when the service starts again", job.id)
        if job.park_reserved:
            parked.release(job.owner)
    job.park_reserved = False
    events.publish(JobParked(job))


def left_unmade(broker: Broker, ended_by: str | None) -> Failure | None:
    """``replay_diverged`` for a resumed job whose script ended by itself (``ended_by`` None: not stopped, not timed
    out) while logged calls were never made again (it took another path: an answer given to a call it no longer
    makes would be lost unseen); None otherwise."""
    unmade = broker.durable.unmade() if broker.durable is not None and ended_by is None else None
    return Failure(ErrorType.REPLAY_DIVERGED, unmade) if unmade is not None else None


def waiting_for(broker: Broker, taken: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a job being parked waits for (``pending_calls``): ``taken`` (what ``park_due`` took when it decided
    to park it) and the calls that began to wait for the harness since. At a shutdown (none taken): the calls that
    wait for the harness if every call it has in flight does (an answer resumes it then, ``service.jobs.parking``),
    else none (it is resumed at the next start)."""
    pending = broker.paused.pending_calls
    if taken:
        known = {call["call_id"] for call in taken}
        return taken + [call for call in pending if call["call_id"] not in known]
    return pending if pending and only_waits(broker) else []


def call_log(store: JobStore, job: LiveJob, replay: list[Logged], max_bytes: int) -> DurableLog | None:
    """A durable job's call log for its broker, stored in ``store.runs`` (``replay``: a resumed job's earlier
    log), of at most ``max_bytes`` (``PTC_MAX_CALL_LOG_BYTES``: past it the job is durable no more, its log and
    run spec dropped); None for a job that is not durable."""

    async def give_up() -> None:
        job.durable = False
        log.warning("job %s: its call log reached %d bytes; it is not durable any more", job.id, max_bytes)
        await store.runs.forget(job.id)

    return DurableLog(job.id, log_port(store, job.id), replay, bounds=(max_bytes, give_up)) if job.durable else None


async def forget_run(store: JobStore, job: LiveJob) -> None:
    """Drop an ended durable job's run spec and call log (its final view is saved: nothing resumes it)."""
    if job.durable:
        await store.runs.forget(job.id)


def log_port(store: JobStore, job_id: str) -> CallLogPort:
    """Where the broker of ``job_id`` stores its call log: ``store.runs``."""

    def write(entries: Sequence[Logged]) -> Any:
        rows = [LoggedCall(e.seq, e.call_id, e.tool, e.args, e.outcome) for e in entries]
        return store.runs.write(job_id, rows)

    return write


async def logged_calls(store: JobStore, job_id: str) -> list[Logged]:
    """The call log of ``job_id``'s earlier runs, as its broker replays it."""
    return [Logged(c.seq, c.call_id, c.tool, c.args, c.outcome) for c in await store.runs.calls(job_id)]
