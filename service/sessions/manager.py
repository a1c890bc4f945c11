"""Sessions: one sandbox kept for a conversation, running its scripts one at a time.

A session's sandbox is its engine's (``service.engines``: ``Engine.open_session``); for the container engine a
resident sandbox (``service.sandbox.resident``): a resident interpreter, with the stub library imported, that forks
one process per script, its folder (``work_dir/run/sessions/<session_id>``) mounted read-only at ``/run/ptc`` with
each run's ``script.py``, ``tools`` package and broker socket there (the one-shot layout). Files under the working
directory (``/tmp``) persist from one script to the next; processes do not. Each script is a job of its own (own
output, call records, time limit and view), run in the order it arrived.

A session ends when it is deleted, idle past ``idle_timeout_s``, older than
``max_lifetime_s`` (``expired``), or when its sandbox cannot go on
(``broken``, with the reason); its sandbox is then removed. Sessions live in
this process's memory: a restart of the service ends them (the start-up
sweep removes their sandboxes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from service.engines import CONTAINER, PYTHON, Sandbox
from service.errors import InvalidField, SessionClosed, SessionNotFound, TooManySessions

log = logging.getLogger(__name__)

ENDED_KEPT = 1000
EXPIRY_TICK_S = 1.0


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Session:
    """One session: its settings, sandbox, turn lock and counters."""

    id: str
    sandbox: Sandbox
    limits: dict[str, Any]
    runtime: str | None
    env: dict[str, str]
    tools: list[dict[str, Any]]
    toolset: str | None
    idle_timeout_s: float
    max_lifetime_s: float
    metadata: dict[str, Any]
    owner: str  # the API key name that created it (auth.IMPLICIT_OWNER with authentication disabled)
    created_at: datetime = field(default_factory=_now)
    last_used_at: datetime = field(default_factory=_now)
    ended_at: datetime | None = None
    status: str = "ready"  # ready | busy | closed | expired | broken
    error: dict[str, Any] | None = None
    executions: int = 0
    queued: int = 0
    current_job_id: str | None = None
    image: str = "default"  # the name (in PTC_IMAGES) of its sandbox's image; its scripts run in it
    engine: str = CONTAINER  # the script engine of its sandbox; its scripts run on it
    language: str = PYTHON  # the language of its scripts
    stub_source: str | None = None  # the tools package now in the folder
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    put_bytes_waiting: int = 0  # bytes of PUT bodies waiting for the turn, held in the service's memory

    @property
    def ended(self) -> bool:
        """Whether the session can run no more scripts."""
        return self.status in ("closed", "expired", "broken")

    def expires_at(self) -> datetime:
        """When the session ends if nothing else happens (idle deadline or end of life, whichever is first)."""
        end_of_life = self.created_at + timedelta(seconds=self.max_lifetime_s)
        idle = self.last_used_at + timedelta(seconds=self.idle_timeout_s)
        return end_of_life if self.busy() else min(end_of_life, idle)

    def busy(self) -> bool:
        """A script runs or waits for its turn."""
        return self.current_job_id is not None or self.queued > 0

    def script_image(self, image: str | None, language: str | None) -> str:
        """The image of a script sent to the session with ``image`` and ``language`` (each absent, or the
        session's): the session's. Raises InvalidField (``body.language``, ``body.image``) for another."""
        if language is not None and language != self.language:
            raise InvalidField(
                f"a session's scripts are all in its language: {self.language}, not {language}", ("body", "language")
            )
        if image is not None and image != self.image:
            raise InvalidField(
                f"a session's scripts run in its sandbox: its image is {self.image!r}, not {image!r}", ("body", "image")
            )
        return self.image

    def view(self) -> dict[str, Any]:
        """The session view (see ``schemas.SessionView``)."""
        return {
            "session_id": self.id,
            "status": self.status if self.ended else ("busy" if self.busy() else "ready"),
            "error": self.error,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "ended_at": self.ended_at,
            "expires_at": None if self.ended else self.expires_at(),
            "idle_timeout_s": self.idle_timeout_s,
            "max_lifetime_s": self.max_lifetime_s,
            "limits": self.limits,
            "runtime": self.runtime,
            "image": self.image,
            "language": self.language,
            "executions": self.executions,
            "queued": self.queued,
            "current_job_id": self.current_job_id,
            "sandbox_id": self.sandbox.sandbox_id,
            "metadata": self.metadata,
            "owner": self.owner,
        }


class SessionManager:
    """Creates, finds, expires and deletes sessions.

    Args:
        max_sessions: live sessions allowed at once.
        before_end: awaited when a session ends, after it is marked ended and before its sandbox is removed
            (the job manager stops its running script there).
        on_count: called with the number of live sessions whenever it changes (for the ``ptc_sessions`` gauge).
    """

    def __init__(
        self,
        max_sessions: int,
        before_end: Callable[[Session], Awaitable[None]],
        on_count: Callable[[int], None] = lambda _n: None,
    ) -> None:
        self._before_end = before_end
        self._max = max_sessions
        self._on_count = on_count
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()
        self._starting = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start expiring sessions."""
        self._task = asyncio.create_task(self._expire_loop(), name="session expiry")

    async def close(self) -> None:
        """End every session (its running script is stopped by its job's own shutdown) and stop expiring."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(self.end(s, "closed", None) for s in list(self._live.values())), return_exceptions=True)

    async def create(
        self,
        open_sandbox: Callable[[str], Awaitable[Sandbox]],
        *,
        engine: str,
        runtime: str | None,
        limits: dict[str, Any],
        env: dict[str, str],
        tools: list[dict[str, Any]],
        toolset: str | None,
        idle_timeout_s: float,
        max_lifetime_s: float,
        metadata: dict[str, Any],
        owner: str,
        image: str = "default",
        language: str = PYTHON,
    ) -> Session:
        """Start a session's sandbox (``open_sandbox(session_id)``: ``engine``'s, ``Engine.open_session``);
        ``owner`` owns it; ``image`` is the name (in PTC_IMAGES) of its image, ``runtime`` its OCI runtime (None:
        the default) and ``language`` its scripts', for its view and its scripts.

        Raises:
            TooManySessions: ``max_sessions`` are live (or starting) already.
            SandboxError: the sandbox could not start.
        """
        if len(self._live) + self._starting >= self._max:
            raise TooManySessions(self._max)
        self._starting += 1
        try:
            session_id = "ses_" + secrets.token_hex(12)
            sandbox = await open_sandbox(session_id)
        finally:
            self._starting -= 1
        session = Session(
            id=session_id,
            sandbox=sandbox,
            limits=limits,
            runtime=runtime,
            env=env,
            tools=tools,
            toolset=toolset,
            idle_timeout_s=idle_timeout_s,
            max_lifetime_s=max_lifetime_s,
            metadata=metadata,
            owner=owner,
            image=image,
            engine=engine,
            language=language,
        )
        self._live[session_id] = session
        self._on_count(len(self._live))
        return session

    def get(self, session_id: str) -> Session:
        """A live or recently ended session; raises SessionNotFound."""
        session = self._live.get(session_id) or self._ended.get(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def usable(self, session_id: str) -> Session:
        """A live session that can take a script; raises SessionNotFound or SessionClosed."""
        session = self.get(session_id)
        if session.ended:
            raise SessionClosed(session_id, session.status, (session.error or {}).get("message", ""))
        return session

    async def end(self, session: Session, status: str, reason: str | None) -> None:
        """End ``session`` (``closed``, ``expired`` or ``broken``) and remove its sandbox; idempotent."""
        if session.ended:
            return
        session.status = status
        session.ended_at = _now()
        if reason is not None:
            session.error = {"type": f"session_{status}", "message": reason}
        self._live.pop(session.id, None)
        session.tools, session.env, session.stub_source = [], {}, None  # an ended session keeps only its view
        session.sandbox.forget_env()
        self._ended[session.id] = session
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        self._on_count(len(self._live))
        try:
            await self._before_end(session)
        finally:
            await session.sandbox.destroy()

    @property
    def count(self) -> int:
        """Live sessions."""
        return len(self._live)

    @property
    def queued(self) -> int:
        """Scripts waiting for their turn, in all sessions."""
        return sum(session.queued for session in self._live.values())

    def live_sessions(self) -> list[Session]:
        """Live sessions, oldest first."""
        return sorted(self._live.values(), key=lambda s: s.created_at)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            now = _now()
            for session in list(self._live.values()):
                try:
                    if session.sandbox.broken is not None and not session.busy():  # died while idle
                        await self.end(session, "broken", session.sandbox.broken)
                    elif now >= session.created_at + timedelta(seconds=session.max_lifetime_s):
                        await self.end(session, "expired", f"reached its max_lifetime_s of {session.max_lifetime_s:g}")
                    elif not session.busy() and now >= session.last_used_at + timedelta(seconds=session.idle_timeout_s):
                        await self.end(session, "expired", f"idle for its idle_timeout_s of {session.idle_timeout_s:g}")
                except Exception:
                    log.exception("session %s: could not expire it", session.id)
