"""Attacks on the Monty engine as a hostile tenant and a hostile script would make them, through the real service:
one key's load (``auto`` decisions, ``POST /check``, Monty jobs, sessions) against another key's latency and the
host's worker processes; ``POST /check`` abuse (sizes, costs, malformed bodies, proof that nothing runs);
``check: true`` with idempotency keys, durable jobs and sessions; the ``engine`` field abused; stop and wait on Monty
jobs; manifests whose names collide with what Monty provides; sleeping scripts.

The hostile scripts themselves (bombs, escapes, crashes, confinement) are ``test_monty_hostile.py``'s. The service
here runs one Monty worker per key (``PTC_MONTY_WORKERS_PER_KEY=1``) and at most ``MAX_POOLS`` pools, with room for
many jobs at once, so that a bound that does not hold shows. Timings are compared with a baseline measured in the same
test (another test run may share the machine).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import Service, start_service, stop_clean
from tests.toolserver import ToolServer

NAMES = ("alice", "bob", "carol", "dave", "erin")
TOKENS = {name: f"{name}-{secrets.token_urlsafe(24)}" for name in NAMES}
PER_KEY = 1
MAX_POOLS = 3
MAX_SCRIPT_BYTES = 1024 * 1024  # the service's default PTC_MAX_SCRIPT_BYTES
ECHO: dict[str, Any] = {"name": "echo", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}
AUTH: list[dict[str, Any]] = [
    {"name": "auth", "parameters": {"properties": {}}, "endpoint": {"kind": "echo"}},
    {"name": "auth.login", "parameters": {"properties": {}}, "endpoint": {"kind": "echo"}},
]
LOOP = "print('go')\nn = 0\nwhile True:\n    n += 1\n"
FILLER = "x = 1\n" * ((MAX_SCRIPT_BYTES - 4096) // 6)  # ~170,000 statements, just under the script size limit
ENDED = frozenset({"succeeded", "failed", "oom_killed", "timed_out", "stopped"})
WORKER_CMDLINE = [b"/monty", b"subprocess"]
PAUSE_S = 0.02  # between a victim's round trips


# -- the service, its keys -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def svc(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A service with the keys of ``NAMES`` besides the suite's own (``pytest``), one Monty worker per key, at most
    ``MAX_POOLS`` pools, and room for 24 jobs at once (4 per key)."""
    tag = secrets.token_hex(3)
    keys = scratch / f"monty-attack-keys-{tag}"
    keys.write_text("".join(f"{name}:{hash_token(token)}\n" for name, token in TOKENS.items()))
    service = start_service(
        f"pytest-monty-attacks-{tag}",
        scratch / f"svc-monty-attacks-{tag}",
        PTC_WARM_POOL_SIZE="0",
        PTC_API_KEYS_FILE=str(keys),
        PTC_MONTY_WORKERS_PER_KEY=str(PER_KEY),
        PTC_MONTY_MAX_POOLS=str(MAX_POOLS),
        PTC_MAX_CONCURRENT_SANDBOXES="24",
        PTC_QUOTA_RUNNING_JOBS="4",
        PTC_QUOTA_JOBS_PER_MINUTE="1000000",
        PTC_HOST_CPUS="64",
        PTC_HOST_MEMORY_MB="65536",
        PTC_MAX_TIMEOUT_S="60",
        PTC_DEFAULT_TIMEOUT_S="60",
    )
    yield service
    stop_clean(engine, service)


@pytest.fixture(scope="module")
def keys(svc: Service) -> Iterator[dict[str, httpx.Client]]:
    """A client per key: ``NAMES`` and ``pytest`` (the suite's)."""
    clients = {name: client(svc, name) for name in NAMES}
    clients["pytest"] = svc.client(timeout=60)
    yield clients
    for each in clients.values():
        each.close()


def client(svc: Service, name: str, timeout: float = 60.0) -> httpx.Client:
    return httpx.Client(base_url=svc.url, timeout=timeout, headers={"Authorization": f"Bearer {TOKENS[name]}"})


# -- helpers -------------------------------------------------------------------------------------------------------


def start(api: httpx.Client, script: str, tools: list[dict[str, Any]] | None = None, **body: Any) -> str:
    """Start a Monty job without waiting for it; its id."""
    payload = {"script": script, "tools": [ECHO] if tools is None else tools, "engine": "monty", "wait_s": 0, **body}
    answer = api.post("/execute", json=payload)
    assert answer.status_code in (200, 202), answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


def status(api: httpx.Client, job_id: str) -> str:
    found: str = api.get(f"/jobs/{job_id}").json()["status"]
    return found


def ended(api: httpx.Client, job_id: str, timeout_s: float) -> dict[str, Any] | None:
    """The job's view once it has ended; None if it has not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        view: dict[str, Any] = api.get(f"/jobs/{job_id}").json()
        if view["status"] in ENDED:
            return view
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def started(api: httpx.Client, job_id: str, timeout_s: float = 10.0) -> None:
    """Wait until the job runs (fails the test past ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while status(api, job_id) == "queued":
        assert time.monotonic() < deadline, f"job {job_id} still queued after {timeout_s} s"
        time.sleep(0.05)


def round_trip(api: httpx.Client) -> float:
    """Seconds one Monty ``print(1)`` job takes from request to answer (asserts it succeeded)."""
    began = time.monotonic()
    answer = api.post("/execute", json={"script": "print(1)", "engine": "monty", "timeout_s": 20})
    took = time.monotonic() - began
    assert answer.status_code == 200 and answer.json()["stdout"] == "1\n", answer.text
    return took


def latencies(api: httpx.Client, seconds: float) -> list[float]:
    """Round trips of Monty jobs, one after another, for ``seconds``."""
    found: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or not found:
        found.append(round_trip(api))
        time.sleep(PAUSE_S)
    return found


def while_attacked(attack: Callable[[], Any], victim: httpx.Client, at_least_s: float = 1.0) -> tuple[Any, list[float]]:
    """``attack()`` in a thread; meanwhile the victim's Monty round trips, one after another, until it has ended
    (and for at least ``at_least_s``). Its result (or the exception it raised) and the round trips."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(attack())
        except Exception as exc:  # reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=run)
    began = time.monotonic()
    thread.start()
    found: list[float] = []
    while thread.is_alive() or time.monotonic() - began < at_least_s:
        found.append(round_trip(victim))
        time.sleep(PAUSE_S)
    thread.join()
    return outcome[0], found


def assert_not_starved(baseline: list[float], attacked: list[float], what: str) -> None:
    """The victim's slowest round trip under attack stays within reason: under a second, or ten times its slowest
    idle one on a loaded machine."""
    bound = max(1.0, 10 * max(baseline))
    assert max(attacked) < bound, (
        f"{what}: another key's Monty job took {max(attacked):.2f} s (idle: {max(baseline):.3f} s, "
        f"{len(attacked)} jobs under attack, bound {bound:.2f} s)"
    )


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return 0


def service_workers(svc: Service) -> list[int]:
    """Pids of the ``/monty subprocess`` worker processes descending from ``svc``'s process."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] != WORKER_CMDLINE:
                continue
            ancestor = pid
            for _ in range(8):
                ancestor = _ppid(ancestor)
                if ancestor in (svc.process.pid, 0, 1):
                    break
            if ancestor == svc.process.pid:
                found.append(pid)
        except OSError:
            continue
    return found


def problem(answer: httpx.Response) -> dict[str, Any]:
    """The answer's problem+json (asserts it is one)."""
    assert answer.headers.get("content-type", "").startswith("application/problem+json"), answer.text[:500]
    found: dict[str, Any] = answer.json()
    assert found["status"] == answer.status_code and found["type"] and found["detail"], found
    return found


def job_count(api: httpx.Client) -> int:
    return len(api.get("/jobs", params={"limit": 200}).json()["jobs"])


@pytest.fixture
def held_session(keys: dict[str, httpx.Client]) -> Iterator[str]:
    """A Monty session of ``dave`` that has run a script: it holds dave's one worker until it ends (deleted after
    the test)."""
    dave = keys["dave"]
    answer = dave.post("/sessions", json={"engine": "monty", "tools": [ECHO]})
    assert answer.status_code == 201, answer.text
    session_id: str = answer.json()["session_id"]
    try:
        first = dave.post("/execute", json={"session_id": session_id, "script": "kept = 41"})
        assert first.status_code == 200 and first.json()["status"] == "succeeded", first.text
        yield session_id
    finally:
        dave.delete(f"/sessions/{session_id}")


# -- one key's load against another's latency ---------------------------------------------------------------------

BLOCKERS: dict[str, tuple[dict[str, Any], int]] = {
    # engine auto: MontyEngine.suits parses and walks the script with CPython's ast on the event loop
    # (_imports_only); the manifest is refused after that (422): the attacker gets no job and pays no quota
    "auto-decision": ({"script": FILLER, "engine": "auto", "tools": [{"name": "broken"}]}, 422),
    # a global tool call: MontyRun asks AsyncContexts where the call is, which parses the script on the loop
    "first-global-tool-call": ({"script": "echo(x=1)\n" + FILLER, "engine": "monty", "tools": [ECHO]}, 200),
    # a tool that is also a namespace: MontyEngine.unsupported walks the script for calls (_called_names); a script
    # over AST_MAX_CHARS is not read but refused (422) when its manifest has such a tool (docs/engines.md)
    "namespaced-manifest": ({"script": FILLER, "engine": "monty", "tools": AUTH}, 422),
}


@pytest.mark.parametrize("blocker", list(BLOCKERS), ids=list(BLOCKERS))
def test_one_keys_large_script_does_not_stall_another_keys_jobs(keys: dict[str, httpx.Client], blocker: str) -> None:
    """A script just under the size limit costs its own key's worker, never the event loop everyone shares."""
    body, expected = BLOCKERS[blocker]
    alice, bob = keys["alice"], keys["bob"]
    baseline = latencies(bob, 1.0)
    answer, attacked = while_attacked(lambda: alice.post("/execute", json={**body, "timeout_s": 20}), bob)
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == expected, answer.text[:500]
    assert_not_starved(baseline, attacked, blocker)


BIG_TOOLSET: list[dict[str, Any]] = [
    {
        "name": f"ns{i % 10}.tool_{i}",
        "description": "d" * 1500,
        "parameters": {
            "type": "object",
            "properties": {f"p{j}": {"type": "string", "description": "x" * 150} for j in range(10)},
            "required": ["p0"],
        },
        "endpoint": {"kind": "echo"},
    }
    for i in range(1000)
]  # ~3.5 MB of manifest (under PTC_MAX_MANIFEST_BYTES): its .pyi is past what a compiled manifest keeps


def test_a_check_flood_with_a_large_toolset_does_not_stall_another_keys_jobs(
    svc: Service, keys: dict[str, Any]
) -> None:
    """Four of alice's clients check ``print(1)`` against a registered 1000-tool toolset, over and over, while bob
    runs Monty jobs: the type stubs are made once, off the event loop, and kept with the manifest
    (``MontyEngine.check``); a key's checks take one worker at a time; the rest wait, or get a 503."""
    alice, bob = keys["alice"], keys["bob"]
    registered = alice.post("/toolsets", json={"tools": BIG_TOOLSET})
    assert registered.status_code == 200, registered.text[:500]
    toolset = registered.json()["toolset_id"]
    first = alice.post("/check", json={"script": "print(1)", "toolset": toolset, "engine": "monty"})
    assert first.status_code == 200 and first.json()["ok"] is True, first.text[:500]
    baseline = latencies(bob, 1.0)
    stop = threading.Event()

    def hammer() -> int:
        checks = 0
        with client(svc, "alice") as own:
            while not stop.is_set():
                own.post("/check", json={"script": "print(1)", "toolset": toolset})
                checks += 1
        return checks

    with ThreadPoolExecutor(4) as pool:
        flood = [pool.submit(hammer) for _ in range(4)]
        try:
            time.sleep(0.5)
            attacked = latencies(bob, 5.0)
        finally:
            stop.set()
        checks = sum(each.result() for each in flood)
    assert checks > 0
    # A key's checks run one at a time (one core at most), each type-checking a ~360 KB .pyi in its worker (~0.4 s
    # of CPU); on this 2-core machine another key's job still shares the CPUs with it, the service and this test's
    # four clients (Monty workers have no CPU quota: docs/threat-model.md), so the bound here is 2 s, not 1 s.
    assert max(attacked) < max(2.0, 10 * max(baseline)), (max(attacked), max(baseline), checks)


def test_a_check_flood_of_costly_scripts_does_not_stall_another_keys_jobs(
    svc: Service, keys: dict[str, httpx.Client]
) -> None:
    """20 concurrent checks of a script with 3,000 type errors each (its diagnostics are parsed and answered by the
    service) wait for alice's own worker; bob's Monty jobs stay prompt."""
    bob = keys["bob"]
    script = "import tools\n" + "tools.echo(y=1)\n" * 3000
    baseline = latencies(bob, 1.0)
    with (
        httpx.Client(
            base_url=svc.url,
            timeout=120,
            headers={"Authorization": f"Bearer {TOKENS['alice']}"},
            limits=httpx.Limits(max_connections=50),
        ) as alice,
        ThreadPoolExecutor(20) as pool,
    ):
        body = {"script": script, "tools": [ECHO], "engine": "monty"}
        flood = [pool.submit(alice.post, "/check", json=body) for _ in range(20)]
        time.sleep(1.0)
        attacked = latencies(bob, 4.0)
        answers = [each.result() for each in flood]
    # each answered: checked, or refused at once while the key's workers are all busy checking (503, try again)
    assert {a.status_code for a in answers} <= {200, 503} and any(a.status_code == 200 for a in answers), {
        a.status_code for a in answers
    }
    assert_not_starved(baseline, attacked, "20 checks of 3,000 errors each")


def test_a_flood_of_looping_monty_jobs_does_not_stall_another_keys_jobs(keys: dict[str, httpx.Client]) -> None:
    """Alice fills her running quota (and more: refused or queued) with endless loops; her one worker runs one, the
    others wait for it. Bob's Monty jobs stay prompt; alice's loops end when stopped."""
    alice, bob = keys["alice"], keys["bob"]
    baseline = latencies(bob, 1.0)
    jobs: list[str] = []
    for _ in range(12):
        answer = alice.post("/execute", json={"script": LOOP, "engine": "monty", "timeout_s": 30, "wait_s": 0})
        assert answer.status_code in (200, 202, 429), answer.text
        if answer.status_code == 429:
            problem(answer)
        else:
            jobs.append(answer.json()["job_id"])
    try:
        attacked = latencies(bob, 3.0)
    finally:
        for job_id in jobs:
            alice.post(f"/jobs/{job_id}/stop")
    assert_not_starved(baseline, attacked, f"{len(jobs)} looping jobs of another key")
    for job_id in jobs:
        view = ended(alice, job_id, 10)
        assert view is not None and view["status"] in ENDED, (job_id, view)


# -- worker processes ----------------------------------------------------------------------------------------------


def test_worker_processes_stay_within_max_pools_when_many_keys_are_busy(
    svc: Service, keys: dict[str, httpx.Client]
) -> None:
    """Six keys each run a sleeping Monty job at once. ``PTC_MONTY_MAX_POOLS`` pools of ``PTC_MONTY_WORKERS_PER_KEY``
    workers is the bound docs/engines.md states; WorkerPools._open closes an idle pool for a new key, but with none
    idle it opens one more anyway, so the worker processes grow with the number of busy keys."""
    names = ["pytest", *NAMES]
    jobs = {name: start(keys[name], "import time\ntime.sleep(4)\nprint('done')", timeout_s=40) for name in names}
    peak = 0
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        peak = max(peak, len(service_workers(svc)))
        time.sleep(0.1)
    views = {name: ended(keys[name], job_id, 40) for name, job_id in jobs.items()}
    for name, view in views.items():
        assert view is not None, f"{name}'s job did not end"
        assert view["status"] == "succeeded" or (view["error"] or {}).get("type"), (name, view)
    assert peak <= MAX_POOLS * PER_KEY, (
        f"{peak} Monty worker processes for {len(names)} busy keys; PTC_MONTY_MAX_POOLS={MAX_POOLS} x "
        f"PTC_MONTY_WORKERS_PER_KEY={PER_KEY} allows {MAX_POOLS * PER_KEY}"
    )


# -- a key whose workers are held by its sessions ------------------------------------------------------------------


def test_a_job_waiting_for_a_worker_honours_its_timeout_and_stop(
    keys: dict[str, httpx.Client], held_session: str
) -> None:
    """Dave's one worker is held by his Monty session. His one-shot Monty jobs wait for it: one with ``timeout_s`` 2
    must still end ``timed_out`` about 2 s later, and one that is stopped must end ``stopped`` at once. The wait
    (MontySandbox.run -> WorkerPools.checkout) comes before Runner._supervise, which neither bounds nor stops."""
    dave = keys["dave"]
    timed = start(dave, "print(1)", timeout_s=2)
    stopped = start(dave, "print(2)", timeout_s=60)
    time.sleep(0.5)
    began = time.monotonic()
    answer = dave.post(f"/jobs/{stopped}/stop", timeout=15)
    stop_took = time.monotonic() - began
    after_stop = status(dave, stopped)
    view = ended(dave, timed, 6)
    assert view is not None and view["status"] == "timed_out", (
        f"a job with timeout_s=2 is still {status(dave, timed)} 6.5 s after it started"
    )
    assert answer.status_code == 200 and after_stop == "stopped", (
        f"stop answered {answer.status_code} after {stop_took:.1f} s; the job is still {after_stop}"
    )


def test_a_key_whose_workers_are_held_gets_answers_in_bounded_time(
    svc: Service, keys: dict[str, httpx.Client], held_session: str
) -> None:
    """With dave's one worker held by his session, ``POST /check``, an ``auto`` decision and ``check: true`` (on a
    one-shot job, and on a script of that very session: a deadlock) each need a worker of his pool too. Each must
    answer within bounded time (a result, or a structured error saying the key's workers are busy), never hang
    until the session ends (its idle timeout: 5 minutes). Sent at once, 10 s each."""
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "check": ("/check", {"script": "print(1)", "engine": "monty"}),
        "auto": ("/execute", {"script": "print(1)", "engine": "auto", "timeout_s": 5}),
        "check-true": ("/execute", {"script": "print(1)", "engine": "monty", "check": True, "timeout_s": 5}),
        "session-check-true": ("/execute", {"script": "print(kept + 1)", "session_id": held_session, "check": True}),
    }

    def ask(kind: str) -> httpx.Response | None:
        path, body = bodies[kind]
        with client(svc, "dave", timeout=10) as dave:
            try:
                return dave.post(path, json=body)
            except httpx.TimeoutException:
                return None

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = dict(zip(bodies, pool.map(ask, bodies), strict=True))
    hung = [kind for kind, answer in answers.items() if answer is None]
    assert not hung, f"no answer in 10 s while the key's one worker is held by its session: {hung}"
    for kind, answer in answers.items():
        assert answer is not None
        assert answer.status_code < 500 or answer.status_code == 503, (kind, answer.text[:500])
        if answer.status_code >= 400:
            problem(answer)


# -- POST /check ---------------------------------------------------------------------------------------------------


def test_check_refuses_a_script_over_the_size_limit_as_execute_does(keys: dict[str, httpx.Client]) -> None:
    """``/execute`` answers 413 for a script over ``PTC_MAX_SCRIPT_BYTES``; ``/check`` (check_check_request) checks
    the manifest only, so it takes 8 MiB scripts to the type checker."""
    big = "x = 1\n" * (2 * MAX_SCRIPT_BYTES // 6)
    carol = keys["carol"]
    executed = carol.post("/execute", json={"script": big, "engine": "monty"})
    assert executed.status_code == 413, executed.text[:300]
    began = time.monotonic()
    checked = carol.post("/check", json={"script": big, "engine": "monty"})
    took = time.monotonic() - began
    assert checked.status_code == 413, f"{checked.status_code} after {took:.1f} s: {checked.text[:300]}"
    assert problem(checked)["errors"][0]["loc"] == ["body", "script"]


def test_a_valid_script_the_checker_runs_out_of_time_on_is_not_blamed_on_the_script(
    keys: dict[str, httpx.Client],
) -> None:
    """A 360 KB script of assignments runs under Monty in well under a second. Its type check outlives the check's
    2 s, the worker is killed, and MontyEngine.check reports the kill as the script's own ``unsupported-syntax``
    error: ``/check`` says ``ok: false`` and ``check: true`` refuses a correct script (422 script-check-failed)."""
    carol = keys["carol"]
    script = "x = 1\n" * 60_000
    ran = carol.post("/execute", json={"script": script, "engine": "monty", "timeout_s": 20})
    assert ran.status_code == 200 and ran.json()["status"] == "succeeded", ran.text[:300]
    checked = carol.post("/check", json={"script": script, "engine": "monty"})
    assert checked.status_code in (200, 422, 503), checked.text[:300]
    blamed = [d for d in checked.json().get("diagnostics", []) if "worker" in d["message"]]
    assert not blamed, f"the checker's own failure is given as the script's error: {blamed}"
    refused = carol.post("/execute", json={"script": script, "engine": "monty", "check": True, "timeout_s": 20})
    refused_for = [d for d in refused.json().get("diagnostics", []) if "worker" in d["message"]]
    assert not refused_for, f"check: true refused a correct script ({refused.status_code}): {refused_for}"


def test_check_answers_bad_input_with_a_structured_error(keys: dict[str, httpx.Client]) -> None:
    """Each malformed ``/check`` is a 4xx problem naming its field, at once; an unknown toolset and another key's
    toolset get the same answer."""
    bob_toolset = keys["bob"].post("/toolsets", json={"tools": [ECHO]}).json()["toolset_id"]
    unknown = "ts_" + "0" * 32
    cases: dict[str, tuple[Any, int, str]] = {
        "no script": ({"tools": [ECHO]}, 422, "script"),
        "script not a string": ({"script": 5}, 422, "script"),
        "tools not a list": ({"script": "1", "tools": {"a": 1}}, 422, "tools"),
        "unknown field": ({"script": "1", "bogus": 1}, 422, "bogus"),
        "engine auto": ({"script": "1", "engine": "auto"}, 422, "engine"),
        "engine of the wrong type": ({"script": "1", "engine": ["monty"]}, 422, "engine"),
        "javascript": ({"script": "1", "language": "javascript"}, 422, "language"),
        "javascript on monty": ({"script": "1", "language": "javascript", "engine": "monty"}, 422, "engine"),
        "unknown toolset": ({"script": "1", "toolset": unknown}, 422, "toolset"),
        "another key's toolset": ({"script": "1", "toolset": bob_toolset}, 422, "toolset"),
        "tools and toolset": ({"script": "1", "toolset": bob_toolset, "tools": [ECHO]}, 422, "toolset"),
        "tool without endpoint": ({"script": "1", "tools": [{"name": "x"}]}, 422, "tools"),
        "1001 tools": ({"script": "1", "tools": [{**ECHO, "name": f"t{i}"} for i in range(1001)]}, 422, "tools"),
        "not an object": ([1, 2], 422, "body"),
    }
    carol = keys["carol"]
    for case, (body, code, field) in cases.items():
        began = time.monotonic()
        answer = carol.post("/check", json=body)
        assert time.monotonic() - began < 10, case
        assert answer.status_code == code, (case, answer.text[:300])
        assert field in str(problem(answer)["errors"][0]["loc"]), (case, answer.text[:300])
    mine = carol.post("/check", json={"script": "1", "toolset": bob_toolset}).json()
    nobody = carol.post("/check", json={"script": "1", "toolset": unknown}).json()
    assert mine["detail"].replace(bob_toolset, "<id>") == nobody["detail"].replace(unknown, "<id>")
    assert carol.post("/check", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422


def test_check_runs_nothing_of_the_script(keys: dict[str, httpx.Client], tool_server: ToolServer) -> None:
    """Scripts that call an http tool at their first line, define the check's own stop function, or have type errors
    are checked for both engines; none reaches the tool server, none makes a job. ``check: true`` refusing one makes
    no job and calls nothing either."""
    mark = "mark-" + secrets.token_hex(6)
    hit = {
        "name": "hit",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        "endpoint": {"kind": "http", "url": tool_server.url("echo")},
    }
    scripts = [
        f"import tools\ntools.hit(x={mark!r})\nprint('ran')\n",
        f"hit(x={mark!r})\n",
        f"def ptc_check_stop_8c1f():\n    hit(x={mark!r})\n\nptc_check_stop_8c1f()\n",
        f"import asyncio\nimport tools\nasync def m():\n    await tools.aio.hit(x={mark!r})\nasyncio.run(m())\n",
        f"import tools\ntools.hit(x={mark!r})\ntools.hit(x=1)\nundefined_name()\n",
        f"import tools\ntools.hit(x={mark!r})\n" + "x = 1\n" * 60_000,
    ]
    erin = keys["erin"]
    before = job_count(erin)
    for script in scripts:
        for target in ("monty", "container"):
            answer = erin.post("/check", json={"script": script, "tools": [hit], "engine": target})
            if answer.status_code == 422:  # the 60,000-line script: the checker past its own limit, not checked
                assert "not checked" in problem(answer)["detail"], answer.text[:300]
                assert not problem(answer)["type"].endswith("/script-check-failed"), answer.text[:300]
                continue
            assert answer.status_code == 200, answer.text[:300]
    refused = erin.post("/execute", json={"script": scripts[4], "tools": [hit], "engine": "monty", "check": True})
    assert refused.status_code == 422 and problem(refused)["type"].endswith("/script-check-failed"), refused.text
    time.sleep(0.5)
    reached = [args for _, args in tool_server.requests if mark in str(args)]
    assert not reached, f"a checked script reached its tool: {reached}"
    assert job_count(erin) == before


def test_check_and_run_with_1000_tools(keys: dict[str, httpx.Client]) -> None:
    """A 1000-tool manifest is checked and run under Monty in bounded time; a missing required argument of the
    1000th tool is found."""
    tools = [
        {
            "name": f"tool_{i}",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            "endpoint": {"kind": "echo"},
        }
        for i in range(1000)
    ]
    erin = keys["erin"]
    began = time.monotonic()
    good = erin.post("/check", json={"script": "import tools\ntools.tool_999(a='z')\n", "tools": tools})
    bad = erin.post("/check", json={"script": "import tools\ntools.tool_999()\n", "tools": tools, "engine": "monty"})
    ran = erin.post(
        "/execute",
        json={"script": "import tools\nprint(tools.tool_999(a='z')['args'])", "tools": tools, "engine": "monty"},
    )
    assert time.monotonic() - began < 30
    assert good.status_code == 200 and good.json()["ok"] is True, good.text[:300]
    assert bad.status_code == 200 and bad.json()["ok"] is False, bad.text[:300]
    assert {d["line"] for d in bad.json()["diagnostics"]} == {2}, bad.text[:500]
    assert ran.status_code == 200 and ran.json()["stdout"] == "{'a': 'z'}\n", ran.text[:300]


@pytest.mark.parametrize("call", ["tools.ns.tool()", "tools.ns.tool(5)", "tools.ns.tool(b='z')"])
def test_check_finds_a_bad_call_of_a_dotted_tool_as_of_a_flat_one(keys: dict[str, httpx.Client], call: str) -> None:
    """``check: true`` is what stands between a wrong call and a write tool. The same wrong call (a missing required
    argument, a wrong type, an unknown parameter) is found for ``tools.tool`` but passes for ``tools.ns.tool``: the
    ``.pyi`` (toolkit.stubs.type_stubs) declares a dotted tool as a ``@staticmethod`` of a namespace class, whose
    calls the checker does not check."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    tools = [{"name": name, "parameters": schema, "endpoint": {"kind": "echo"}} for name in ("tool", "ns.tool")]
    erin = keys["erin"]
    flat = erin.post("/check", json={"script": f"import tools\n{call.replace('ns.', '')}\n", "tools": tools})
    dotted = erin.post("/check", json={"script": f"import tools\n{call}\n", "tools": tools, "engine": "monty"})
    assert flat.status_code == 200 and flat.json()["ok"] is False, flat.text[:300]
    assert dotted.status_code == 200 and dotted.json()["ok"] is False, (
        f"{call} passes the check ({dotted.text[:300]}); its flat twin: {flat.json()['diagnostics'][0]['code']}"
    )


# -- check: true with idempotency keys, durable jobs and sessions --------------------------------------------------


def test_a_refused_check_binds_no_idempotency_key_and_makes_no_job(keys: dict[str, httpx.Client]) -> None:
    """A durable ``check: true`` request refused for its type errors leaves no job and no binding: the same refused
    body with the same key is refused again (not replayed), the corrected body with that key runs once, and its
    repeat is a replay of that job."""
    carol = keys["carol"]
    key = {"Idempotency-Key": "monty-attack-" + secrets.token_hex(8)}
    bad = {"script": "import tools\ntools.echo(y=1)\n", "tools": [ECHO], "engine": "monty", "check": True}
    bad["durable"] = True
    good = {**bad, "script": "import tools\nprint(tools.echo(x=1)['args'])\n"}
    before = job_count(carol)
    for _ in range(2):
        refused = carol.post("/execute", json=bad, headers=key)
        assert refused.status_code == 422 and "idempotent-replayed" not in refused.headers, refused.text
        assert problem(refused)["type"].endswith("/script-check-failed")
    assert job_count(carol) == before
    first = carol.post("/execute", json=good, headers=key)
    assert first.status_code == 200 and first.json()["stdout"] == "{'x': 1}\n", first.text[:300]
    again = carol.post("/execute", json=good, headers=key)
    assert again.headers.get("idempotent-replayed") == "true" and again.json()["job_id"] == first.json()["job_id"]
    assert job_count(carol) == before + 1


WRITE = "open('/tmp/x', 'w').write('%d')\n"


def test_a_refused_check_leaves_a_session_as_it_was(keys: dict[str, httpx.Client]) -> None:
    """A container session's script refused by ``check: true`` (checked in a Monty worker of the key) runs nothing
    of itself (the file it would write is not written), is not counted, and the session's next script runs."""
    carol = keys["carol"]
    opened = carol.post("/sessions", json={"tools": [ECHO]})
    assert opened.status_code == 201, opened.text
    session_id = opened.json()["session_id"]
    try:
        assert (
            carol.post("/execute", json={"session_id": session_id, "script": WRITE % 5}).json()["status"] == "succeeded"
        )
        body = {"session_id": session_id, "script": WRITE % 6 + "import tools\ntools.echo(y=1)\n", "check": True}
        refused = carol.post("/execute", json=body, timeout=15)
        assert refused.status_code == 422 and problem(refused)["type"].endswith("/script-check-failed"), refused.text
        read = "print(open('/tmp/x').read())"
        after = carol.post("/execute", json={"session_id": session_id, "script": read}, timeout=15)
        assert after.json()["stdout"] == "5\n", after.text[:300]
        assert carol.get(f"/sessions/{session_id}").json()["executions"] == 2
    finally:
        carol.delete(f"/sessions/{session_id}")


# -- the engine field, abused -------------------------------------------------------------------------------------


def test_engine_field_abuse_is_a_422_naming_the_field(keys: dict[str, httpx.Client]) -> None:
    erin = keys["erin"]
    session = erin.post("/sessions", json={})
    assert session.status_code == 201, session.text
    container_session = session.json()["session_id"]
    try:
        cases: list[tuple[str, dict[str, Any], str | tuple[str, ...]]] = [
            ("/execute", {"script": "1", "engine": 5}, "engine"),
            ("/execute", {"script": "1", "engine": None, "session_id": "ses_nope"}, "session"),
            ("/execute", {"script": "1", "engine": ["monty"]}, "engine"),
            ("/execute", {"script": "1", "engine": "MONTY"}, "engine"),
            ("/execute", {"script": "1", "engine": ""}, "engine"),
            ("/execute", {"script": "1", "engine": "monty", "image": "python-data"}, "image"),
            ("/execute", {"script": "1", "engine": "monty", "language": "typescript"}, ("engine", "language")),
            ("/execute", {"script": "1", "engine": "monty", "session_id": container_session}, "engine"),
            ("/execute", {"script": "1", "engine": "auto", "session_id": container_session}, "engine"),
            ("/sessions", {"engine": "auto"}, "engine"),
            ("/sessions", {"engine": "monty", "files": [{"path": "a.txt", "content": "hi"}]}, "files"),
            ("/sessions", {"engine": "monty", "env": {"A": "1"}}, "env"),
            ("/sessions", {"engine": "monty", "language": "javascript"}, ("engine", "language")),
        ]
        for path, body, field in cases:
            answer = erin.post(path, json=body)
            assert answer.status_code in (404, 422), (body, answer.status_code, answer.text[:300])
            found = problem(answer)
            named = str(found.get("errors") or found["detail"])
            assert any(each in named for each in ((field,) if isinstance(field, str) else field)), (body, found)
    finally:
        erin.delete(f"/sessions/{container_session}")
    assert erin.post("/execute", json={"script": "print(1)", "engine": "monty"}).json()["stdout"] == "1\n"


# -- stop, wait and view ---------------------------------------------------------------------------------------------

RUNNING: dict[str, str] = {
    "loop": LOOP,
    "time.sleep": "import time\nprint('go')\ntime.sleep(50)\n",
    "gathered-sleeps": "import asyncio\nprint('go')\nasync def m():\n"
    "    await asyncio.gather(*[asyncio.sleep(50) for _ in range(200)])\nasyncio.run(m())\n",
    "hanging-http-call": "import tools\nprint('go')\ntools.hang()\n",
}


@pytest.mark.parametrize("kind", list(RUNNING), ids=list(RUNNING))
def test_a_running_monty_job_is_waited_on_and_stopped_as_a_container_job(
    keys: dict[str, httpx.Client], tool_server: ToolServer, kind: str
) -> None:
    """Wait answers the running view after its time; another key can neither stop nor see the job; a stop ends it
    at once with its output kept; the key's one worker is free for its next job."""
    carol, bob = keys["carol"], keys["bob"]
    hang = {
        "name": "hang",
        "parameters": {"properties": {}},
        "endpoint": {"kind": "http", "url": tool_server.url("hang")},
    }
    job_id = start(carol, RUNNING[kind], [hang], timeout_s=50)
    started(carol, job_id)
    began = time.monotonic()
    waited = carol.post(f"/jobs/{job_id}/wait", params={"timeout_s": 1})
    assert 0.8 < time.monotonic() - began < 5 and waited.json()["status"] == "running", waited.text[:300]
    assert bob.post(f"/jobs/{job_id}/stop").status_code == 404
    assert bob.get(f"/jobs/{job_id}").status_code == 404
    assert status(carol, job_id) == "running"
    began = time.monotonic()
    stopped = carol.post(f"/jobs/{job_id}/stop")
    assert stopped.status_code == 200 and time.monotonic() - began < 5, stopped.text[:300]
    view = ended(carol, job_id, 5)
    assert view is not None and view["status"] == "stopped" and view["stdout"] == "go\n", view
    assert round_trip(carol) < 3


def test_a_stopped_session_script_frees_the_keys_worker(keys: dict[str, httpx.Client]) -> None:
    """Deleting a Monty session while its script loops ends the script and gives the worker back."""
    carol = keys["carol"]
    opened = carol.post("/sessions", json={"engine": "monty"})
    assert opened.status_code == 201, opened.text
    session_id = opened.json()["session_id"]
    job = carol.post("/execute", json={"session_id": session_id, "script": LOOP, "timeout_s": 50, "wait_s": 0})
    job_id = job.json()["job_id"]
    started(carol, job_id)
    deleted = carol.delete(f"/sessions/{session_id}")
    assert deleted.status_code == 200, deleted.text
    view = ended(carol, job_id, 5)
    assert view is not None and view["status"] in ("stopped", "failed"), view
    assert round_trip(carol) < 3


# -- names that collide with what Monty provides ---------------------------------------------------------------

MODULE_TOOLS = ("json.dumps", "os.system", "typing.cast", "asyncio.gather", "re.compile", "sys.exit")
BUILTIN_TOOLS = {
    "print": "print(1)\nimport tools\nprint(tools.print(n=3))\n",
    "open": "import tools\nprint(tools.open(n=3))\n",
    "len": "print(len([1]))\nimport tools\nprint(tools.len(n=3))\n",
    "__import__": "import tools\nprint(tools.__import__(n=3))\n",
    "aio": "import tools\nprint(tools.aio(n=3))\n",
    "tools": "import tools\nprint(tools.tools(n=3))\n",
    "ptc_check_stop_8c1f": "print(ptc_check_stop_8c1f(n=3))\n",
}


@pytest.mark.parametrize("name", MODULE_TOOLS)
def test_a_tool_named_like_a_monty_module_is_a_422_naming_it(keys: dict[str, httpx.Client], name: str) -> None:
    tool = {"name": name, "parameters": {"properties": {"n": {}}}, "endpoint": {"kind": "echo"}}
    answer = keys["erin"].post("/execute", json={"script": "import tools\n", "tools": [tool], "engine": "monty"})
    assert answer.status_code == 422, answer.text[:300]
    assert name.split(".")[0] in problem(answer)["detail"]
    checked = keys["erin"].post("/check", json={"script": "import tools\n", "tools": [tool], "engine": "monty"})
    assert checked.status_code in (200, 422), checked.text[:300]


@pytest.mark.parametrize("name", list(BUILTIN_TOOLS))
def test_a_tool_named_like_a_builtin_runs_as_in_a_container(keys: dict[str, httpx.Client], name: str) -> None:
    tool = {"name": name, "parameters": {"properties": {"n": {}}}, "endpoint": {"kind": "echo"}}
    views = {}
    for engine in ("monty", "container"):
        answer = keys["erin"].post(
            "/execute", json={"script": BUILTIN_TOOLS[name], "tools": [tool], "engine": engine, "timeout_s": 20}
        )
        assert answer.status_code == 200, (engine, answer.text[:300])
        views[engine] = answer.json()
    assert views["monty"]["status"] == views["container"]["status"], views
    assert views["monty"]["stdout"] == views["container"]["stdout"], views
    checked = keys["erin"].post("/check", json={"script": BUILTIN_TOOLS[name], "tools": [tool], "engine": "monty"})
    assert checked.status_code == 200, checked.text[:300]


# -- sleeping scripts ----------------------------------------------------------------------------------------------


def test_sleeping_scripts_end_at_their_timeout_and_hold_no_other_keys_worker(keys: dict[str, httpx.Client]) -> None:
    """Alice's sleeps of an hour (``time.sleep``, ``asyncio.sleep``, 500 gathered, a ``time.sleep(0)`` spin), one
    after another, each end ``timed_out`` (or failed) at their 2 s; meanwhile bob's Monty jobs are prompt."""
    alice, bob = keys["alice"], keys["bob"]
    sleepers = [
        "import time\ntime.sleep(3600)\n",
        "import asyncio\nasyncio.run(asyncio.sleep(3600))\n",
        "import asyncio\nasync def m():\n    await asyncio.gather(*[asyncio.sleep(3600) for _ in range(500)])\n"
        "asyncio.run(m())\n",
        "import time\nwhile True:\n    time.sleep(0)\n",
    ]

    def sleep_all() -> list[tuple[str, float, dict[str, Any] | None]]:
        found = []
        for script in sleepers:
            began = time.monotonic()
            view = ended(alice, start(alice, script, timeout_s=2), 15)
            found.append((script, time.monotonic() - began, view))
        return found

    baseline = latencies(bob, 1.0)
    outcome, attacked = while_attacked(sleep_all, bob)
    assert isinstance(outcome, list), outcome
    for script, took, view in outcome:
        assert view is not None, f"{script!r} has not ended in 15 s"
        assert view["status"] in ("timed_out", "failed"), (script, view["status"], view["error"])
        assert took < 8, (script, took)
    assert_not_starved(baseline, attacked, "sleeping jobs of another key")
