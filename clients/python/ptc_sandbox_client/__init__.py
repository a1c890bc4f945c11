"""Python client of the ptc-sandbox service: ``Client``/``AsyncClient``, typed views, problems as exceptions, sessions
as context managers, resumable event streams, client-executed tools and the callback verifier (docs/client.md)."""

from ._sse import SSEParser
from ._tools import client_manifest, schema_of
from .client import AsyncClient, AsyncSession, Client, Session
from .errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ProblemError,
    RateLimitedError,
    UnauthorizedError,
    UnavailableError,
    problem_from_response,
)
from .models import CallError, CallRecord, Event, JobView, OutputFile, PendingCall, SessionFile, SessionView
from .webhooks import verify_callback

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "CallError",
    "CallRecord",
    "Client",
    "ConflictError",
    "Event",
    "InvalidRequestError",
    "JobView",
    "NotFoundError",
    "OutputFile",
    "PendingCall",
    "ProblemError",
    "RateLimitedError",
    "SSEParser",
    "Session",
    "SessionFile",
    "SessionView",
    "UnauthorizedError",
    "UnavailableError",
    "client_manifest",
    "problem_from_response",
    "schema_of",
    "verify_callback",
]
