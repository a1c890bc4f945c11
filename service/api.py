"""HTTP API: the app factory, its routes, and the one place errors become RFC 9457 problem+json."""

from __future__ import annotations

import asyncio
import email.message
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BeforeValidator
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import __version__, callbacks, exactjson
from service.auth import BearerAuth, Caller, caller, configure, may_scrape, open_paths
from service.collector import gc_paused
from service.egress import EgressPolicy, OwnAddress
from service.errors import (
    CallNotPending,
    EngineUnavailable,
    InvalidField,
    JobNotFound,
    ManifestError,
    PayloadTooLarge,
    QueueFull,
    QuotaExceeded,
    RequestLimitError,
    SandboxError,
    SessionClosed,
    SessionNotFound,
    TooManySessions,
)
from service.jobs import JobManager
from service.jobs.live import wait_for_end_or_client
from service.limits import check_execute, check_manifest_request, check_session
from service.metrics import CONTENT_TYPE, HttpObserver, Metrics
from service.openapi import document
from service.output import OutputRange
from service.sandbox.base import SandboxBackend, Stream
from service.schemas import (
    ClientAnswer,
    ExecuteRequest,
    JobList,
    JobStatus,
    JobView,
    ManifestRequest,
    SessionList,
    SessionRequest,
    SessionView,
    StubsView,
    ToolsetView,
)
from service.settings import Settings
from service.store import InvalidCursor, JobQuery, JobStore, SQLiteJobStore
from service.toolkit.endpoints import EndpointClients
from service.toolkit.stubs import USAGE
from service.toolkit.validation import CheckScheduler
from service.views import BATCH_BYTES, Body

log = logging.getLogger(__name__)

DRAIN_BYTES = 64 * 1024 * 1024
OUTPUT_SLICE_BYTES = 256 * 1024  # GET /jobs/{id}/output/{stream} reads and sends the range this much at a time
PROBLEM = "application/problem+json"
MAX_BODY_DEPTH = 254  # JSON nesting levels (arrays and objects) of a request body: what orjson writes; deeper: 422
BODY_THREADS = 2  # threads that parse and validate request bodies, shared by all keys, round-robin between them


_SSE_EVENT = {  # one event of GET /jobs/{id}/events; data is JSON text
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["status", "stdout", "stderr", "call", "end"]},
        "data": {"type": "string"},
    },
    "required": ["data"],
}


def problem(status: int, title: str, detail: str, type_: str = "about:blank", **extra: Any) -> JSONResponse:
    """An RFC 9457 problem+json response."""
    body = {"type": type_, "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(jsonable_encoder(body), status_code=status, media_type=PROBLEM)


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413 before reading them all."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._drain(receive)
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._drain(receive)
            await self._refuse(scope, receive, send)

    async def _drain(self, receive: Receive) -> None:
        """Read (and drop) the rest of the body, up to DRAIN_BYTES, so the client sees the 413, not a reset."""
        drained = 0
        while drained < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(413, "Request body too large", f"the body exceeds {self.limit} bytes")
        await response(scope, receive, send)


def view_response(body: Body, status_code: int = 200) -> Response:
    """A job view as ``application/json``, sent in slices of ``BATCH_BYTES`` (with flow control, so a slow
    client holds no copy of the view): whole bytes with their length, or pieces as they are rendered."""
    if isinstance(body, bytes):
        return StreamingResponse(
            _slices(body),
            status_code=status_code,
            media_type="application/json",
            headers={"content-length": str(len(body))},
        )
    return StreamingResponse(body, status_code=status_code, media_type="application/json")


async def _slices(body: bytes) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(body), BATCH_BYTES):
        yield bytes(view[start : start + BATCH_BYTES])


async def _output_slices(retained: OutputRange) -> AsyncIterator[bytes]:
    """The bytes of ``retained``, ``OUTPUT_SLICE_BYTES`` at a time, each read in a thread when the previous one
    was sent (uvicorn's flow control: a client that does not read holds at most about one slice here)."""
    try:
        while retained.remaining > 0:
            yield await asyncio.to_thread(retained.read, OUTPUT_SLICE_BYTES)
    finally:
        # in a thread (it waits for a read under way), not awaited: a cancelled response may not await here
        try:
            asyncio.get_running_loop().run_in_executor(None, retained.close)
        except RuntimeError:  # no running loop (finalized at shutdown): nothing can be reading any more
            retained.close()


def _json_content(content_type: str | None) -> bool:
    """Whether FastAPI would read a body of this ``Content-Type`` as JSON (``application/json`` or ``*+json``)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


_TOO_DEEP = {"type": "too_deep", "loc": ("body",), "msg": f"nested deeper than {MAX_BODY_DEPTH} levels"}


def parse_body(raw: bytes, validate: Callable[[Any], tuple[Any, list[Any]]]) -> Any:
    """A request body parsed (orjson; the stdlib for what only it reads exactly: integers past 64 bits, lone
    surrogates) and validated.

    Runs on a worker thread: parsing and validating 8 MiB of nested JSON takes seconds of CPU.

    Args:
        raw: the body's bytes (at most ``PTC_MAX_BODY_BYTES``, ``BodyLimit``).
        validate: the route's body field's ``validate(value) -> (value, errors)``.

    Returns:
        The validated body (for a model, its instance: FastAPI's own validation then keeps it as it is).

    Raises:
        RequestValidationError: not JSON, nested deeper than ``MAX_BODY_DEPTH``, or invalid; each error has
            ``type``, ``loc`` and ``msg`` only (never the offending ``input``, which may be megabytes).
    """
    try:
        if exactjson.has_long_digits(raw):  # orjson would read an integer past 64 bits as a float
            raise orjson.JSONDecodeError("an integer may be past 64 bits", "", 0)
        with gc_paused():
            value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            with gc_paused():
                value = json.loads(raw)
        except json.JSONDecodeError as exc:
            error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": f"JSON decode error: {exc.msg}"}
            raise RequestValidationError([error]) from None
        except UnicodeDecodeError as exc:
            error = {"type": "json_invalid", "loc": ("body", exc.start), "msg": f"not UTF-8 text: {exc.reason}"}
            raise RequestValidationError([error]) from None
        except RecursionError:  # the stdlib's recursion limit; orjson's parser stops at 1,024 levels
            raise RequestValidationError([_TOO_DEEP]) from None
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH and _deeper_than(value):
        raise RequestValidationError([_TOO_DEEP])
    validated, errors = validate(value)
    if errors:
        refusal = RequestValidationError(
            [{"type": e.get("type", ""), "loc": tuple(e.get("loc", ())), "msg": e.get("msg", "")} for e in errors]
        )
        # The traceback keeps this frame: drop the parsed body (and the errors' "input") here, on this thread,
        # not on the event loop when the exception is handled there.
        del value, validated, errors
        raise refusal
    return validated


def _deeper_than(value: Any) -> bool:
    """Whether ``value`` nests deeper than ``MAX_BODY_DEPTH`` levels: orjson refuses to write it (checked in C)."""
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return True
    return False


class ParsedOffLoop(APIRoute):
    """A route whose JSON body is parsed and validated on a worker thread (``parse_body``), never on the loop.

    The threads are ``app.state.bodies`` (a ``CheckScheduler``): one body per request at a time, taken
    round-robin between API keys, so one key's stream of large bodies delays another key's by at most one.
    FastAPI then finds the parsed value cached on the request (``request._json``, Starlette's cache) and its
    own validation of a model instance returns it unchanged.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler

        def validate(value: Any) -> tuple[Any, list[Any]]:
            return field.validate(value, {}, loc=("body",))

        async def parse_first(request: Request) -> Response:
            if _json_content(request.headers.get("content-type")):
                raw = await request.body()
                if raw:
                    bodies: CheckScheduler = request.app.state.bodies
                    group = getattr(request.state, "key_name", None) or ""
                    request._json = await bodies.run(group, request, parse_body, raw, validate)
            return await handler(request)

        return parse_first


class _BodyTooLarge(BaseException):
    """Not an Exception: FastAPI turns any Exception raised while it reads a body into a 400."""


def build_jobs(
    settings: Settings, backend: SandboxBackend, endpoints: EndpointClients, store: JobStore, metrics: Metrics
) -> JobManager:
    """The job service and its parts (the composition of ``service.jobs``), with metrics, logs and webhooks
    subscribed to its lifecycle events. Nothing is started: ``JobManager.start`` does that.

    Raises:
        InsecureConfig: a malformed ``PTC_CALLBACK_SECRETS``.
    """
    from service import logs
    from service.broker import CallMemory
    from service.jobs import JobParts
    from service.jobs.admission import Admission, Intake
    from service.jobs.events import CallEnded, Events, JobEnded, JobLost, SandboxStarted, StatusChanged
    from service.jobs.live import LiveJob, resolve_limits
    from service.jobs.placement import LABEL_INSTANCE, LABEL_MANAGED, Sandboxes, sandbox_spec
    from service.jobs.recovery import Recovery
    from service.jobs.runner import Runner
    from service.jobs.sessions import SessionJobs
    from service.jobs.tasks import Tasks
    from service.jobs.views import JobViews
    from service.jobs.webhooks import Webhooks
    from service.pool import WarmPools
    from service.quotas import HostCapacity, Quotas, Slots
    from service.sandbox.folders import SandboxFolders
    from service.schemas import ExecuteRequest
    from service.sessions import Session, SessionManager
    from service.toolkit.cache import ManifestCache
    from service.toolsets import Toolsets, installation_salt
    from service.views import ByteBudget, ViewCache

    instance = settings.instance()
    instance_labels = {LABEL_MANAGED: "1", LABEL_INSTANCE: instance}
    capacity = HostCapacity.from_settings(settings)
    quotas = Quotas(settings, capacity)
    folders = SandboxFolders(settings.work_dir / "run", settings.sandbox_folders_tmpfs_mb)
    jobs_dir, output_dir = folders.path / "jobs", settings.work_dir / "output"
    defaults = resolve_limits(ExecuteRequest(script=""), settings)  # the default profile
    pool = WarmPools(
        backend,
        sandbox_spec(settings, defaults, {}, jobs_dir, instance_labels),
        folders.path / "pool",
        settings.warm_pool_size,
        settings.warm_pool_max_age_s,
        settings.warm_pool_max_profiles,
        capacity=capacity,
    )
    manifests = ManifestCache(
        installation_salt(settings.work_dir), threads=settings.manifest_threads, budget_s=settings.manifest_budget_s
    )
    checks = CheckScheduler(settings.validation_threads, settings.validation_budget_s)
    live: dict[str, LiveJob] = {}
    events, tasks, cache = Events(), Tasks(), ViewCache(settings.view_cache_bytes)
    session_jobs: SessionJobs | None = None

    async def before_end(session: Session) -> None:
        if session_jobs is not None:
            await session_jobs.end_session_jobs(session)

    sessions = SessionManager(
        backend, folders.path / "sessions", settings.max_sessions, before_end=before_end, on_count=metrics.set_sessions
    )
    admission = Admission(settings, quotas, Slots(settings.concurrency()), lambda: sessions.queued)
    sandboxes = Sandboxes(backend, pool, capacity, admission, sessions, jobs_dir, instance_labels, set())
    toolsets = Toolsets(store, manifests, endpoints, settings.max_tools)
    secrets = callbacks.load_secrets(settings)
    intake = Intake(settings, admission, toolsets, sessions, endpoints, secrets, output_dir, live)
    call_memory = CallMemory(settings.max_record_bytes_total, settings.max_call_bytes_in_flight_total)
    runner = Runner(settings, store, events, sandboxes, endpoints, call_memory, checks, live, cache, tasks, instance)
    views = JobViews(store, live, output_dir, cache, ByteBudget(settings.view_cache_bytes))
    session_jobs = SessionJobs(settings, sessions, sandboxes, admission, toolsets, runner, live)
    recovery = Recovery(settings, backend, store, folders, quotas, events, cache, instance_labels, instance)
    webhooks = Webhooks(settings, store, views, cache, secrets, endpoints.egress, metrics, tasks, instance)

    def sandbox_started(event: SandboxStarted) -> None:
        job = event.job
        metrics.sandbox_started(job.sandbox_start, event.seconds)
        logs.sandbox("sandbox_start", job.id, job.sandbox_id, event.seconds, mode=job.sandbox_start)

    def call_ended(event: CallEnded) -> None:
        metrics.tool_call(event.record)
        logs.tool_call(event.job.id, event.record)

    def job_ended(event: JobEnded) -> None:
        metrics.job_ended(event.job)
        logs.job(event.job)

    events.subscribe(StatusChanged, lambda event: logs.job(event.job))
    events.subscribe(CallEnded, call_ended)
    events.subscribe(SandboxStarted, sandbox_started)
    events.subscribe(JobEnded, job_ended)
    events.subscribe(JobEnded, webhooks.job_ended)
    events.subscribe(JobLost, lambda _: metrics.job_lost())
    metrics.track_jobs(live)
    metrics.track_pools(pool.sizes)
    parts = JobParts(
        intake, runner, views, toolsets, session_jobs, recovery, webhooks, tasks, sandboxes, sessions, pool, folders,
        manifests, checks,
    )  # fmt: skip
    return JobManager(parts)


def create_app(settings: Settings | None = None, backend: SandboxBackend | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: configuration; default: read from ``PTC_*`` environment variables.
        backend: sandbox backend; default: ``DockerBackend`` on ``settings.docker_host``.

    Raises:
        InsecureConfig: the authentication settings are unusable or unsafe (``auth.configure``).
    """
    settings = settings or Settings()
    keys = configure(settings)
    callbacks.load_secrets(settings)  # a malformed PTC_CALLBACK_SECRETS refuses the start now, not at the lifespan

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal backend
        if backend is None:
            from service.sandbox.docker import DockerBackend

            backend = DockerBackend(
                settings.docker_host, max_workers=4 * settings.concurrency() + 8, runtime=settings.runtime
            )
        endpoints = EndpointClients(
            settings.tool_timeout_s,
            settings.max_tool_result_bytes,
            EgressPolicy(settings.egress_allow, own=[OwnAddress.of(settings.host, settings.port)]),
        )
        store = SQLiteJobStore(settings.job_store_path())
        await store.open()
        jobs = build_jobs(settings, backend, endpoints, store, metrics)
        await jobs.start()
        app.state.jobs, app.state.backend = jobs, backend
        ok, reason = await backend.ready(settings.sandbox_image)
        if not ok:
            log.warning("not ready yet: %s (GET /readyz answers 503 until this is fixed)", reason)
        log.info(
            "ptc-sandbox %s ready: instance %s, image %s, store %s",
            __version__,
            settings.instance(),
            settings.sandbox_image,
            settings.job_store_path(),
        )
        try:
            yield
        finally:
            await jobs.close()
            app.state.bodies.close()
            await endpoints.aclose()
            await store.close()
            await backend.close()

    # No trailing-slash redirects: Starlette would build their Location from the request's Host header.
    app = FastAPI(title="ptc-sandbox", version=__version__, lifespan=lifespan, redirect_slashes=False)
    app.router.route_class = ParsedOffLoop
    app.state.bodies = CheckScheduler(BODY_THREADS, budget_s=3600.0)  # parsing does not count ticks: no budget
    metrics = app.state.metrics = Metrics(settings)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(  # no key, no reading of the body
        BearerAuth, keys=keys, open_paths=open_paths(settings), deny=lambda why: problem(401, "Unauthorized", why)
    )
    app.add_middleware(HttpObserver, metrics=metrics, routes=app.router.routes)  # outermost: sees every answer
    document(app, open_paths(settings), authenticated=keys is not None)
    _install_error_handlers(app, metrics)

    def jobs_of(request: Request) -> JobManager:
        manager: JobManager = request.app.state.jobs
        return manager

    def caller_of(request: Request) -> Caller:
        """Who asks: the owner of what the request creates, and whether it may act on every owner's."""
        return caller(keys, request.state.key_name)

    @app.post(
        "/execute",
        response_model=JobView,
        responses={202: {"model": JobView}, 404: {}, 409: {}, 422: {}, 429: {}, 503: {}},
    )
    async def execute(body: ExecuteRequest, request: Request) -> Response:
        """Run ``body.script`` in a new sandbox (or, with ``session_id``, in that session's sandbox).

        Answers 200 with the final view if the job ends within ``wait_s``, else 202
        with the view so far (the job runs on until it ends or hits ``timeout_s``).
        A job that could not start because the engine is unreachable answers 503.
        """
        check_execute(body, settings, request.state.key_name)
        manager = jobs_of(request)
        who = caller_of(request)
        job = await manager.submit(body, who.owner, admin=who.admin)
        request.state.job_id = job.id  # for the request's log event
        await wait_for_end_or_client(job, job.limits.wait_s)  # a client-executed call needs the caller now
        if not job.done.is_set():
            return view_response(manager.live_view(job), 202)
        if job.error is not None and job.error.get("type") == "engine_unavailable":
            return problem(503, "Container engine unavailable", str(job.error["message"]), job_id=job.id)
        return view_response(await manager.stored_view(job.id, who))  # saved as served

    @app.get("/jobs", response_model=JobList, responses={422: {}})
    async def list_jobs(
        request: Request,
        status: Annotated[list[JobStatus] | None, Query(description="Keep only these statuses.")] = None,
        created_after: Annotated[IsoDateTime | None, Query(description="ISO 8601; exclusive.")] = None,
        created_before: Annotated[IsoDateTime | None, Query(description="ISO 8601; exclusive.")] = None,
        cursor: Annotated[str | None, Query(description="next_cursor of the previous page.")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> JobList:
        """The caller's jobs (the admin role: every owner's), newest first, a page at a time."""
        query = JobQuery(
            owner=caller_of(request).only_owner,
            statuses=tuple(status or ()),
            created_after=_utc(created_after),
            created_before=_utc(created_before),
            cursor=cursor,
            limit=limit,
        )
        try:
            jobs, next_cursor = await jobs_of(request).page(query)
        except InvalidCursor as exc:
            raise InvalidField(str(exc), ("query", "cursor")) from exc
        return JobList(jobs=jobs, next_cursor=next_cursor)

    @app.get("/jobs/{job_id}", response_model=JobView, responses={404: {}})
    async def get_job(
        job_id: str,
        request: Request,
        stdout_offset: Annotated[int | None, Query(ge=0, description="Return stdout from this byte offset.")] = None,
        stderr_offset: Annotated[int | None, Query(ge=0, description="Return stderr from this byte offset.")] = None,
    ) -> Response:
        """The job's view: live while it runs, final after."""
        manager = jobs_of(request)
        offsets: dict[Stream, int | None] = {"stdout": stdout_offset, "stderr": stderr_offset}
        return view_response(await manager.view(job_id, caller_of(request), offsets))

    @app.get(
        "/jobs/{job_id}/output/{stream}",
        response_class=Response,
        responses={
            200: {
                "description": "The bytes; header X-Offset: where they start.",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            },
            404: {},
        },
    )
    async def get_output(
        job_id: str,
        stream: Stream,
        request: Request,
        offset: Annotated[int, Query(ge=0)] = 0,
        length: Annotated[int, Query(ge=1, le=16 * 1024 * 1024)] = 1024 * 1024,
    ) -> Response:
        """Raw retained bytes of ``stdout`` or ``stderr`` from ``offset`` (``application/octet-stream``)."""
        retained = await jobs_of(request).output_range(job_id, caller_of(request), stream, offset, length)
        return StreamingResponse(
            _output_slices(retained),
            media_type="application/octet-stream",
            headers={"X-Offset": str(offset), "content-length": str(retained.length)},
        )

    @app.post("/jobs/{job_id}/wait", response_model=JobView, responses={404: {}})
    async def wait_job(
        job_id: str,
        request: Request,
        timeout_s: Annotated[float | None, Query(ge=0, description="Seconds; default PTC_DEFAULT_WAIT_S.")] = None,
    ) -> Response:
        """Block until the job ends or ``timeout_s`` passes; answers the view then."""
        if timeout_s is None:
            timeout_s = settings.default_wait_s
        if timeout_s > settings.max_wait_s:
            raise RequestLimitError(
                f"{timeout_s} exceeds the server maximum of {settings.max_wait_s}", ("query", "timeout_s")
            )
        return view_response(await jobs_of(request).wait(job_id, caller_of(request), timeout_s))

    @app.post("/jobs/{job_id}/calls/{call_id}", response_model=JobView, responses={404: {}, 409: {}, 422: {}})
    async def answer_call(job_id: str, call_id: str, body: ClientAnswer, request: Request) -> Response:
        """Answer a client-executed tool call: ``{"result": ...}`` or ``{"error": {"type", "message"}}``."""
        has_result, has_error = "result" in body.model_fields_set, body.error is not None
        if has_result == has_error:
            raise InvalidField("give exactly one of result or error", ("body",))
        if has_error:
            assert body.error is not None
            ok, value = False, body.error.model_dump()
        else:
            ok, value = True, body.result
        return view_response(await jobs_of(request).answer_call(job_id, caller_of(request), call_id, ok, value))

    @app.post("/jobs/{job_id}/stop", response_model=JobView, responses={404: {}})
    async def stop_job(job_id: str, request: Request) -> Response:
        """End the job: SIGTERM to the script's processes, SIGKILL after the grace; a script that exited by itself
        first keeps its own status. Answers with the final view. Idempotent."""
        return view_response(await jobs_of(request).stop(job_id, caller_of(request)))

    @app.get(
        "/jobs/{job_id}/events",
        response_class=EventSourceResponse,
        responses={
            200: {"description": "An event stream.", "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
            404: {},
        },
    )
    async def job_events(job_id: str, request: Request) -> EventSourceResponse:
        """Server-Sent Events: ``status``, ``stdout``/``stderr``, ``call`` and a final ``end``."""
        manager, who = jobs_of(request), caller_of(request)
        if manager.live(job_id, who) is None:
            await manager.stored_view(job_id, who)  # 404 before the stream starts

        async def stream() -> AsyncIterator[bytes]:
            async for event, data in manager.events(job_id, who):  # "call" and "end" come as JSON bytes
                payload = data if isinstance(data, bytes) else orjson.dumps(data)
                yield b"event: " + event.encode() + b"\r\ndata: " + payload + b"\r\n\r\n"

        return EventSourceResponse(stream(), ping=15)

    def json_session(view: dict[str, Any], status_code: int = 200) -> Response:
        body = SessionView.model_validate(view).model_dump_json().encode()
        return Response(body, status_code=status_code, media_type="application/json")

    @app.post("/sessions", status_code=201, response_model=SessionView, responses={422: {}, 429: {}, 503: {}})
    async def create_session(body: SessionRequest, request: Request) -> Response:
        """Start a session: a sandbox kept for a conversation's scripts (``/execute`` with ``session_id``).

        Answers 201 once the sandbox is ready. Its files under ``/tmp`` persist between scripts; it ends
        after ``idle_timeout_s`` without a script, at ``max_lifetime_s``, or on DELETE.
        """
        check_session(body, settings, request.state.key_name)
        who = caller_of(request)
        return json_session(await jobs_of(request).create_session(body, who.owner, admin=who.admin), 201)

    @app.get("/sessions", response_model=SessionList)
    async def list_sessions(request: Request) -> Response:
        """The caller's open sessions (the admin role: every owner's), oldest first."""
        sessions = jobs_of(request).sessions(caller_of(request))
        body = SessionList.model_validate({"sessions": sessions}).model_dump_json().encode()
        return Response(body, media_type="application/json")

    @app.get("/sessions/{session_id}", response_model=SessionView, responses={404: {}})
    async def get_session(session_id: str, request: Request) -> Response:
        """A session's view (ended sessions stay visible for a while, up to the last 1,000)."""
        return json_session(jobs_of(request).session_view(session_id, caller_of(request)))

    @app.delete("/sessions/{session_id}", response_model=SessionView, responses={404: {}})
    async def delete_session(session_id: str, request: Request) -> Response:
        """End a session: its running script is stopped, queued ones end ``stopped``, its sandbox is removed.

        Idempotent: deleting an ended session returns its view unchanged.
        """
        return json_session(await jobs_of(request).delete_session(session_id, caller_of(request)))

    @app.post("/stubs", response_model=StubsView, responses={422: {}})
    async def stubs(body: ManifestRequest, request: Request) -> StubsView:
        """The exact ``tools`` module a sandbox would import for this manifest, and a usage text for the prompt."""
        check_manifest_request(body, settings, request.state.key_name)
        if body.mcp_servers:
            raise InvalidField(
                "register MCP servers with POST /toolsets, then pass its toolset", ("body", "mcp_servers")
            )
        compiled = await jobs_of(request).manifest(body.tools, body.toolset, caller_of(request))
        return StubsView(module=compiled.stub_source, usage=USAGE, toolset_id=compiled.toolset_id or "")

    @app.post("/toolsets", response_model=ToolsetView, responses={422: {}})
    async def toolsets(body: ManifestRequest, request: Request) -> ToolsetView:
        """Register a manifest once; pass the answer's ``toolset_id`` as ``toolset`` instead of re-sending it."""
        check_manifest_request(body, settings, request.state.key_name)
        if body.toolset is not None:
            raise InvalidField("POST /toolsets takes tools, not a toolset", ("body", "toolset"))
        compiled = await jobs_of(request).register_toolset(body.tools, body.mcp_servers, caller_of(request).owner)
        return ToolsetView(toolset_id=compiled.toolset_id or "", tools=list(compiled.tools))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}, 403: {}})
    async def metrics_route(request: Request) -> Response:
        """Prometheus metrics (text format 0.0.4); the names and labels are listed in the README.

        With authentication, only the admin role and the keys in ``PTC_METRICS_KEYS`` may read them
        (unless ``PTC_METRICS_AUTH=open``); another key gets 403.
        """
        if not may_scrape(keys, request.state.key_name):
            return problem(
                403,
                "Forbidden",
                "this API key may not read /metrics: it needs the admin role (PTC_ADMIN_KEYS) or to be named in "
                "PTC_METRICS_KEYS",
            )
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/readyz", responses={503: {}})
    async def readyz(request: Request) -> Response:
        """Readiness: the engine answers and the sandbox image is present."""
        ok, reason = await request.app.state.backend.ready(settings.sandbox_image)
        if not ok:
            return problem(503, "Not ready", reason)
        return JSONResponse({"status": "ready", "image": settings.sandbox_image})

    return app


def _iso8601(value: object) -> object:
    """Only ISO 8601 text is a date-time here (pydantic alone would also take numbers as unix seconds)."""
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("not an ISO 8601 date-time") from None
    return value


IsoDateTime = Annotated[datetime, BeforeValidator(_iso8601)]


def _utc(value: datetime | None) -> datetime | None:
    """A query datetime in UTC (naive ones are taken as UTC); raises InvalidField when it has no UTC equivalent."""
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise InvalidField(f"{value.isoformat()} is outside the range of UTC datetimes", ("query", "created")) from None


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request", "type": ""}
        if first["type"] == "json_invalid":
            position = first["loc"][-1] if first["loc"] else "?"
            detail = f"body: not valid JSON (at character {position}): {first['msg']}"
        else:
            field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
            detail = f"{field}: {first['msg']}"
        return problem(422, "Invalid request", detail, errors=errors)

    @app.exception_handler(ManifestError)
    async def bad_manifest(_: Request, exc: ManifestError) -> Response:
        field = ".".join(str(p) for p in exc.loc if p != "body")
        return problem(
            422,
            "Invalid tool manifest",
            f"{field}: {exc}",
            errors=[{"loc": list(exc.loc), "msg": str(exc), "type": "manifest"}],
        )

    @app.exception_handler(InvalidField)
    async def invalid_field(_: Request, exc: InvalidField) -> Response:
        field = ".".join(str(p) for p in exc.loc if p not in ("body", "query")) or "request"
        limit = isinstance(exc, RequestLimitError)
        return problem(
            422,
            "Limit exceeds the server maximum" if limit else "Invalid request",
            f"{field}: {exc}",
            errors=[{"loc": list(exc.loc), "msg": str(exc), "type": "limit" if limit else "invalid"}],
        )

    @app.exception_handler(PayloadTooLarge)
    async def too_large(_: Request, exc: PayloadTooLarge) -> Response:
        field = ".".join(str(p) for p in exc.loc if p != "body")
        return problem(
            413,
            "Request body too large",
            f"{field}: {exc}",
            errors=[{"loc": list(exc.loc), "msg": str(exc), "type": "too_large"}],
        )

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, exc: QueueFull) -> Response:
        metrics.rejection(exc.reason)
        response = problem(429, "Too many jobs", str(exc), reason=exc.reason)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(QuotaExceeded)
    async def over_quota(_: Request, exc: QuotaExceeded) -> Response:
        metrics.rejection(exc.reason)
        host = exc.reason.startswith("host_")
        title = "Host capacity exceeded" if host else "Quota exceeded"
        response = problem(429, title, str(exc), reason=exc.reason, limit=exc.limit)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(CallNotPending)
    async def not_pending(_: Request, exc: CallNotPending) -> Response:
        return problem(
            409,
            "Call not waiting",
            f"call {exc} is not waiting for an answer (unknown, answered, timed out, or its job has ended)",
        )

    @app.exception_handler(JobNotFound)
    async def not_found(_: Request, exc: JobNotFound) -> Response:
        return problem(404, "Job not found", f"no job with id {exc}")

    @app.exception_handler(SessionNotFound)
    async def no_session(_: Request, exc: SessionNotFound) -> Response:
        return problem(404, "Session not found", f"no session with id {exc}")

    @app.exception_handler(SessionClosed)
    async def session_closed(_: Request, exc: SessionClosed) -> Response:
        return problem(409, "Session ended", str(exc), session_id=exc.session_id, session_status=exc.status)

    @app.exception_handler(TooManySessions)
    async def too_many_sessions(_: Request, exc: TooManySessions) -> Response:
        metrics.rejection(exc.reason)
        response = problem(429, "Too many sessions", str(exc), reason=exc.reason)
        response.headers["Retry-After"] = "30"
        return response

    @app.exception_handler(EngineUnavailable)
    async def engine_gone(_: Request, exc: EngineUnavailable) -> Response:
        return problem(503, "Container engine unavailable", str(exc))

    @app.exception_handler(SandboxError)
    async def sandbox_failed(_: Request, exc: SandboxError) -> Response:
        return problem(503, "Sandbox failure", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        response = problem(exc.status_code, str(exc.detail), str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. Allow of a 405
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return problem(500, "Internal error", "the service failed; the error is in its log")
