"""Problem+json answers of the service as exceptions (docs/problems.md).

Every non-2xx answer raises a :class:`ProblemError` (or the subclass registered for its problem name): ``type`` (the
tag URI), ``name`` (its last path segment, e.g. ``job-not-found``), ``title``, ``status``, ``detail`` and ``extra``
(every other member, e.g. ``reason``, ``loc``, ``session_status``); ``retry_after`` is the ``Retry-After`` header in
seconds, if sent.
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx

PROBLEM_PREFIX = "tag:ptc-sandbox.dev,2026:problems/"


class ProblemError(Exception):
    """A problem+json answer (RFC 9457). Subclasses match one problem name (``problem_names``)."""

    problem_names: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        type: str,
        title: str,
        status: int,
        detail: str = "",
        extra: dict[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {title}: {detail}" if detail else f"{status} {title}")
        self.type = type
        self.title = title
        self.status = status
        self.detail = detail
        self.extra: dict[str, Any] = extra or {}
        self.retry_after = retry_after

    @property
    def name(self) -> str:
        """The problem's name (``job-not-found``), the section of docs/problems.md."""
        return self.type.removeprefix(PROBLEM_PREFIX)


class NotFoundError(ProblemError):
    """404: an unknown (or another key's) job, session or file."""

    problem_names = ("job-not-found", "session-not-found", "file-not-found", "route-not-found")


class InvalidRequestError(ProblemError):
    """422: a field is wrong (``detail`` starts with it; ``extra['loc']`` when sent)."""

    problem_names = ("invalid-request", "invalid-manifest", "unknown-image", "limit-exceeded", "idempotency-key-reused")


class ConflictError(ProblemError):
    """409: a call not pending, an ended session, an idempotency key still being admitted."""

    problem_names = ("call-not-pending", "session-ended", "idempotency-key-in-flight")


class UnauthorizedError(ProblemError):
    """401/403: no, a wrong or an insufficient API key."""

    problem_names = ("unauthorized", "forbidden")


class RateLimitedError(ProblemError):
    """429: the queue is full, a quota or the session limit is reached; ``retry_after`` says when to try again."""

    problem_names = ("queue-full", "too-many-sessions", "quota-exceeded", "host-capacity-exceeded")


class UnavailableError(ProblemError):
    """503: the engine is unavailable or the service not ready."""

    problem_names = ("engine-unavailable", "not-ready", "sandbox-failure")


_BY_NAME: dict[str, type[ProblemError]] = {
    name: cls
    for cls in (
        NotFoundError,
        InvalidRequestError,
        ConflictError,
        UnauthorizedError,
        RateLimitedError,
        UnavailableError,
    )
    for name in cls.problem_names
}


def retry_after_s(response: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (delta-seconds form only), or ``None``."""
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def problem_from_response(response: httpx.Response) -> ProblemError:
    """The exception for a non-2xx ``response``: its problem+json body, or a generic one for any other body (a
    ``status`` member that is no HTTP status is replaced by the answer's)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"type": PROBLEM_PREFIX + "http-error", "title": response.reason_phrase, "detail": response.text[:500]}
    type_ = str(body.get("type", PROBLEM_PREFIX + "http-error"))
    extra = {k: v for k, v in body.items() if k not in {"type", "title", "status", "detail"}}
    cls = _BY_NAME.get(type_.removeprefix(PROBLEM_PREFIX), ProblemError)
    status = body.get("status")
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        status = response.status_code  # a member that is no HTTP status ("500", null, 1e400) is not trusted
    return cls(
        type_,
        str(body.get("title", response.reason_phrase)),
        status,
        str(body.get("detail", "")),
        extra,
        retry_after_s(response),
    )
