"""Sessions as the job service offers them: creating one (limits, runtime, manifest, quotas, room on the host),
reading and ending them, and stopping a session's running script when it ends.

The sessions resource itself (owners, expiry, the resident sandbox) is ``service.sessions.manager``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any

from service.engines import Sandbox
from service.errors import (
    Draining,
    FileRefused,
    InvalidField,
    LeaseLost,
    QueueFull,
    RequestLimitError,
    SessionClosed,
    SessionNotFound,
    StoreUnavailable,
)
from service.jobs.admission import find_session
from service.jobs.live import SANDBOX_LIMITS, LiveJobs, resolve_limits
from service.jobs.placement import Sandboxes
from service.jobs.runner import Runner
from service.output import OutputRange
from service.replicas.notify import Elsewhere
from service.replicas.registration import Replicas
from service.sandbox.images import image_name
from service.schemas.job_models import ExecuteRequest
from service.schemas.session_models import SessionRequest, SessionView
from service.sessions.manager import Session
from service.settings import Settings
from service.store import StoredSession
from service.tenancy import Caller
from service.toolsets import Toolsets

log = logging.getLogger(__name__)


class SessionJobs:
    """Session requests of the job service.

    Args:
        settings: session limits and lifetimes, the sandbox image and runtimes.
        sandboxes: the engines (a session's sandbox and its room on the host: ``Engine.hold_room``,
            ``Engine.open_session``), the owners' quotas (``admission``) and the sessions resource (``sessions``).
        toolsets: a session's manifest is checked when it is created.
        runner: stops a session's running script when the session ends.
        live: the live jobs (job id -> job).
        replicas: saves each session in the store at its creation and at its end (fenced); None: not saved.
        elsewhere: with a shared store, sessions of other replicas: a request for one is relayed
            (``OwnerElsewhere``), ``GET /sessions`` lists them from the store.
    """

    def __init__(
        self,
        settings: Settings,
        sandboxes: Sandboxes,
        toolsets: Toolsets,
        runner: Runner,
        live: LiveJobs,
        replicas: Replicas | None = None,
        elsewhere: Elsewhere | None = None,
    ) -> None:
        self._replicas = replicas
        self._elsewhere = elsewhere
        self._settings = settings
        self._sessions = sandboxes.sessions
        self._sandboxes = sandboxes
        self._admission = sandboxes.admission
        self._toolsets = toolsets
        self._runner = runner
        self._live = live
        self.draining: int | None = None  # the service is shutting down: new sessions get 503 with this Retry-After

    async def create_session(self, request: SessionRequest, owner: str, *, admin: bool = False) -> dict[str, Any]:
        """Start a session's sandbox, owned by ``owner``, and return its view.

        Its ``toolset`` must be ``owner``'s own, unless ``admin``.

        The session counts against its owner's session quotas and commits its memory and CPUs on the host
        (idle pooled sandboxes give up their room for it) until it ends.

        Raises:
            RequestLimitError / InvalidField: a limit past its maximum, an unknown runtime or toolset, a bad
                manifest (checked now, not at the first script); UnknownImage: an image PTC_IMAGES does not name.
            TooManySessions: ``max_sessions`` are open.
            QuotaExceeded: the owner is at a session quota, or the host has no room (``host_memory_mb``,
                ``host_cpus``).
            SandboxError: the image is not present or cannot run sessions (``Images.require``), or the sandbox
                could not start.
            Draining: the service is shutting down (``JobManager.drain``).
        """
        if self.draining is not None:
            raise Draining(self.draining)
        settings = self._settings
        image = image_name(settings, request.image, request.language)
        limits = resolve_limits(ExecuteRequest(script="", limits=request.limits, image=image), settings)
        lifetimes = {}
        for name, value, default in (
            ("idle_timeout_s", request.idle_timeout_s, settings.session_idle_timeout_s),
            ("max_lifetime_s", request.max_lifetime_s, settings.session_max_lifetime_s),
        ):
            if value is not None and value > settings.max_session_lifetime_s:
                raise RequestLimitError(
                    f"{value} exceeds the server maximum of {settings.max_session_lifetime_s}", ("body", name)
                )
            lifetimes[name] = value if value is not None else default
        runtime = request.runtime or settings.runtime
        if runtime is not None and runtime != settings.runtime and runtime not in settings.session_runtimes:
            raise InvalidField(
                f"runtime {runtime!r} is not offered; ask for one of {sorted(settings.session_runtimes)}",
                ("body", "runtime"),
            )
        await self._toolsets.manifest(request.tools, request.toolset, Caller(owner, admin))  # a bad manifest fails now
        engine = self._sandboxes.engines.choose(request.language)
        language = request.language or engine.language
        await engine.require_image(image, language)
        runtime = None if runtime == "runc" else runtime
        memory_mb, cpus = limits.memory_mb, limits.cpus
        self._admission.quotas.admit_session(owner, memory_mb, cpus)  # from here to the commitment: no await
        try:
            commitment = engine.hold_room(limits)  # QuotaExceeded: no room on the host
            try:

                def open_sandbox(session_id: str) -> Awaitable[Sandbox]:
                    return engine.open_session(session_id, limits, request.env, image, runtime, commitment)

                session = await self._sessions.create(
                    open_sandbox,
                    engine=engine.name,
                    runtime=runtime,
                    limits={name: getattr(limits, name) for name in (*SANDBOX_LIMITS, "output_bytes")},
                    env=request.env,
                    tools=request.tools,
                    toolset=request.toolset,
                    metadata=request.metadata,
                    owner=owner,
                    image=image,
                    language=language,
                    **lifetimes,
                )
            except BaseException:
                if commitment is not None:
                    commitment.release()
                raise
        except BaseException:
            self._admission.quotas.session_ended(owner, memory_mb, cpus)
            raise
        log.info("session %s started in sandbox %s (image %s)", session.id, session.view()["sandbox_id"], image)
        if request.files:
            try:
                async with session.turn:
                    await session.sandbox.put_files([(item.path, item.data()) for item in request.files])
            except BaseException:  # the session is of no use without its files: it ends, nothing is left
                await self._sessions.end(session, "closed", None)
                raise
        await self._save(session)
        return session.view()

    async def _save(self, session: Session) -> None:
        """Save the session's row (at its creation and at its end); a store that does not answer, or a fenced
        save, is logged: the session itself goes on (or ends) here either way."""
        if self._replicas is None:
            return
        view = session.view()
        incarnation = self._replicas.incarnation
        stored = StoredSession(
            session.id,
            session.owner,
            incarnation.instance_id,
            incarnation.epoch,
            str(view["status"]),
            session.created_at,
            session.ended_at,
            session.created_at + timedelta(seconds=session.max_lifetime_s),
            SessionView.model_validate(view).model_dump_json().encode(),
        )
        try:
            await self._replicas.save_session(stored)
        except (StoreUnavailable, LeaseLost) as exc:
            log.warning("session %s not saved in the store: %s", session.id, exc)

    async def _stored(self, session_id: str, caller: Caller) -> StoredSession | None:
        """The store's row of a session that is not in this replica's memory, if ``caller`` may access it (with a
        shared store only: on SQLite every session is this replica's)."""
        if self._elsewhere is None or self._replicas is None or not self._elsewhere.shared:
            return None
        stored = await self._elsewhere.store.sessions.get(session_id)
        if stored is None or not caller.may_access(stored.owner):
            return None
        return stored

    async def locate(self, session_id: str, caller: Caller) -> Session:
        """The caller's session held here (live or recently ended).

        Raises:
            SessionNotFound: no such session (another owner's too), or one this replica no longer holds.
            OwnerElsewhere: it is open on another live replica (the request is relayed there).
            OwnerUnavailable: it is open on a replica whose lease passed, or the request came relayed already.
        """
        try:
            return find_session(self._sessions, session_id, caller)
        except SessionNotFound:
            stored = await self._stored(session_id, caller)
            if stored is not None and stored.ended_at is None and self._elsewhere is not None:
                assert self._replicas is not None
                if not self._replicas.owner_here(stored.instance_id, stored.instance_epoch):
                    raise self._elsewhere.owner(
                        session_id, stored.instance_id, stored.instance_epoch, caller, "session"
                    ) from None
            raise

    async def locate_open(self, session_id: str, caller: Caller) -> Session:
        """As ``locate``, for a request that runs something in the session (``POST /execute``): one that another
        replica held and that ended (broken with its replica, say) raises SessionClosed, as a session ended here
        does, instead of SessionNotFound."""
        try:
            return await self.locate(session_id, caller)
        except SessionNotFound:
            stored = await self._stored(session_id, caller)
            if stored is None or stored.ended_at is None:
                raise
            error = json.loads(stored.view).get("error") or {}
            raise SessionClosed(session_id, stored.status, str(error.get("message", ""))) from None

    async def _file_turn(self, session_id: str, caller: Caller) -> Session:
        """The caller's open session (SessionNotFound for another owner's, SessionClosed once ended)."""
        session = await self.locate(session_id, caller)
        if session.ended:
            raise SessionClosed(session_id, session.status, (session.error or {}).get("message", ""))
        return session

    async def put_file(self, session_id: str, caller: Caller, path: str, data: bytes) -> dict[str, Any]:
        """Write ``data`` to ``path`` (checked) under the session's /tmp, at the session's turn (after the scripts
        running or queued); returns {path, bytes, sha256}.

        The bodies of the PUTs waiting for a session's turn are held in the service's memory while its scripts run
        (up to ``max_timeout_s`` each): together they hold at most ``max_files_bytes`` per session, past it
        QueueFull (429), as a request's ``files`` do; else one key could park ``max_files_bytes`` per concurrent
        request for minutes.

        Raises:
            SessionNotFound, SessionClosed: as every session route.
            QueueFull: the PUTs waiting for the session's turn hold ``max_files_bytes`` already.
            FileRefused: the sandbox could not write it (no_space, not_a_file: a symlink or folder in the way).
            SandboxError: the sandbox is gone.
        """
        session = await self._file_turn(session_id, caller)
        if session.put_bytes_waiting + len(data) > self._settings.max_files_bytes:
            raise QueueFull(self._settings.retry_after_s)
        session.put_bytes_waiting += len(data)
        data_waiting = True
        try:
            async with session.turn:
                session.put_bytes_waiting -= len(data)
                data_waiting = False
                if session.ended:
                    raise SessionClosed(session_id, session.status, (session.error or {}).get("message", ""))
                try:
                    await session.sandbox.put_files([(path, data)])
                except FileRefused as exc:  # the file of the URL's path: no index of a body's files to name
                    raise FileRefused(exc.code, str(exc)) from None
                session.last_used_at = datetime.now(UTC)
        finally:
            if data_waiting:
                session.put_bytes_waiting -= len(data)
        return {"path": path, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    async def get_file(self, session_id: str, caller: Caller, path: str) -> OutputRange:
        """The regular file ``path`` (checked) under the session's /tmp, read at the session's turn into a spool
        file on the work dir's disk (unlinked from the start: nothing is left behind), a frame at a time; returned
        as a range to send a slice at a time (``api.responses.output_slices``), so neither the read nor a slow
        client holds the file in memory. The caller closes the range.

        Raises:
            SessionNotFound, SessionClosed: as every session route.
            NoSuchFile: nothing there. FileRefused: not a regular file (a symlink: never followed), or past
                ``max_output_files_bytes`` (``too_large``).
            SandboxError: the sandbox is gone.
        """
        session = await self._file_turn(session_id, caller)
        spool = await asyncio.to_thread(lambda: tempfile.TemporaryFile("w+b", dir=self._settings.work_dir))
        try:
            async with session.turn:
                if session.ended:
                    raise SessionClosed(session_id, session.status, (session.error or {}).get("message", ""))
                size = await session.sandbox.get_file_into(path, self._settings.max_output_files_bytes, spool)
                session.last_used_at = datetime.now(UTC)
            await asyncio.to_thread(spool.flush)
            return OutputRange(os.dup(spool.fileno()), 0, size)
        finally:
            await asyncio.to_thread(spool.close)

    async def list_files(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """{files: [{path, bytes, skipped}], truncated}: what is under the session's /tmp (at most
        ``max_files_listed`` entries), at the session's turn. Raises as ``get_file``."""
        session = await self._file_turn(session_id, caller)
        async with session.turn:
            if session.ended:
                raise SessionClosed(session_id, session.status, (session.error or {}).get("message", ""))
            entries, truncated = await session.sandbox.list_files(self._settings.max_files_listed)
        return {"files": entries, "truncated": truncated}

    async def session_view(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """A session's view: held here, or an ended one's as the store kept it; raises SessionNotFound (for
        another owner's session too), OwnerElsewhere (open on another replica: relayed)."""
        try:
            return (await self.locate(session_id, caller)).view()
        except SessionNotFound:
            stored = await self._stored(session_id, caller)
            if stored is None or stored.ended_at is None:
                raise
            view: dict[str, Any] = json.loads(stored.view)
            return view

    async def sessions(self, caller: Caller) -> list[dict[str, Any]]:
        """Views of the open sessions ``caller`` may access (the admin role: all), oldest first: those held here,
        and with a shared store those of other replicas as last saved (``status``, ``executions``,
        ``last_used_at`` may lag)."""
        here = [s.view() for s in self._sessions.live_sessions() if caller.may_access(s.owner)]
        if self._elsewhere is None or not self._elsewhere.shared:
            return here
        held = {view["session_id"] for view in here}
        stored = await self._elsewhere.store.sessions.unended(caller.only_owner)
        others = [json.loads(row.view) for row in stored if row.session_id not in held]
        return sorted([*here, *others], key=lambda view: str(SessionView.model_validate(view).created_at))

    async def delete_session(self, session_id: str, caller: Caller) -> dict[str, Any]:
        """End a session: its running script is stopped, its queued ones end ``stopped``, its sandbox is removed.

        Idempotent: an ended session's view is returned as it is. Raises SessionNotFound (another owner's too),
        OwnerElsewhere (open on another replica: relayed).
        """
        try:
            session = await self.locate(session_id, caller)
        except SessionNotFound:
            return await self.session_view(session_id, caller)  # ended, as the store kept it
        await self._sessions.end(session, "closed", None)
        return session.view()

    async def end_session_jobs(self, session: Session) -> None:
        """Before a session's sandbox goes: stop the script running in it (queued ones see the session ended).

        Its owner's session quotas are given back here (its host capacity when its sandbox is removed).
        """
        self._admission.quotas.session_ended(session.owner, session.limits["memory_mb"], session.limits["cpus"])
        await self._save(session)
        job = self._live.get(session.current_job_id or "")
        if job is None:
            return
        reason = (session.error or {}).get("message") or "deleted"
        await self._runner.stop(job, f"the session ended ({session.status}: {reason})")
