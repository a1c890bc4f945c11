"""The service's exception hierarchy (one root; ``api.problems.RULES`` maps it to RFC 9457 problem+json).

::

    PtcError
    ├── ManifestError        a tool manifest entry is unusable          -> 422
    ├── InvalidField         a field the service cannot use             -> 422
    │   ├── RequestLimitError  a request asks past a server maximum     -> 422
    │   └── UnknownImage       an image name PTC_IMAGES does not offer    -> 422
    ├── PayloadTooLarge      a script or manifest over its size limit    -> 413
    ├── WorkDirBusy          another instance holds the work dir        (start-up)
    ├── InsecureConfig       settings that would expose the service     (start-up)
    ├── EgressDenied         (service.egress) a destination off the egress rules: a tool error, never HTTP
    ├── CheckTooCostly       checking a call's arguments/result ran past its CPU budget (or one regex search
    │                        past its time limit): a tool error (limit_exceeded), never HTTP
    ├── OwnerElsewhere       the job or session runs on another live replica: relayed (api.forward), else -> 503
    ├── JobNotFound          no job with that id                         -> 404
    ├── SessionNotFound      no session with that id                     -> 404
    ├── NoSuchFile           no file at that path (a job's output, a session's /tmp) -> 404
    ├── FileRefused          the sandbox could not write or read a file  -> 422
    ├── SessionClosed        the session has ended                       -> 409
    ├── TooManySessions      max_sessions are live                       -> 429
    ├── QueueFull            all sandbox slots busy and the queue full   -> 429
    ├── QuotaExceeded        a key's quota used                          -> 429
    │   └── HostCapacityExceeded  the host has no room for the sandbox   -> 429
    ├── CallNotPending       answer to a client call not waiting for one -> 409
    ├── IdempotencyKeyReused   an Idempotency-Key sent again with another request -> 422
    ├── IdempotencyKeyInFlight an Idempotency-Key whose first request is still being admitted -> 409
    ├── StoreUnavailable     the job store (PostgreSQL) cannot be reached or did not answer in time -> 503
    └── SandboxError         the engine failed us (not the script)      -> 503
        └── EngineUnavailable  the engine cannot be reached             -> 503
"""

from __future__ import annotations


class PtcError(Exception):
    """Root of every error this service raises on purpose."""


class ManifestError(PtcError):
    """A manifest entry cannot be turned into a tool.

    Attributes:
        loc: where in the request body the problem is, e.g. ``("tools", 2, "parameters")``.
    """

    def __init__(self, message: str, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.loc = loc


class InvalidField(PtcError):
    """A request field the models accept but the service cannot use; ``loc`` names the field."""

    def __init__(self, message: str, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.loc = loc


class RequestLimitError(InvalidField):
    """A request field exceeds what the server allows."""


class UnknownImage(InvalidField):
    """A request names an image that ``PTC_IMAGES`` does not offer; ``allowed`` are the names it does (sorted).

    Only names: the image references behind them are the operator's and are never shown to callers.
    """

    def __init__(self, name: str, allowed: list[str], loc: tuple[str | int, ...] = ("body", "image")) -> None:
        super().__init__(f"image {name!r} is not offered; ask for one of {allowed}", loc)
        self.allowed = allowed


class PayloadTooLarge(PtcError):
    """A part of the request body is larger than its server limit; ``loc`` names it, ``limit`` is in bytes."""

    def __init__(self, message: str, loc: tuple[str | int, ...], limit: int) -> None:
        super().__init__(message)
        self.loc = loc
        self.limit = limit


class CheckTooCostly(PtcError):
    """Checking a tool call's arguments or result against the schema took more than ``budget_s`` of CPU time."""

    def __init__(self, budget_s: float, message: str | None = None) -> None:
        super().__init__(message or f"checking against the tool's schema took more than {budget_s:g} s of CPU time")
        self.budget_s = budget_s


class InsecureConfig(PtcError):
    """The settings would let anyone reach the service without a key (see ``service.tenancy.configure``)."""


class WorkDirBusy(PtcError):
    """Another running instance holds the work dir (``work_dir``)."""

    def __init__(self, work_dir: object) -> None:
        super().__init__(f"another ptc-sandbox instance is using {work_dir}; give this one its own PTC_WORK_DIR")


class InstanceIdInUse(PtcError):
    """A live replica with another work dir holds this instance id in the store's registry (its lease holding), or,
    on a SQLite store (one replica), another instance id is live on the same file (docs/scaling.md)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)


class LeaseLost(PtcError):
    """A fenced write matched no row: this replica's incarnation is no longer the job's owner (another replica
    expired it, or the job was ended by someone else). Internal: never an HTTP answer; the replica fences itself
    (``service.replicas.registration.Replicas.fence``)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"lease lost: {what}")


class OwnerUnavailable(PtcError):
    """The job runs on another replica, and this one cannot serve it now (503 ``owner-unavailable``): no
    forwarding yet, or the owner's lease has passed and the job is not marked ``lost`` yet.

    Attributes:
        retry_after_s: whole seconds after which asking again may succeed (at least 1).
    """

    def __init__(self, job_id: str, retry_after_s: int, what: str = "job") -> None:
        super().__init__(f"{what} {job_id} runs on another replica, which cannot be reached from here; retry later")
        self.retry_after_s = max(1, retry_after_s)


class OwnerElsewhere(PtcError):
    """The job or session runs on another live replica: the request is relayed to it (``api.forward``, one
    exception handler; 503 ``owner-unavailable`` where it cannot be relayed).

    Attributes:
        what, resource_id: ``job`` or ``session``, and its id.
        instance_id, epoch: the owner's incarnation; ``url``: its internal URL (``http://host:port``).
        retry_after_s: as ``OwnerUnavailable``'s, for the answer when the owner cannot be reached.
        instead: see below.
    """

    def __init__(
        self, what: str, resource_id: str, instance_id: str, epoch: int, url: str, retry_after_s: int = 1
    ) -> None:
        super().__init__(f"{what} {resource_id} runs on another replica, which cannot be reached from here")
        self.what, self.resource_id = what, resource_id
        self.instance_id, self.epoch, self.url = instance_id, epoch, url
        self.retry_after_s = max(1, retry_after_s)
        self.instead: tuple[str, str] | None = None
        """(method, path) to send instead of the request's own (its query string is kept): ``wait`` waits here
        and fetches the view of a job still running elsewhere with one ``GET``."""

    @property
    def target(self) -> str:
        """``<instance_id>.<epoch>``: the ``Ptc-Internal-Target`` of the relayed request."""
        return f"{self.instance_id}.{self.epoch}"

    def unavailable(self) -> OwnerUnavailable:
        """The 503 to answer when the owner cannot be reached."""
        return OwnerUnavailable(self.resource_id, self.retry_after_s, self.what)


class JobNotFound(PtcError):
    """No job with the given id is known."""


class SessionNotFound(PtcError):
    """No session with the given id is known (never created, or ended long ago, or before a restart)."""


class NoSuchFile(PtcError):
    """No file at the path asked for: among a job's output files, or under a session's working directory."""


class FileRefused(PtcError):
    """The sandbox could not write or read a file (docs/files.md).

    Attributes:
        code: ``no_space`` (the tmpfs is full), ``not_a_file`` (a symlink or folder in the way), ``too_large``,
            ``invalid_path`` or ``failed``.
        index: the file's index in the request's ``files`` (None: a single file's request).
    """

    def __init__(self, code: str, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.index = index


class SessionClosed(PtcError):
    """The session has ended (closed, expired or broken) and runs no more scripts.

    Attributes:
        session_id: the session.
        status: ``closed``, ``expired`` or ``broken``.
        reason: why it ended ("" when it was deleted).
    """

    def __init__(self, session_id: str, status: str, reason: str) -> None:
        super().__init__(f"session {session_id} is {status}" + (f": {reason}" if reason else ""))
        self.session_id = session_id
        self.status = status
        self.reason = reason


class TooManySessions(PtcError):
    """``max_sessions`` sessions are live already; retry after ``retry_after_s`` (30) seconds."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} sessions are open already (PTC_MAX_SESSIONS); delete one or retry later")
        self.limit = limit
        self.reason = "max_sessions"
        self.retry_after_s = 30


class CallNotPending(PtcError):
    """An answer to a client-executed call that is not waiting for one (unknown, answered, timed out)."""


class IdempotencyKeyReused(PtcError):
    """An ``Idempotency-Key`` sent again with a request whose fingerprint differs from its first request's."""

    def __init__(self, key: str) -> None:
        super().__init__(
            "this Idempotency-Key was sent before with another request (route or body); use a new key for a new request"
        )
        self.key = key


class IdempotencyKeyInFlight(PtcError):
    """The first request with this ``Idempotency-Key`` is still being admitted; retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: int = 1) -> None:
        super().__init__(
            "a request with this Idempotency-Key is still being admitted; retry it after Retry-After seconds"
        )
        self.retry_after_s = retry_after_s


class SandboxError(PtcError):
    """The sandbox backend failed for a reason that is not the script's."""


class EngineUnavailable(SandboxError):
    """The container engine cannot be reached."""


class StoreUnavailable(PtcError):
    """The job store cannot be reached, or did not answer within ``PTC_STORE_TIMEOUT_S``.

    Its message never holds the store's URL nor the driver's text (which may name the server): it says what failed
    (``operation``); the cause is chained and logged.
    """

    def __init__(self, operation: str) -> None:
        super().__init__(f"the job store did not answer ({operation}); retry later")
        self.operation = operation


class QueueFull(PtcError):
    """Every sandbox slot is busy and the queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the job queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s
        self.reason = "queue_full"


class Draining(PtcError):
    """This replica is shutting down (SIGTERM) and takes no new work; retry after ``retry_after_s`` seconds (another
    replica, or this one once restarted)."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            f"this replica is draining (shutting down) and takes no new work; retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class QuotaExceeded(PtcError):
    """A request would take a key past one of its quotas, or the sandboxes past the host's capacity.

    Attributes:
        reason: the quota's name (``service.quotas.QUOTA_NAMES``) or ``host_memory_mb`` / ``host_cpus``;
            a bounded set, used as the ``reason`` label of ``ptc_rejections_total``.
        limit: the quota (or capacity) in its own unit.
        retry_after_s: when a retry may succeed (s, at least 1).
    """

    def __init__(self, message: str, reason: str, limit: float, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.limit = limit
        self.retry_after_s = max(1, retry_after_s)


class HostCapacityExceeded(QuotaExceeded):
    """The host cannot take a sandbox of these limits: its memory or CPUs are committed (``reason``
    ``host_memory_mb`` or ``host_cpus``); a ``QuotaExceeded`` of the host rather than of a key."""
