"""Admission without an engine: queue bounds, and queue accounting that cannot leak (the save-failure path of a
session script included: before the fix, a failed first save left its session's ``queued`` count raised)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from service.errors import QueueFull
from service.jobs.admission import Admitted, Ticket
from service.jobs.model import ErrorType, JobStatus
from service.jobs.placement import InSession, acquire
from service.schemas.job_models import ExecuteRequest
from tests.unit.jobs.conftest import FakeSession, Parts

MANIFEST: Any = type("Manifest", (), {"tools": {}, "stub_source": ""})()


def test_one_shot_bound_and_idempotent_release(parts: Parts) -> None:
    admission, bound = parts.admission, parts.settings.concurrency() + parts.settings.max_queue
    tickets = [admission.one_shot(f"key{i}") for i in range(bound)]  # one each: no owner's quota is reached
    with pytest.raises(QueueFull):
        admission.one_shot("other")
    assert admission.admitted == bound and parts.quotas.usage("key0").jobs == 1
    for ticket in tickets:
        ticket.release()
        ticket.release()  # twice: given back once
        ticket.leave_queue()
    assert admission.admitted == 0 and all(parts.quotas.usage(f"key{i}").jobs == 0 for i in range(bound))
    admission.one_shot("other")  # room again


def test_session_queue_bound_and_idempotent_accounting(parts: Parts) -> None:
    session = FakeSession()
    tickets = [parts.admission.in_session(session, f"key{i}") for i in range(parts.settings.max_queue)]
    with pytest.raises(QueueFull):
        parts.admission.in_session(session, "other")
    assert session.queued == parts.settings.max_queue
    tickets[0].leave_queue()
    tickets[0].leave_queue()
    assert session.queued == parts.settings.max_queue - 1
    for ticket in tickets:
        ticket.release()
        ticket.release()
    assert session.queued == 0 and parts.quotas.usage("key0").jobs == 0
    assert parts.admission.admitted == 0  # session scripts never count against the one-shot bound


def admitted(parts: Parts, session: FakeSession) -> tuple[Admitted, Ticket]:
    ticket = parts.admission.in_session(session, "alice")
    job = parts.new_job("alice")
    job.session_id = session.id
    return Admitted(job, ExecuteRequest(script="print(1)"), MANIFEST, ticket, cast(Any, session)), ticket


async def test_failed_first_save_of_a_session_script_gives_its_queue_place_back(
    parts: Parts, caplog: pytest.LogCaptureFixture
) -> None:
    parts.store.failing = True
    session = FakeSession()
    job_admitted, ticket = admitted(parts, session)
    assert session.queued == 1
    placement = InSession(cast(Any, session), parts.runner._sandboxes, ticket, job_admitted.job, parts.tasks)
    with caplog.at_level(logging.ERROR):
        await parts.runner.run(job_admitted, placement)
    job = job_admitted.job
    assert session.queued == 0
    assert parts.quotas.usage("alice").jobs == 0 and ticket.released
    assert job.status is JobStatus.FAILED and job.error is not None and job.error["type"] == ErrorType.INTERNAL_ERROR
    assert job.done.is_set() and job.id not in parts.live
    assert "could not save its final view" in caplog.text
    assert not session.turn.locked()


async def test_a_run_task_cancelled_before_it_began_gives_its_place_back(parts: Parts) -> None:
    session = FakeSession()
    job_admitted, ticket = admitted(parts, session)
    task = parts.runner.start(job_admitted)
    task.cancel()  # before its first step: the run's own cleanup never runs
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # done callbacks run
    assert ticket.released and session.queued == 0 and parts.quotas.usage("alice").jobs == 0
    # and its output files are closed (before the fix they stayed open until garbage collection)
    assert job_admitted.job.stdout.closed and job_admitted.job.stderr.closed


async def test_broker_close_failures_are_logged(
    parts: Parts, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.broker import Broker

    async def broken_close(self: Broker) -> None:
        raise RuntimeError("socket gone")

    monkeypatch.setattr(Broker, "close", broken_close)
    parts.store.failing = True
    session = FakeSession()
    job_admitted, ticket = admitted(parts, session)
    placement = InSession(cast(Any, session), parts.runner._sandboxes, ticket, job_admitted.job, parts.tasks)
    with caplog.at_level(logging.ERROR):
        await parts.runner.run(job_admitted, placement)
    assert f"job {job_admitted.job.id}: closing its broker failed" in caplog.text
    assert "socket gone" in caplog.text  # with its traceback
    # the session's own path: its turn is held when the broker is closed before the next script's
    caplog.clear()
    parts.store.failing = False
    other_admitted, other_ticket = admitted(parts, session)
    placement = InSession(cast(Any, session), parts.runner._sandboxes, other_ticket, other_admitted.job, parts.tasks)
    await session.turn.acquire()
    placement._turn = True
    session.sandbox = type("Sandbox", (), {"broken": None})()
    with caplog.at_level(logging.ERROR):
        await placement.leave(parts.runner._new_broker(other_admitted.job, MANIFEST, []))
    assert f"job {other_admitted.job.id}: closing its broker failed" in caplog.text and not session.turn.locked()
    for output in (other_admitted.job.stdout, other_admitted.job.stderr):  # never run: its cleanup is ours
        output.close()


async def test_a_wait_for_a_turn_cancelled_as_the_turn_is_granted_gives_it_back(parts: Parts) -> None:
    """The session turn a queued job's wait is granted in the same loop step as the wait is cancelled (its first save
    failing meanwhile) is given back: before the fix it stayed held and the session's next script never ran."""
    turn, job = asyncio.Lock(), parts.new_job("alice")
    await turn.acquire()
    waiting = asyncio.ensure_future(acquire(job, turn))
    for _ in range(3):
        await asyncio.sleep(0)  # waiting on the lock
    turn.release()  # granted: the lock's waiter runs first in the next loop step...
    waiting.cancel()  # ...and the wait itself is cancelled in the same step
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not turn.locked()
