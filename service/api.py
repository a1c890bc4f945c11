"""HTTP API: the app factory, its routes, and the one place errors become RFC 9457 problem+json."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import __version__
from service.errors import EngineUnavailable, JobNotFound, ManifestError, RequestLimitError, SandboxError
from service.jobs import JobManager
from service.sandbox.base import SandboxBackend
from service.schemas import ExecuteRequest, JobView
from service.settings import Settings
from service.toolkit.endpoints import EndpointClients

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
PROBLEM = "application/problem+json"


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
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(413, "Request body too large", f"the body exceeds {self.limit} bytes")
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def create_app(settings: Settings | None = None, backend: SandboxBackend | None = None) -> FastAPI:
    """Build the service.

    Args:
        settings: configuration; default: read from ``PTC_*`` environment variables.
        backend: sandbox backend; default: ``DockerBackend`` on ``settings.docker_host``.
    """
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal backend
        if backend is None:
            from service.sandbox.docker import DockerBackend

            backend = DockerBackend(settings.docker_host, max_workers=4 * settings.concurrency() + 8)
        endpoints = EndpointClients(settings.tool_timeout_s, settings.max_tool_result_bytes)
        jobs = JobManager(settings, backend, endpoints)
        await jobs.start()
        app.state.jobs, app.state.backend = jobs, backend
        log.info(
            "ptc-sandbox %s ready: instance %s, image %s", __version__, settings.instance_id, settings.sandbox_image
        )
        try:
            yield
        finally:
            await jobs.close()
            await endpoints.aclose()
            await backend.close()

    app = FastAPI(title="ptc-sandbox", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    _install_error_handlers(app)

    def jobs_of(request: Request) -> JobManager:
        manager: JobManager = request.app.state.jobs
        return manager

    @app.post("/execute", response_model=JobView, responses={422: {}, 503: {}})
    async def execute(body: ExecuteRequest, request: Request) -> JobView | Response:
        """Run ``body.script`` in a new sandbox; answers with the job view when the job has ended.

        A job that could not start because the engine is unreachable answers 503 (with its ``job_id``).
        """
        job = jobs_of(request).submit(body)
        await job.done.wait()
        if job.error is not None and job.error.get("type") == "engine_unavailable":
            return problem(503, "Container engine unavailable", str(job.error["message"]), job_id=job.id)
        return job.view()

    @app.get("/jobs/{job_id}", response_model=JobView, responses={404: {}})
    async def get_job(job_id: str, request: Request) -> JobView:
        """The job's current view."""
        return jobs_of(request).get(job_id).view()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {}})
    async def readyz(request: Request) -> Response:
        """Readiness: the engine answers and the sandbox image is present."""
        ok, reason = await request.app.state.backend.ready(settings.sandbox_image)
        if not ok:
            return problem(503, "Not ready", reason)
        return JSONResponse({"status": "ready", "image": settings.sandbox_image})

    return app


def _install_error_handlers(app: FastAPI) -> None:

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

    @app.exception_handler(RequestLimitError)
    async def over_limit(_: Request, exc: RequestLimitError) -> Response:
        return problem(
            422,
            "Limit exceeds the server maximum",
            str(exc),
            errors=[{"loc": list(exc.loc), "msg": str(exc), "type": "limit"}],
        )

    @app.exception_handler(JobNotFound)
    async def not_found(_: Request, exc: JobNotFound) -> Response:
        return problem(404, "Job not found", f"no job with id {exc}")

    @app.exception_handler(EngineUnavailable)
    async def engine_gone(_: Request, exc: EngineUnavailable) -> Response:
        return problem(503, "Container engine unavailable", str(exc))

    @app.exception_handler(SandboxError)
    async def sandbox_failed(_: Request, exc: SandboxError) -> Response:
        return problem(503, "Sandbox failure", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return problem(exc.status_code, str(exc.detail), str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return problem(500, "Internal error", "the service failed; the error is in its log")
