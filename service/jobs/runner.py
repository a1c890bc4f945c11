"""The run of a job: one path, two placements.

``Runner.start`` runs an admitted job as a task. The path is the same for every job: let its placement find it a
sandbox of the job's engine (waiting for a script slot, or its session's turn), saving it ``queued`` if that takes
more than a few milliseconds (``Runner._enter``); save it ``running`` while the script and the engine's stubs are
laid out in the sandbox and the calls connected to the job's broker; once that save is done, let the script go;
enforce ``timeout_s`` and stop requests (``_supervise``); set the final status by the end-of-run rules
(``model.end_of_run``); save the final view; only then tell anyone (``events.JobEnded``); and finally give the
sandbox back. The run path speaks to the engine's interface only (``service.engines``: ``Sandbox``,
``EngineRun``, ``Engine.stubs``), never to a sandbox backend. The placements (``service.jobs.placement``):

one-shot (a pooled or a cold sandbox, destroyed after the job), or in-session (the session's, kept for its next script).

A job's status is saved to the store before each event about it is published ("saved before anyone is told"),
so an ended job survives any crash of the service. This module imports neither metrics nor logs: they subscribe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from datetime import datetime
from functools import partial
from typing import Any

from service import verdict
from service.broker import Broker, BrokerConfig, BrokerHooks, BrokerShared
from service.broker.durable import Logged
from service.engines import Engine, EngineRun, ExitStatus, Sandbox
from service.files import OutputFiles
from service.jobs.admission import Admitted
from service.jobs.durability import call_log, forget_run, keep_spec, left_unmade, park, stop_diverged, waiting_for
from service.jobs.events import CallEnded, JobEnded, SandboxStarted, StatusChanged
from service.jobs.live import LiveJob, end_by_failure, note_stored_bytes, now, save_final_again, stored_job
from service.jobs.model import EndedBy, JobStatus, end_of_run
from service.jobs.parking import park_due
from service.jobs.placement import InSession, OneShot, Placement, Sandboxes
from service.jobs.shared import SHARE_AT_ONCE, keep_output
from service.jobs.state import JobState
from service.jobs.status_saves import StatusSaves
from service.jobs.tasks import until_done
from service.observability import stages, telemetry
from service.replicas.registration import Replicas
from service.settings import Settings
from service.store import JobStore
from service.toolkit.cache import CompiledManifest
from service.views import render
from service.views.render import render_head, snapshot

log = logging.getLogger(__name__)

KILL_WAIT_S = 30.0  # how long the sandbox may take to confirm the script's exit after its SIGKILL
QUEUED_SAVE_GRACE_S = 0.005  # a job that finds its sandbox within this is not saved ``queued`` first (Runner._enter)


class Runner:
    """Runs admitted jobs and keeps their status in the store.

    Args:
        settings: tool-call and output limits, ``stop_grace_s``; this instance's id (``Settings.instance``), saved
            with each job.
        store: the job store (every status change is saved there first).
        state: the live jobs (a job leaves them once its final view is saved), where lifecycle events are
            published, where run tasks are held, and where a job's final encoded view is kept for reading.
        sandboxes: what placements take sandboxes from (the engines, script slots, sessions).
        brokers: what every job's broker shares (``BrokerShared``: endpoint clients, check threads, call memory).
        replicas: this replica's incarnation, which every save carries (a save that matches no row fences it).
    """

    def __init__(
        self,
        settings: Settings,
        store: JobStore,
        state: JobState,
        sandboxes: Sandboxes,
        brokers: BrokerShared,
        replicas: Replicas,
    ) -> None:
        self._settings = settings
        self._store = store
        self._events = state.events
        self._sandboxes = sandboxes
        self._brokers = brokers
        self._live = state.live
        self._final_views = state.final_views
        self._share_slots = asyncio.Semaphore(SHARE_AT_ONCE)  # ended jobs' blobs copied into the store at once
        self._tasks = state.tasks
        self._parked = state.parked
        self._statuses = StatusSaves(state.tasks, self._save_and_tell)
        self._instance = settings.instance()
        self._replicas = replicas

    def start(self, admitted: Admitted) -> asyncio.Task[Any]:
        """Run the admitted job as a task; its ticket is given back and its output files closed when the job
        ends, or when the task ends however it ends (cancelled before it began included: ``run`` and its
        cleanup then never run)."""
        job, ticket = admitted.job, admitted.ticket
        # The job's span: a child of the current span (the request's that submitted it), kept on the job.
        job.span = telemetry.start_job(job.id, job.created_at, job.session_id, job.image)
        job.trace_id = telemetry.trace_id(job.span)
        placement: Placement
        if admitted.session is None:
            placement = OneShot(self._sandboxes, self._engine(job), job)
        else:
            placement = InSession(admitted.session, self._sandboxes, ticket, job, self._tasks)
        broker = self._new_broker(job, admitted.manifest, admitted.replay, admitted.carried)  # answers find it at once
        task = self._tasks.spawn(self.run(admitted, placement, broker), f"job {job.id}")

        def ended(_: asyncio.Task[Any]) -> None:
            ticket.release()
            for output in (job.stdout, job.stderr):
                output.close()
            if job.span is not None and job.span.is_recording():  # its cleanup never ran
                telemetry.end_job(job.span, job.status.value, (job.error or {}).get("type"))

        task.add_done_callback(ended)
        return task

    async def run(self, admitted: Admitted, placement: Placement, broker: Broker | None = None) -> None:
        """The run path of one job in ``placement`` (see the module's docstring). Never raises but
        CancelledError (the service stopping: the job ends ``lost``)."""
        job, request, manifest = admitted.job, admitted.request, admitted.manifest
        broker = broker or self._new_broker(job, manifest, admitted.replay, admitted.carried)
        try:
            try:
                sandbox = await self._enter(job, placement)
                stages.mark("sandbox-found")
                telemetry.interval(job.span, "queue wait", job.created_at, now())
                if sandbox is None:
                    return  # ended before it started (placement set why)
                begin, begin_at = time.monotonic(), now()
                job.sandbox_start = placement.mode
                job.started_at = now()
                saving = asyncio.ensure_future(self._set_status(job, JobStatus.RUNNING))  # while the run is laid out
                keeping: asyncio.Future[None] | None = None  # a durable job's run spec, stored before it starts
                try:
                    started = job.run_began = time.monotonic()  # a cold job's time limit includes its sandbox's start
                    await placement.ready()
                    stages.mark("sandbox-ready")
                    job.sandbox_id = sandbox.sandbox_id
                    keeping = asyncio.ensure_future(keep_spec(self._store, admitted, sandbox.hash_seed))
                    engine = self._engine(job)
                    stubs = placement.stubs(engine.stubs(manifest, job.language))
                    await self._lay_out(sandbox, job.script(request), stubs, job.language, broker)
                finally:
                    await saving  # saved running before the script starts (a failed save ends the run, as before)
                    stages.mark("saved-running")
                    if keeping is not None:
                        await keeping
                if request.files:  # before the script: written as the sandbox user, no symlink followed
                    await sandbox.put_files([(item.path, item.data()) for item in request.files])
                caps = self._settings.max_output_files, self._settings.max_output_files_bytes
                job.output_files = OutputFiles(job.output_dir, *caps, job.output_budget)
                sending = time.perf_counter_ns()
                run = await sandbox.run(job.id, request.env, job.sink, job.output_files)
                stages.mark("run-sent")
                self._events.publish(SandboxStarted(job, time.monotonic() - begin))
                telemetry.interval(
                    job.span, "sandbox start", begin_at, now(), **{"ptc.sandbox.start": placement.mode or ""}
                )
                exit_status, ended_by = await self._supervise(job, run, started, broker)
                stages.exit_seen(exit_status.stamps, sending)
                if not job.parking:
                    self._finish(job, exit_status, ended_by, broker)
            finally:
                await placement.leave(broker)
        except BaseException as exc:
            if not (job.parking and isinstance(exc, asyncio.CancelledError)):  # a parked job has not ended
                end_by_failure(job, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            await asyncio.shield(self._cleanup(admitted, broker, placement))

    def _engine(self, job: LiveJob) -> Engine:
        """The job's engine (chosen at its admission, kept by name)."""
        return self._sandboxes.engines[job.engine]

    async def _enter(self, job: LiveJob, placement: Placement) -> Sandbox | None:
        """The job's sandbox from ``placement`` (None: the job ended first). A job that has it within
        ``QUEUED_SAVE_GRACE_S`` is saved first as ``running`` (one save fewer); one that waits longer (its session's
        turn, a slot, room) is saved ``queued`` meanwhile. Either way its first save precedes its answer."""
        entering = asyncio.ensure_future(placement.enter())
        try:
            done, _ = await asyncio.wait({entering}, timeout=QUEUED_SAVE_GRACE_S)
            if not done:
                await self._save_and_tell(job)
                stages.mark("saved-queued")
            return await entering
        finally:
            if not entering.done():
                entering.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await entering

    @staticmethod
    async def _lay_out(sandbox: Sandbox, script: str, stubs: str | None, language: str, broker: Broker) -> None:
        """Give the sandbox the run's script (in ``language``) and stubs, then connect its calls to the job's broker
        (the container engine: the broker listens on ``tools.sock`` in the sandbox's folder)."""
        await sandbox.lay_out(script, stubs, language)
        stages.mark("run-files-written")
        await sandbox.connect(broker)
        stages.mark("broker-listening")

    def _new_broker(
        self,
        job: LiveJob,
        manifest: CompiledManifest,
        replay: list[Logged],
        carried: Mapping[str, tuple[str, datetime]] | None = None,
    ) -> Broker:
        """The job's broker (not listening yet); its records are the job's call records. A durable job's logs its
        calls in the store (``service.broker.durable``), a resumed one's answers them from ``replay`` first
        (``carried``: the calls a parked job waited for, unanswered: ``PausedCalls``)."""
        hooks = BrokerHooks(
            trace_parent=job.span,
            lease=self._replicas.holds_lease,
            on_call_end=lambda record: self._call_ended(job, record),
            on_paused_calls=lambda waiting: self._statuses.calls_changed(job, waiting),
            on_diverged=lambda message: stop_diverged(job, message),
        )
        durable = call_log(self._store, job, replay, self._settings.max_call_log_bytes)
        broker = Broker(
            manifest.tools,
            self._brokers,
            BrokerConfig.from_settings(self._settings, check_group=job.owner),
            budget=job.output_budget,  # the records count against the owner's output_bytes quota
            hooks=hooks,
            durable=durable,
            carried=carried,
        )
        job.calls = broker.records.calls
        job.broker = broker
        return broker

    async def save(self, job: LiveJob, final: bool = False) -> None:
        """Save the job's view (encoded a batch of records at a time, fenced: ``Replicas.save``); ``final``: also
        keep it for reading and count what it keeps in the store against its owner (``note_stored_bytes``).
        Raises what the store raises (a failed first save ends the run), LeaseLost."""
        view = job.view_dict()
        records = snapshot(view["calls"])
        async with job.saving:  # encoding gives the loop back: a later save must not overtake an earlier one
            try:
                pending = view["pending_calls"] if job.parked_at is not None else None  # what an answer resumes
                encoded = await render.encode(render_head(view), records, pending=pending)
            except (ValueError, TypeError):  # a view that cannot be encoded must still be saved: keep what can be
                log.exception("job %s: its view cannot be encoded; saving it without output and calls", job.id)
                view.update(render.unencodable(view))
                records = []
                encoded = await render.encode(render_head(view), records)
            row = stored_job(encoded.head, len(records), encoded.body, self._instance)
            if final:  # first: this replica serves the end even while the store refuses it (saved again later)
                self._final_views.put(job.id, encoded)
                await note_stored_bytes(job, row)  # before the row is saved: from then on it may be purged
            await self._replicas.save(row)

    async def _set_status(self, job: LiveJob, status: JobStatus) -> None:
        job.move(status)
        job.notify()
        await self._save_and_tell(job)

    async def _save_and_tell(self, job: LiveJob) -> None:
        """Save the job's status, then tell subscribers (``StatusChanged``); raises what the store raises."""
        await self.save(job)
        job.stored.set()
        self._events.publish(StatusChanged(job))

    async def _supervise(
        self, job: LiveJob, run: EngineRun, started: float, broker: Broker
    ) -> tuple[ExitStatus, EndedBy | None]:
        """Wait for the script to exit, its time limit (less what the job's earlier runs took), a stop request, or
        the moment to park it (``_park_due``: then ``job.parking`` is set and the script killed); returns (exit,
        what the service asked).

        The first of the time limit and a stop that is decided wins (a stop during the SIGTERM grace does not
        become a timeout, nor a stop after the timeout's SIGKILL a stop); whether it ended the script is for
        ``model.end_of_run`` to say from the exit the runtime reports.
        """
        waiting = asyncio.ensure_future(run.wait())
        stop = asyncio.ensure_future(job.stop_requested.wait())
        watch: set[asyncio.Future[Any]] = {stop}
        if job.durable and job.session_id is None and self._settings.park_after_s > 0:
            watch.add(asyncio.ensure_future(park_due(job, broker, self._settings.park_after_s, self._parked)))
        try:
            remaining = max(job.limits.timeout_s - job.active_s - (time.monotonic() - started), 0)
            done, _ = await asyncio.wait({waiting, *watch}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            ended_by: EndedBy | None = None
            job.parking = waiting not in done and bool(done) and stop not in done  # park_due's, or an exit or stop
            job.parked_calls = job.parked_calls if job.parking else []  # what it waits for: park_due took it
            if job.parking:  # parked: the job waits for the harness
                await run.kill()
            elif waiting not in done:
                if stop in done:
                    ended_by = "stopped"
                    await run.signal("SIGTERM")
                    grace_done, _ = await asyncio.wait({waiting}, timeout=self._settings.stop_grace_s)
                    if not grace_done:
                        await run.kill()
                else:
                    ended_by = "timed_out"
                    await run.kill()
            return await asyncio.wait_for(waiting, KILL_WAIT_S), ended_by
        finally:
            for watcher in watch:
                watcher.cancel()
            if not waiting.done():
                waiting.cancel()

    @staticmethod
    def _finish(job: LiveJob, exit_status: ExitStatus, ended_by: EndedBy | None, broker: Broker) -> None:
        """Set the job's final status, exit code and error from what ended the script (``model.end_of_run``)."""
        job.exit_code = code = exit_status.exit_code
        script_failure = verdict.failure(code, job.normalized, broker.records.script_report) if code != 0 else None
        status, error = end_of_run(
            exit_status,
            ended_by,
            timeout_s=job.limits.timeout_s,
            memory_mb=job.limits.memory_mb,
            stop_reason=job.stop_reason,
            script_failure=script_failure,
        )
        diverged = job.diverged or left_unmade(broker, ended_by)  # stopped for it, or it ended another way
        job.end(*((status, error) if diverged is None else (JobStatus.FAILED, diverged.as_dict())))

    def _call_ended(self, job: LiveJob, record: dict[str, Any]) -> None:
        """A tool call of ``job`` has its outcome: wake followers, tell subscribers."""
        job.notify()
        self._events.publish(CallEnded(job, record))

    async def _cleanup(self, admitted: Admitted, broker: Broker, placement: Placement) -> None:
        """Save the final view (or park the job: ``durability.park``), then tell waiters and subscribers, then give
        the sandbox back. Never raises. A one-shot sandbox is removed after the answer (it has exited, or was killed,
        and its output is all in), so a caller does not wait ~40 ms for the engine."""
        job, ticket = admitted.job, admitted.ticket
        try:
            if job.run_began is not None:  # its timeout_s counts each run's time, not the time it is parked
                job.active_s, job.run_began = job.active_time(), None
            if job.parking and not job.ended:  # what it waits for, before closing the broker cancels the waits
                job.parked_calls = waiting_for(broker, job.parked_calls)
            try:
                await broker.close()
            except Exception:
                log.exception("job %s: closing its broker failed", job.id)
            job.calls_over_limit = broker.records.calls_over_limit
            job.ran_as_coroutine = broker.records.ran_as_coroutine
            job.record_bytes = broker.records.kept_bytes  # counted with the rest of its row at the final save
            for output in (job.stdout, job.stderr):
                output.close()
            stages.mark("broker-closed")
            if not job.ended and job.parking:
                await park(admitted, self._store, self.save, self._events, self._parked)
                return
            job.ended_at = now()
            if not job.ended:
                job.end(JobStatus.LOST, job.error)
            if self._store.shares_output:  # before the final view: a reader of an ended job finds its output
                await keep_output(self._store, job, self._share_slots)
            try:
                await self.save(job, final=True)
                stages.mark("saved-final")
                await forget_run(self._store, job)
            except Exception:
                log.exception("job %s: could not save its final view; saving it again later", job.id)
                retry = partial(
                    save_final_again, self._store, self._replicas.save, self._final_views, job.id, self._instance
                )
                again = until_done(
                    lambda: retry(lambda: self.save(job, final=True)), f"job {job.id}: saving its final view"
                )
                self._tasks.spawn(again, f"final save {job.id}")  # meanwhile served from the view cache
        finally:
            if job.park_reserved:  # a place reserved, not taken by a park (it ended, its kill failed)
                job.park_reserved = False
                self._parked.release(job.owner)
            broker.records.release(keep_budget=job.ended)  # a parked job's resume takes them again
            job.broker = None  # its records are taken: no cycle (job, broker, its hooks, job) waits for the collector
            ticket.release()
            job.notify()
            job.done.set()
            self._live.remove(job.id)
            if job.ended:  # a parked job has not: it is resumed later
                self._events.publish(JobEnded(job))
            stages.mark("end-told")
            placement.dispose(job.status)
            telemetry.end_job(job.span, job.status.value, (job.error or {}).get("type"))

    # -- requests about a running job ----------------------------------------------------------

    async def stop(self, job: LiveJob, reason: str | None = None) -> None:
        """Ask the job to stop (SIGTERM, SIGKILL after the grace) and wait for its end, at most the grace and
        the SIGKILL's confirmation; ``reason`` is given in its error when not a caller's request."""
        if reason is not None:
            job.stop_reason = reason
        job.stop_requested.set()
        with contextlib.suppress(TimeoutError):
            confirm_s = self._engine(job).kill_confirm_s
            await asyncio.wait_for(job.done.wait(), self._settings.stop_grace_s + confirm_s + 1)
