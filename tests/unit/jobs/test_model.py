"""The job model without an engine: every allowed and every refused transition, and the end-of-run rules."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import get_args

import pytest

from service.jobs.model import (
    FINAL,
    LIVE,
    TRANSITIONS,
    ErrorType,
    Failure,
    IllegalTransition,
    Job,
    JobStatus,
    end_of_run,
    session_closed,
    stopped_before_start,
)
from service.schemas import job_models

S = JobStatus
ALLOWED = {
    (S.QUEUED, S.RUNNING),
    (S.QUEUED, S.STOPPED),
    (S.QUEUED, S.FAILED),
    (S.QUEUED, S.LOST),
    (S.RUNNING, S.WAITING),
    (S.WAITING, S.RUNNING),
    *((live, final) for live in (S.RUNNING, S.WAITING) for final in FINAL),
}
PAIRS = list(itertools.product(JobStatus, JobStatus))


def test_statuses_are_the_strings_the_api_and_store_use() -> None:
    assert [s.value for s in JobStatus] == list(get_args(job_models.JobStatusValue))
    assert LIVE == {S.QUEUED, S.RUNNING, S.WAITING} and FINAL == set(JobStatus) - LIVE
    assert S.OOM_KILLED.value == "oom_killed" and str(S.TIMED_OUT) == "timed_out" and f"{S.LOST}" == "lost"


def test_the_table_is_the_allowed_set() -> None:
    assert {(a, b) for a, tos in TRANSITIONS.items() for b in tos} == ALLOWED
    assert all(not TRANSITIONS[final] for final in FINAL)


@pytest.mark.parametrize(("current", "to"), sorted(ALLOWED))
def test_allowed_transition(current: JobStatus, to: JobStatus) -> None:
    job = Job(id="j", owner="o", status=current)
    job.move(to)
    assert job.status is to


@pytest.mark.parametrize(("current", "to"), [p for p in PAIRS if p not in ALLOWED])
def test_refused_transition(current: JobStatus, to: JobStatus) -> None:
    job = Job(id="j", owner="o", status=current)
    with pytest.raises(IllegalTransition) as refused:
        job.move(to)
    assert job.status is current and (refused.value.current, refused.value.to) == (current, to)


def test_end_sets_a_final_status_and_its_error_only() -> None:
    job = Job(id="j", owner="o")
    with pytest.raises(IllegalTransition):
        job.end(S.RUNNING, None)
    job.end(S.STOPPED, stopped_before_start())
    assert job.ended and job.error == {"type": "stopped", "message": "stopped before it started"}
    with pytest.raises(IllegalTransition):
        job.end(S.LOST, None)


def test_errors_render_as_the_view_gave_them() -> None:
    assert Failure(ErrorType.OOM, "m").as_dict() == {"type": "oom", "message": "m"}
    assert Failure("x", "m", "h").as_dict() == {"type": "x", "message": "m", "hint": "h"}
    assert stopped_before_start("why").as_dict() == {"type": "stopped", "message": "why"}
    assert (
        session_closed("expired", before_turn=True).message == "the session ended (expired) before this script's turn"
    )
    assert session_closed("broken", before_turn=False).as_dict() == {
        "type": "session_closed",
        "message": "the session ended (broken)",
    }


@dataclass(frozen=True)
class Exit:
    exit_code: int
    oom_killed: bool = False
    lost: str | None = None
    killed: bool = False


def rule(run: Exit, ended_by: str | None = None, **kw: object) -> tuple[JobStatus, str | None]:
    status, error = end_of_run(run, ended_by, timeout_s=2.5, memory_mb=256, **kw)  # type: ignore[arg-type]
    return status, None if error is None else error["type"]


def test_end_of_run_rules() -> None:
    failure = {"type": "nonzero_exit", "message": "the script exited with code 3"}
    assert rule(Exit(0)) == (S.SUCCEEDED, None)
    assert rule(Exit(3), script_failure=failure) == (S.FAILED, "nonzero_exit")
    assert rule(Exit(3))[0] is S.FAILED  # no verdict given: still a failure with a message
    # the service's signal ended the script: the first decided of stop and timeout names the end
    assert rule(Exit(137, killed=True), "timed_out") == (S.TIMED_OUT, "timeout")
    assert rule(Exit(143, killed=True), "stopped") == (S.STOPPED, "stopped")
    # a script that exited by itself as the stop or the timeout came keeps its own exit
    assert rule(Exit(0), "stopped") == (S.SUCCEEDED, None)
    assert rule(Exit(0), "timed_out") == (S.SUCCEEDED, None)
    assert rule(Exit(1), "timed_out", script_failure=failure) == (S.FAILED, "nonzero_exit")
    # the OOM killer
    assert rule(Exit(137, oom_killed=True)) == (S.OOM_KILLED, "oom")
    assert rule(Exit(137, oom_killed=True, lost="gone"), "stopped") == (S.OOM_KILLED, "oom")
    # a lost sandbox: after a stop or timeout was asked, that names the end; otherwise a sandbox error
    assert rule(Exit(-1, lost="the interpreter died")) == (S.FAILED, "sandbox_error")
    assert rule(Exit(-1, lost="the interpreter died"), "stopped") == (S.STOPPED, "stopped")
    assert rule(Exit(-1, lost="the interpreter died"), "timed_out") == (S.TIMED_OUT, "timeout")


def test_end_of_run_messages() -> None:
    _, timeout = end_of_run(Exit(137, killed=True), "timed_out", timeout_s=2.5, memory_mb=256)
    assert timeout == {"type": "timeout", "message": "the script ran past timeout_s=2.5 and was killed"}
    _, oom = end_of_run(Exit(137, oom_killed=True), None, timeout_s=1, memory_mb=256)
    assert oom is not None and "limit 256 MiB" in oom["message"]
    _, stop = end_of_run(Exit(143, killed=True), "stopped", timeout_s=1, memory_mb=1, stop_reason="session ended")
    assert stop == {"type": "stopped", "message": "session ended"}
    _, lost = end_of_run(Exit(-1, lost="gone"), None, timeout_s=1, memory_mb=1)
    assert lost == {"type": "sandbox_error", "message": "gone"}
