"""Races between a script's own end and what the service does to it (issue 12, item 4).

Each test hammers one pair with a bounded number of trials, stepping the delay of the service's action
(stop, timeout, the sandbox's loss) across the moment the script exits, and checks every trial: the status
says what really ended the job, and its exit code, error and output agree with it; the stop's answer, ``GET``,
``wait`` and the list give the same final view. Most trials run in sessions (cheap: no container per trial,
several sessions in parallel); fewer run on a warm pool and cold. The trial counts are printed (``-s``).

No timing is asserted: a slow machine only moves where the trials fall, never what each one must show. But the
trials must straddle the moment (``check_straddled``): some end each way, else they tested one side only.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.conftest import Service, labelled_containers, start_service

DONE = "import time\ntime.sleep({s})\nprint('done')\n"  # the input with s = 0.5


FOREVER = "import time\nwhile True:\n    time.sleep(0.01)\n"


SESSIONS = 3  # run in parallel (the machine has 2 cores; timing noise only spreads the trials)


TRIALS: Counter[str] = Counter()  # pair and mode -> trials run (printed at the end of the module)


@pytest.fixture(scope="module")
def cold_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service without a warm pool: every one-shot job starts its sandbox cold."""
    svc = start_service(f"pytest-races-{secrets.token_hex(4)}", scratch / "svc-races", PTC_WARM_POOL_SIZE="0")
    yield svc
    svc.stop()
    assert not labelled_containers(engine, svc.instance_id, include_pool=True)


@pytest.fixture(scope="module")
def cold_api(cold_service: Service) -> Iterator[httpx.Client]:
    with cold_service.client() as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def report_trials() -> Iterator[None]:
    yield
    print("\nrace trials per pair and mode:", dict(sorted(TRIALS.items())), "total", sum(TRIALS.values()))


def _now() -> str:
    return datetime.now(UTC).isoformat()


def sessions(api: httpx.Client, n: int, **limits: Any) -> list[str]:
    ids = []
    for _ in range(n):
        response = api.post("/sessions", json={"limits": limits} if limits else {})
        assert response.status_code == 201, response.text
        ids.append(response.json()["session_id"])
    return ids


def close(api: httpx.Client, ids: list[str]) -> None:
    for session_id in ids:
        api.delete(f"/sessions/{session_id}")


def submit(api: httpx.Client, script: str, session_id: str | None, **body: Any) -> tuple[str, float]:
    """Start a job (wait_s 0); returns its id and the monotonic time its submission was answered."""
    request = {"script": script, "wait_s": 0, **body}
    if session_id is not None:
        request["session_id"] = session_id
    response = api.post("/execute", json=request)
    assert response.status_code in (200, 202), response.text
    return response.json()["job_id"], time.monotonic()


def sleep_until(moment: float) -> None:
    time.sleep(max(moment - time.monotonic(), 0))


def final_views(api: httpx.Client, job_id: str, stop: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's view from GET and wait, which must be the same final view (and the stop's answer, if given)."""
    waited = api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60}).json()
    got: dict[str, Any] = api.get(f"/jobs/{job_id}").json()
    assert waited["status"] not in ("queued", "running", "waiting"), waited
    assert got == waited
    if stop is not None:
        assert stop == got, (stop, got)
    return got


def check_listed(api: httpx.Client, since: str, views: list[dict[str, Any]]) -> None:
    """The list agrees with each job's final view (status, exit code, error, end)."""
    listed: dict[str, dict[str, Any]] = {}
    cursor = None
    while True:
        params: dict[str, Any] = {"created_after": since, "limit": 500}
        if cursor:
            params["cursor"] = cursor
        page = api.get("/jobs", params=params).json()
        listed.update({job["job_id"]: job for job in page["jobs"]})
        cursor = page["next_cursor"]
        if not cursor:
            break
    for view in views:
        summary = listed[view["job_id"]]
        for key in ("status", "exit_code", "error", "ended_at", "started_at"):
            assert summary[key] == view[key], (key, summary, view)


def show(view: dict[str, Any]) -> str:
    """What a failed check prints of a view."""
    keys = ("job_id", "status", "exit_code", "error", "stdout", "sandbox_start", "created_at", "started_at", "ended_at")
    return repr({key: view.get(key) for key in keys})


def check_done_or(view: dict[str, Any], other: str) -> str:
    """A trial of the ``DONE`` script: it succeeded as the script ran, or ``other`` ended it, and says so."""
    status = str(view["status"])
    if status == "succeeded":
        assert view["exit_code"] == 0 and view["stdout"] == "done\n" and view["error"] is None, show(view)
        return status
    error_type = {"stopped": "stopped", "timed_out": "timeout", "failed": "sandbox_error", "oom_killed": "oom"}[other]
    assert status == other, show(view)
    assert view["error"] is not None and view["error"]["type"] == error_type, show(view)
    if view["started_at"] is None:  # a stop may come before the script's start (its session's turn, a slot)
        assert other == "stopped" and view["exit_code"] is None and view["stdout"] == "", show(view)
        return status
    assert view["exit_code"] not in (0, None), show(view)  # killed: 143 (SIGTERM) or 137 (SIGKILL)
    assert view["stdout"] in ("", "done\n"), show(view)  # the print may have happened just before the signal
    return status


def check_straddled(outcomes: Counter[str], before: str, after: str) -> None:
    """Some trials ended ``before`` (the service's action came first) and some ``after`` (the script's exit did):
    the trials straddled the moment, and each side was checked."""
    assert outcomes[before] > 0 and outcomes[after] > 0, f"the trials did not straddle the moment: {dict(outcomes)}"


def calibrate(api: httpx.Client, script: str, session_id: str | None, **body: Any) -> float:
    """Seconds from a submission's answer to the script's end as the client sees it (best of two)."""
    best = 1e9
    for _ in range(2):
        job_id, answered = submit(api, script, session_id, **body)
        view = api.post(f"/jobs/{job_id}/wait", params={"timeout_s": 60}).json()
        assert view["status"] == "succeeded", view
        best = min(best, time.monotonic() - answered)
    return best


def in_parallel(lanes: list[Any], trial: Callable[[Any, int], dict[str, Any]], per_lane: int) -> list[dict[str, Any]]:
    """Run ``per_lane`` trials in each lane (a session id, or None), lanes in parallel; returns every view."""
    with ThreadPoolExecutor(len(lanes)) as pool:
        chunks = pool.map(lambda lane: [trial(lane, i) for i in range(per_lane)], lanes)
        return [view for chunk in chunks for view in chunk]


def stop_trial(api: httpx.Client, script: str, session_id: str | None, delay: float) -> dict[str, Any]:
    job_id, answered = submit(api, script, session_id)
    sleep_until(answered + delay)
    response = api.post(f"/jobs/{job_id}/stop")
    assert response.status_code == 200, response.text
    view = final_views(api, job_id, response.json())
    check_done_or(view, "stopped")
    return view


def test_exit_vs_stop(api: httpx.Client, cold_api: httpx.Client) -> None:
    """The issue's input: a stop that arrives as the script exits never relabels it (stopped with exit 0)."""
    since = _now()
    views: list[dict[str, Any]] = []
    lanes = sessions(api, SESSIONS)
    try:
        for sleep_s, per_lane in ((0.5, 10), (0.05, 30)):
            script = DONE.format(s=sleep_s)
            end = calibrate(api, script, lanes[0])
            n = per_lane * len(lanes)

            def trial(lane: str, i: int, end: float = end, n: int = n, script: str = script) -> dict[str, Any]:
                index = lanes.index(lane) + i * len(lanes)  # lanes interleave: the delays step through the window
                return stop_trial(api, script, lane, end - 0.03 + index * (0.045 / n))

            views += in_parallel(lanes, trial, per_lane)
            TRIALS[f"exit-vs-stop session (sleep {sleep_s} s)"] += n
    finally:
        close(api, lanes)
    script = DONE.format(s=0.5)
    for mode, client, n in (("pool", api, 8), ("cold", cold_api, 6)):
        end = calibrate(client, script, None)
        for i in range(n):
            views.append(stop_trial(client, script, None, end - 0.03 + i * (0.045 / n)))
        TRIALS[f"exit-vs-stop {mode}"] += n
    check_listed(api, since, [v for v in views if v["sandbox_start"] != "cold"])
    check_listed(cold_api, since, [v for v in views if v["sandbox_start"] == "cold"])
    outcomes = Counter(v["status"] for v in views)
    print("exit vs stop outcomes:", dict(outcomes))
    assert set(outcomes) <= {"succeeded", "stopped"}
    check_straddled(outcomes, "stopped", "succeeded")


def timeout_trial(api: httpx.Client, session_id: str | None, timeout_s: float) -> dict[str, Any]:
    job_id, _ = submit(api, DONE.format(s=0.05), session_id, timeout_s=round(timeout_s, 4))
    view = final_views(api, job_id)
    check_done_or(view, "timed_out")
    if view["status"] == "timed_out":
        assert view["exit_code"] == 137, view
    return view


def test_exit_vs_timeout(api: httpx.Client, cold_api: httpx.Client) -> None:
    """A time limit that falls as the script exits: succeeded (exit 0, its output) or timed_out (killed)."""
    views: list[dict[str, Any]] = []
    lanes = sessions(api, SESSIONS)
    per_lane = 20
    n = per_lane * len(lanes)
    try:

        def trial(lane: str, i: int) -> dict[str, Any]:
            index = lanes.index(lane) + i * len(lanes)
            return timeout_trial(api, lane, 0.035 + index * (0.06 / n))  # the script sleeps 0.05 s

        views += in_parallel(lanes, trial, per_lane)
        TRIALS["exit-vs-timeout session"] += n
    finally:
        close(api, lanes)
    for mode, client, n_mode, base in (("pool", api, 6, 0.035), ("cold", cold_api, 4, 0.25)):
        for i in range(n_mode):  # a cold job's limit counts its sandbox's start too
            views.append(timeout_trial(client, None, base + i * ((0.06 if mode == "pool" else 0.6) / n_mode)))
        TRIALS[f"exit-vs-timeout {mode}"] += n_mode
    outcomes = Counter(v["status"] for v in views)
    print("exit vs timeout outcomes:", dict(outcomes))
    assert set(outcomes) <= {"succeeded", "timed_out"}
    check_straddled(outcomes, "timed_out", "succeeded")


def stop_timeout_trial(api: httpx.Client, session_id: str | None, delay: float, timeout_s: float) -> dict[str, Any]:
    job_id, answered = submit(api, FOREVER, session_id, timeout_s=timeout_s)
    sleep_until(answered + delay)
    response = api.post(f"/jobs/{job_id}/stop")
    assert response.status_code == 200
    view = final_views(api, job_id, response.json())
    assert view["status"] in ("stopped", "timed_out"), show(view)
    error = {"stopped": "stopped", "timed_out": "timeout"}[view["status"]]
    assert view["error"]["type"] == error, show(view)
    if view["started_at"] is None:  # stopped before its start (its turn, a slot)
        assert view["status"] == "stopped" and view["exit_code"] is None, show(view)
        return view
    assert view["exit_code"] in (143, 137), show(view)  # SIGTERM (or SIGKILL after the grace), SIGKILL
    if view["status"] == "timed_out":
        assert view["exit_code"] == 137, show(view)
    return view


def test_stop_vs_timeout(api: httpx.Client) -> None:
    """A stop that falls as the time limit does: the first decided wins, and everything says the same."""
    since = _now()
    views: list[dict[str, Any]] = []
    lanes = sessions(api, SESSIONS)
    per_lane = 12
    n = per_lane * len(lanes)
    timeout_s = 0.3  # counted from the script's start, which comes some ms after the submission's answer
    try:

        def trial(lane: str, i: int) -> dict[str, Any]:
            index = lanes.index(lane) + i * len(lanes)
            return stop_timeout_trial(api, lane, timeout_s - 0.15 + index * (0.2 / n), timeout_s)

        views += in_parallel(lanes, trial, per_lane)
        TRIALS["stop-vs-timeout session"] += n
    finally:
        close(api, lanes)
    n = 4
    views += [stop_timeout_trial(api, None, timeout_s - 0.15 + i * (0.2 / n), timeout_s) for i in range(n)]
    TRIALS["stop-vs-timeout pool"] += n
    check_listed(api, since, views)
    outcomes = Counter(v["status"] for v in views)
    print("stop vs timeout outcomes:", dict(outcomes))
    check_straddled(outcomes, "stopped", "timed_out")


OOM_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', \"x = bytearray(b'1') * (400 * 1024 * 1024)\"])\n"
    "{wait}"
    "time.sleep({s})\n"
    "print('done')\n"
    "sys.stderr.write('child ' + repr(child.poll()))\n"  # -9: OOM-killed before the script's exit; None: not yet
)


def test_exit_vs_oom(api: httpx.Client) -> None:
    """The OOM killer acting in the sandbox as the script exits by itself (it killed a child): the script's exit
    decides (succeeded); a script that the OOM killer ends is oom_killed (exit 137)."""
    views: list[dict[str, Any]] = []
    lanes = sessions(api, 2, memory_mb=128)
    per_lane = 6
    n = per_lane * len(lanes)
    try:

        def trial(lane: str, i: int) -> dict[str, Any]:
            index = lanes.index(lane) + i * len(lanes)
            wait = "child.wait()\n" if index % 4 == 0 else ""  # then the OOM kill surely came before the exit
            # the moment (the child's start and its allocation: tens of ms, more under load) lies somewhere between
            # 0 and a few seconds: the script's pauses double from 5 ms, so some fall before it and some after
            pause = 0.0 if index < 2 else 0.005 * 2 ** (index - 2)
            script = OOM_CHILD.format(s=round(pause, 3), wait=wait)
            job_id, _ = submit(api, script, lane, timeout_s=20)
            view = final_views(api, job_id)
            check_done_or(view, "oom_killed")  # succeeded, unless the OOM killer chose the script itself
            return view

        views += in_parallel(lanes, trial, per_lane)
        TRIALS["exit-vs-oom session (a child OOM-killed)"] += n
        child = Counter(v["stderr"].rpartition("child ")[2] for v in views if v["status"] == "succeeded")
        print("exit vs oom: the child at the script's exit:", dict(child))
        check_straddled(child, "-9", "None")
        for lane in lanes:
            job_id, _ = submit(api, "x = bytearray(b'1') * (400 * 1024 * 1024)\nprint('done')\n", lane)
            view = final_views(api, job_id)
            assert view["status"] == "oom_killed" and view["exit_code"] == 137, view
            assert view["error"]["type"] == "oom" and view["stdout"] == "", view
            TRIALS["exit-vs-oom session (the script OOM-killed)"] += 1
    finally:
        close(api, lanes)


def loss_trial(api: httpx.Client, engine: docker.DockerClient, session_id: str | None, delay: float) -> dict[str, Any]:
    script = DONE.format(s=0.3)
    job_id, answered = submit(api, script, session_id)
    view = api.get(f"/jobs/{job_id}").json()
    while view["sandbox_id"] is None and view["status"] in ("queued", "running"):
        time.sleep(0.005)
        view = api.get(f"/jobs/{job_id}").json()
    sleep_until(answered + delay)
    try:
        engine.containers.get(view["sandbox_id"]).kill()
    except docker.errors.APIError:
        pass  # already gone: the job ended
    view = final_views(api, job_id)
    check_done_or(view, "failed")
    return view


def test_sandbox_loss_vs_exit(api: httpx.Client, cold_api: httpx.Client, engine: docker.DockerClient) -> None:
    """The sandbox killed (by the engine) as the script exits: an exit reported before the loss wins
    (succeeded); otherwise the job failed with sandbox_error and a non-zero exit. The engine's kill takes some
    ms of its own, so the delays start well before the exit."""
    views: list[dict[str, Any]] = []
    script = DONE.format(s=0.3)
    for mode, client, n in (("pool", api, 8), ("cold", cold_api, 3)):
        end = calibrate(client, script, None)
        views += [loss_trial(client, engine, None, end - 0.06 + i * (0.08 / n)) for i in range(n)]
        TRIALS[f"sandbox-loss-vs-exit {mode}"] += n
    n = 4
    for i in range(n):  # a session's sandbox is lost with it: one session per trial
        (lane,) = sessions(api, 1)
        try:
            end = calibrate(api, script, lane) if i == 0 else end
            views.append(loss_trial(api, engine, lane, end - 0.06 + i * (0.08 / n)))
        finally:
            close(api, [lane])
    TRIALS["sandbox-loss-vs-exit session"] += n
    outcomes = Counter(v["status"] for v in views)
    print("sandbox loss vs exit outcomes:", dict(outcomes))
    check_straddled(outcomes, "failed", "succeeded")
