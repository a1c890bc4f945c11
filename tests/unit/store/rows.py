"""Rows the store's contract tests save and expect back (``tests/unit/store/``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from service.store import IdempotencyRecord, Incarnation, JobStore, Registration, StoredJob, StoredSession

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def job(
    job_id: str,
    minutes: int = 0,
    ended: int | None = None,
    *,
    status: str = "succeeded",
    instance: str = "i1",
    owner: str | None = "alice",
    pending: bool = False,
) -> StoredJob:
    """A job created ``minutes`` after ``T0``, ended ``ended`` minutes after it (None: not ended)."""
    created = T0 + timedelta(minutes=minutes)
    return StoredJob(
        job_id,
        status,
        instance,
        created,
        None if ended is None else T0 + timedelta(minutes=ended),
        f'{{"job_id": "{job_id}", "output": "x"}}'.encode(),
        f'{{"job_id": "{job_id}"}}'.encode(),
        pending,
        owner,
    )


def fenced_job(job_id: str, *, ended: bool = False, status: str = "running", instance: str = "r1") -> StoredJob:
    """A job of replica ``r1`` as its fenced saves write it (``succeeded`` once ended)."""
    return StoredJob(
        job_id,
        "succeeded" if ended else status,
        instance,
        T0,
        T0 if ended else None,
        f'{{"job_id": "{job_id}"}}'.encode(),
        b"{}",
        False,
        "alice",
    )


def callback_job(job_id: str, *, ended: bool = False, callback: bool = True, owner: str = "alice") -> StoredJob:
    """A job with a completion callback (``lost`` once ended, its callback pending unless ``callback`` is False)."""
    return StoredJob(
        job_id,
        "lost" if ended else "running",
        "r1",
        T0,
        T0 + timedelta(minutes=1) if ended else None,
        f'{{"job_id": "{job_id}"}}'.encode(),
        b"{}",
        ended and callback,
        owner,
    )


def session(session_id: str, *, owner: str = "alice", ended: bool = False, minutes: int = 0) -> StoredSession:
    """A session of ``owner`` created ``minutes`` after ``T0`` (held by whichever incarnation saves it)."""
    created = T0 + timedelta(minutes=minutes)
    return StoredSession(
        session_id,
        owner,
        "r1",
        1,
        "closed" if ended else "ready",
        created,
        created + timedelta(minutes=1) if ended else None,
        created + timedelta(hours=1),
        f'{{"session_id": "{session_id}", "status": "{"closed" if ended else "ready"}"}}'.encode(),
    )


def key(owner: str, name: str, resource: str, kind: str = "job", ends_by: datetime | None = None) -> IdempotencyRecord:
    """An idempotency key bound at ``T0``."""
    return IdempotencyRecord(owner, name, "f" * 64, kind, resource, T0, ends_by)


def registration(instance: str = "r1", token: str = "a" * 64, lease_s: float = 10.0) -> Registration:
    """A start of ``instance`` from the work dir of ``token``."""
    return Registration(instance, f"http://127.0.0.1:80{len(instance)}", token, "0.test", lease_s)


async def register(store: JobStore, instance: str = "r1") -> Incarnation:
    """``instance`` registered in ``store``: its incarnation."""
    return Incarnation(instance, await store.replicas.register(registration(instance)))


def anyone(_: str | None) -> int:
    """Every owner's room for deliveries: plenty."""
    return 1000
