"""Recovery: what a previous run left (start-up sweep, lost jobs), and retention (purge of old jobs).

At start-up, before anything is served: take the work dir's lock (``service.workdir``), remove the sandboxes an
earlier run of this instance left, empty the job folders, set aside the durable jobs the store holds unfinished for
this instance (``resumable``: the job service resumes them by replay, ``service.jobs.durability``; one parked
waiting for the harness is made this incarnation's and held parked instead, ``hold_parked``) and mark every other
one ``lost`` (its output as far as it was kept), and count the output bytes each owner retains against its budget.
Then, every ``purge_interval_s``, ended jobs older than ``job_retention_s`` are deleted with their output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any

import orjson

from service import workdir
from service.broker.config import REPORT_FIELD_CAP
from service.broker.durable import ANSWER
from service.engines import Engines
from service.errors import SandboxError
from service.files import FILES_FOLDER
from service.jobs.admission import Admitted, Intake, Ticket
from service.jobs.durability import RunSpec, logged_calls
from service.jobs.events import JobLost, ParkedJobStopped
from service.jobs.live import SLICE_BYTES, STREAMS, now
from service.jobs.marks import mark_stored, read_marks
from service.jobs.model import ErrorType, Failure, JobStatus
from service.jobs.parking import ParkedJob
from service.jobs.state import JobState
from service.output import CappedStream, read_range
from service.quotas import Quotas
from service.replicas.reaper import lost_row
from service.replicas.registration import Replicas
from service.sandbox.folders import SandboxFolders
from service.settings import Settings
from service.store import JobStore, StoredJob
from service.tenancy import key_names

log = logging.getLogger(__name__)


class Recovery:
    """The start-up sweep and the retention purge.

    Args:
        settings: ``work_dir``, retention settings, this instance's id (``Settings.instance``).
        engines: remove the sandboxes an earlier run of this instance left (``Engines.sweep``).
        store: the job store.
        folders: the sandbox folders (a tmpfs, opened here).
        quotas: output budgets per owner.
        state: its ``events`` (``JobLost`` is published for each job marked lost) and ``final_views`` (ended jobs'
            views kept for reading: a purged job leaves them).
        replicas: registered in the store once the work dir is locked, before anything is swept (None: not, for
            tests of the sweep alone).
    """

    def __init__(
        self,
        settings: Settings,
        engines: Engines,
        store: JobStore,
        folders: SandboxFolders,
        quotas: Quotas,
        state: JobState,
        replicas: Replicas | None = None,
    ) -> None:
        self._settings = settings
        self._engines = engines
        self._store = store
        self._folders = folders
        self._quotas = quotas
        self._events = state.events
        self._views = state.final_views
        self._parked = state.parked
        self._instance = settings.instance()
        self._replicas = replicas
        self.jobs_dir = folders.path / "jobs"
        self.output_dir = settings.work_dir / "output"
        self._lock: IO[str] | None = None
        self.resumable: list[tuple[RunSpec, str]] = []  # durable jobs left unfinished, and why resumed (``start``)

    def release(self) -> None:
        """Give the work dir's lock back (at shutdown; the kernel would at the process's exit anyway)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    async def sweep(self, which: str) -> int:
        """Remove every sandbox labelled with this instance (at start-up, and at shutdown once every job, session
        and pool has removed its own: none should remain then); returns how many. A removal logs a warning
        naming ``which`` they were; an engine that cannot be asked is logged, not raised."""
        try:
            removed = await self._engines.sweep()
        except SandboxError as exc:
            log.warning("could not sweep sandboxes of instance %s: %s", self._instance, exc)
            return 0
        if removed:
            log.warning("removed %d sandbox(es) %s of instance %s", removed, which, self._instance)
        return removed

    async def start(self) -> None:
        """Lock the work dir, then reconcile what a previous run left: sandboxes, job folders, unfinished jobs.

        Raises:
            WorkDirBusy: another running instance holds the work dir.
            InstanceIdInUse: another live replica holds this instance id (``Replicas.register``).
        """
        self._lock = workdir.lock(self._settings.work_dir)
        if self._replicas is not None:
            try:
                await self._replicas.register()  # before the sweep: a second replica of this id must not sweep
            except BaseException:
                self.release()
                raise
            self._replicas.start()  # renewed from now on: the sweep below may outlast the lease
        await self.sweep("left behind by an earlier run")
        await asyncio.to_thread(self._folders.open)  # a tmpfs: sandboxes' mount tables show no host path
        if self.jobs_dir.exists():
            await asyncio.to_thread(shutil.rmtree, self.jobs_dir, False, _removal_failed)
        for folder in (self.jobs_dir, self.output_dir):
            folder.mkdir(parents=True, exist_ok=True)
        # Only root (the service) enters the work dir: the engine mounts job folders into sandboxes itself.
        os.chmod(self._settings.work_dir, 0o700)
        for owner, retained in (await asyncio.to_thread(_retained_by_owner, self.output_dir)).items():
            self._quotas.output(owner).take(retained)  # before a job is marked lost below: it charges its own row
        for stored in await self._store.jobs.unfinished(self._instance):
            spec = await self.spec_of(stored)
            if spec is None:
                await self.mark_lost(stored)
            elif spec.waits is None:
                self.resumable.append((spec, "drained" if spec.parked else "service_restarted"))
            elif (answered := await self.hold_parked(spec)) is not None:
                self.resumable.append((answered, "answered"))

    async def spec_of(self, stored: StoredJob) -> RunSpec | None:
        """The run spec of a durable job left unfinished, with the resumes its last saved view lists; None for a
        job that has none (not durable, or stopped before its script started), or one this version cannot read."""
        data = await self._store.runs.spec(stored.job_id)
        if data is None:
            return None
        try:
            spec = RunSpec.decode(data)
            view = orjson.loads(stored.view) if stored.view else {}
        except Exception:  # any spec this version cannot read (a missing field, a wrong type): lost, not a crash
            log.exception("job %s: its run spec cannot be read; it cannot be resumed", stored.job_id)
            return None
        parked = bool(view.get("parked_at"))
        waits = _waits(stored.job_id, spec.owner, view) if parked else None
        active_s = float(view.get("active_ms") or 0.0) / 1000
        resumes = tuple(view.get("resumes") or ())
        return replace(spec, resumes=resumes, parked=parked, stored=stored, waits=waits, active_s=active_s)

    async def adopt(self, stored: StoredJob) -> bool:
        """Make an unfinished job this incarnation's (its saves are fenced by it from now on), if it is still the
        incarnation's ``stored`` names (``JobRecords.adopt``); whether it is. With one replica (no registry): True.
        Raises what the store raises."""
        if self._replicas is None:
            return True
        me = self._replicas.incarnation
        return await self._store.jobs.adopt(
            stored.job_id, (stored.instance_id, stored.instance_epoch), (me.instance_id, me.epoch)
        )

    def holds(self, stored: StoredJob) -> bool:
        """Whether ``stored`` (a job parked here, as read now) is unfinished and still this incarnation's: no other
        replica has taken it over (``adopt``), so this one alone may answer, expire, resume or stop it."""
        if stored.ended_at is not None:
            return False
        if self._replicas is None:
            return True
        me = self._replicas.incarnation
        return (stored.instance_id, stored.instance_epoch) == (me.instance_id, me.epoch)

    async def hold_parked(self, spec: RunSpec) -> RunSpec | None:
        """Take over a job found parked waiting for the harness (``spec.waits``: left by an earlier run of this
        instance, or by a dead replica): made this incarnation's (``adopt``; None if another replica took it first),
        then held parked here (``ParkedJobs``, past ``PTC_MAX_PARKED_JOBS`` too: it costs rows, where a resume would
        take a sandbox no bound counts; None), or returned, to be resumed at once (reason ``answered``), when an
        answer to a call it waits for is stored already (the service stopped before that answer's resume saved it).
        Raises what the store raises."""
        stored, waits = spec.stored, spec.waits
        assert stored is not None and waits is not None
        if not await self.adopt(stored):
            return None
        if self._replicas is not None:  # its row is this incarnation's now: a resume adopts it from here
            me = self._replicas.incarnation
            spec = replace(spec, stored=replace(stored, instance_id=me.instance_id, instance_epoch=me.epoch))
        try:  # unreadable: held parked all the same (an answer, or its expiry, resumes it with a stored answer)
            if await self._store.runs.settled(spec.job_id, ANSWER) & waits.calls.keys():
                return spec
        except Exception:
            log.exception("job %s: its call log could not be read; held parked", spec.job_id)
        self._parked.add(waits)
        return None

    async def mark_lost(self, stored: StoredJob, why: str | None = None) -> None:
        """End a job a previous run left unfinished: status ``lost``, its output as far as it was kept (unless
        another replica's reaper marked it first: ``JobRecords.save_lost``); ``why``: what stopped its resume."""
        message = (
            f"the service stopped while the job was {stored.status}; its sandbox was removed when it started again"
        )
        error = Failure(ErrorType.SERVICE_RESTARTED, message if why is None else f"{message}; not resumed: {why}")
        if await self._end(stored, error, "the service stopped", JobStatus.LOST):
            self._events.publish(JobLost(stored.job_id, stored.status))
            log.warning("job %s was %s when the service last stopped: marked lost", stored.job_id, stored.status)

    async def stop_parked(self, stored: StoredJob) -> None:
        """End a parked job ``stopped`` (``POST /jobs/{id}/stop``) from its saved view (``stored``: its row, read
        now), without running it again: its output and call records as parked, the calls it waited for
        ``cancelled``. Raises what the store raises."""
        error = Failure(ErrorType.STOPPED, "stopped while parked")
        if await self._end(stored, error, "the job was stopped while parked", JobStatus.STOPPED):
            self._events.publish(ParkedJobStopped(stored.job_id))

    async def _end(self, stored: StoredJob, error: Failure, cancelled: str, status: JobStatus) -> bool:
        """Save an unfinished job ended (``lost_row``) unless another ended it first (``JobRecords.save_lost``, with
        its callback's row, pending, in the same transaction: any replica delivers it, docs/scaling.md, Callbacks,
        exactly once), then drop its run spec and call log; whether this call ended it. Its row counts against its
        owner's output budget as an ended job's does, when it is this instance's (marked: the purge gives it back)."""

        async def replay(stream: str, inline: CappedStream, limit: int) -> int:
            return await self._replay(self.output_dir / stored.job_id / stream, inline, limit)

        row = await lost_row(stored, error, cancelled, replay, self._settings.output_retention_bytes, status)
        ended = await self._store.jobs.save_lost(row)
        folder = self.output_dir / stored.job_id  # this instance's purge gives it back: only its own rows count
        if ended and stored.owner is not None and stored.instance_id == self._instance and folder.is_dir():
            self._quotas.output(stored.owner).charge(kept := len(row.view) + len(row.summary))
            try:
                mark_stored(folder, kept)
            except OSError:
                log.exception("job %s: could not note the bytes it keeps in the store", stored.job_id)
        await self._store.runs.forget(stored.job_id)  # its run spec (with its env) and call log: nothing resumes it
        return ended

    async def resume(self, intake: Intake, start: Callable[[Admitted], object]) -> int:
        """Resume the durable jobs ``start`` set aside (``resumable``): each admitted again from its run spec with
        its call log (``Intake.readmit``) and run (``start``: ``Runner.start``); one that cannot be is marked lost,
        saying why. Call once the engines have started. Returns how many were resumed."""
        specs, self.resumable = self.resumable, []
        resumed = 0
        for spec, reason in specs:  # parked at a SIGTERM, the service died, or parked waiting for the harness
            try:
                resumed += await self.resume_job(spec, reason, intake, start, spec.waits)
            except Exception:
                self.failed_resume(spec)
        return resumed

    def failed_resume(self, spec: RunSpec) -> None:
        """A resume the store failed, after its adopt (no replica takes it now): held parked if it waits for the
        harness (an answer, or its expiry, resumes it again), else left unfinished until the next start."""
        log.exception("job %s could not be resumed now", spec.job_id)
        if spec.waits is not None:
            self._parked.add(spec.waits)

    async def resume_job(
        self,
        spec: RunSpec,
        reason: str,
        intake: Intake,
        start: Callable[[Admitted], object],
        parked: ParkedJob | None = None,
        ticket: Ticket | None = None,
    ) -> bool:
        """Resume one durable job left unfinished, by replay (see ``resume``); ``reason`` goes in its view's
        ``resumes``; ``parked``: it was parked waiting for the harness (``service.jobs.parking``), and these are the
        calls it still waits for; ``ticket``: its admission, taken already (given back if it is not resumed). Its
        owner's key must still be configured (its role is today's). Returns whether it was resumed (else it is
        marked lost, or another replica took it). Raises what the store raises."""
        resumed = False
        try:
            resumed = await self._resume_job(spec, reason, intake, start, parked, ticket)
            return resumed
        finally:
            if ticket is not None and not resumed:
                ticket.release()

    async def _resume_job(
        self,
        spec: RunSpec,
        reason: str,
        intake: Intake,
        start: Callable[[Admitted], object],
        parked: ParkedJob | None,
        ticket: Ticket | None,
    ) -> bool:
        stored = spec.stored
        assert stored is not None
        names = key_names(self._settings)  # an owner's key must still exist, its role is today's
        if names is not None and spec.owner not in names:
            await self.mark_lost(stored, f"its owner's API key {spec.owner!r} is no longer configured")
            return False
        spec = replace(spec, admin=names is None or spec.owner in self._settings.admin_keys)
        entry = {"at": now(), "reason": reason, "instance": self._instance}
        if not await self.adopt(stored):
            return False  # ended, or taken, meanwhile
        replay = await logged_calls(self._store, spec.job_id)  # a store failure is raised: it stays unfinished
        try:
            waits = (parked.calls, parked.active_s) if parked is not None else None
            admitted = await intake.readmit(spec, replay, entry, waits, ticket)
        except Exception as exc:
            log.exception("job %s could not be resumed", spec.job_id)
            await self.mark_lost(stored, f"{type(exc).__name__}: {exc}"[:REPORT_FIELD_CAP])
            return False
        start(admitted)
        log.warning(
            "job %s (%s) resumed (%s), replaying %d logged call(s)", spec.job_id, stored.status, reason, len(replay)
        )
        return True

    @staticmethod
    async def _replay(path: Path, inline: CappedStream, limit: int) -> int:
        """Write the first ``limit`` bytes of a retained file into ``inline`` a ``SLICE_BYTES`` slice at a time
        (never the whole file in memory); returns how many."""
        size = 0
        while size < limit:
            data = await asyncio.to_thread(read_range, path, size, min(SLICE_BYTES, limit - size))
            if not data:
                break
            inline.write(data)
            size += len(data)
        return size

    async def purge_loop(self) -> None:
        """Purge expired jobs every ``purge_interval_s``, for ever (cancel it); a failed purge is logged."""
        while True:
            try:
                await self.purge_expired()
            except Exception:
                log.exception("purging expired jobs failed")
            await asyncio.sleep(self._settings.purge_interval_s)

    async def purge_expired(self) -> int:
        """Delete ended jobs older than the retention, with their output files; returns how many."""
        cutoff = now() - timedelta(seconds=self._settings.job_retention_s)
        ids = await self._store.jobs.purge(cutoff, self._instance)  # a shared store: another replica's are its own
        for job_id in ids:
            self._views.drop(job_id)
            owner, retained = await asyncio.to_thread(_remove_output, self.output_dir / job_id)
            if owner is not None:
                self._quotas.output(owner).give_back(retained)
        if ids:
            log.info("purged %d job(s) ended before %s", len(ids), cutoff.isoformat())
        return len(ids)


def _waits(job_id: str, owner: str, view: dict[str, Any]) -> ParkedJob | None:
    """What a job parked waiting for the harness waits for, from its saved view (its ``pending_calls`` and
    ``active_ms``); None for a job parked by a draining service with no such wait (resumed at start-up)."""
    pending = view.get("pending_calls") or []
    if not pending:
        return None
    calls = {c["call_id"]: (c["awaiting"], datetime.fromisoformat(c["expires_at"])) for c in pending}
    return ParkedJob(job_id, owner, calls, float(view.get("active_ms") or 0.0) / 1000)


def _removal_failed(function: object, path: str, excinfo: tuple[type[BaseException], BaseException, object]) -> None:
    """``shutil.rmtree``'s ``onerror``: log what could not be removed, go on with the rest."""
    log.warning("could not remove %s: %s", path, excinfo[1])


def _retained(folder: Path) -> tuple[str | None, int]:
    """The owner of a job's output folder and the bytes it makes the service keep: its retained output, its output
    files and what it keeps in the store (``marks``) (blocking: run it in a thread)."""
    owner, stored = read_marks(folder)  # no owner: written before owners were recorded, counted against nobody
    size = stored or 0
    for stream in STREAMS:
        with contextlib.suppress(OSError):
            size += (folder / stream).stat().st_size
    with contextlib.suppress(OSError):  # its output files (service.files) count too
        size += sum(entry.stat().st_size for entry in (folder / FILES_FOLDER).iterdir())
    return owner, size


def _retained_by_owner(output_dir: Path) -> dict[str, int]:
    """Retained output bytes per owner in ``output_dir`` (blocking; at start-up)."""
    totals: Counter[str] = Counter()
    for folder in output_dir.iterdir():
        owner, size = _retained(folder)
        if owner is not None:
            totals[owner] += size
    return dict(totals)


def _remove_output(folder: Path) -> tuple[str | None, int]:
    """Delete a job's output folder; returns its owner and the bytes it retained (blocking)."""
    found = _retained(folder)
    shutil.rmtree(folder, True)
    return found
