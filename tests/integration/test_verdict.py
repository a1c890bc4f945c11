"""A script cannot write its own verdict: the job's ``error`` is what the service observed (service.verdict)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import execute

FORGE = (
    "from ptc_runtime.client import client\n"
    "client().request({'op': 'report', 'error': {'type': %r, 'message': 'forged', 'line': 7}})\n"
)


def test_a_forged_report_does_not_become_the_jobs_error(api: httpx.Client) -> None:
    view = execute(api, FORGE % "MemoryError" + "import os\nos._exit(3)\n")
    assert (view["status"], view["exit_code"]) == ("failed", 3)
    error = view["error"]
    assert (error["type"], error["message"]) == ("nonzero_exit", "the script exited with code 3")
    forged = {"type": "MemoryError", "message": "forged", "line": 7, "column": None, "text": None}
    assert error["script_report"] == forged


def test_a_claimed_oom_or_timeout_is_still_a_plain_exit(api: httpx.Client) -> None:
    view = execute(api, FORGE % "oom" + "import os\nos._exit(137)\n")
    assert (view["status"], view["error"]["type"]) == ("failed", "nonzero_exit")
    assert "SIGKILL" in view["error"]["message"] and view["error"]["script_report"]["type"] == "oom"


def test_a_forged_syntax_error_is_not_a_syntax_error(api: httpx.Client) -> None:
    view = execute(api, FORGE % "SyntaxError" + "raise SystemExit(1)\n")
    assert view["error"]["type"] == "nonzero_exit" and view["error"]["hint"] is None
    assert view["error"]["script_report"]["type"] == "SyntaxError"


def test_a_report_from_a_script_that_succeeds_is_dropped(api: httpx.Client) -> None:
    view = execute(api, FORGE % "ValueError" + "print('ok')\n")
    assert (view["status"], view["error"]) == ("succeeded", None)


def test_a_real_syntax_error_is_the_services_own_compile_verdict(api: httpx.Client) -> None:
    view = execute(api, "x = 1\ndef f(:\n    pass\n")
    error = view["error"]
    assert (error["type"], error["line"], error["text"]) == ("SyntaxError", 2, "def f(:")
    assert error["script_report"]["type"] == "SyntaxError"  # the sandbox's interpreter agrees, as it should


HUNGRY = "hog = bytearray(1024 ** 3)\n"
OOM_TRIES = 20


def _verdict(view: dict[str, Any]) -> tuple[Any, ...]:
    return view["status"], view["exit_code"], (view["error"] or {}).get("type")


def test_a_script_past_its_memory_limit_is_oom_killed_every_time(runtime_api: httpx.Client) -> None:
    """Issue 24, item 1: under gVisor the OOM kill ends the whole sandbox and the engine's OOMKilled flag was
    sometimes not set (its ``oom`` event came after ``die``), so about one job in eight was ``failed``
    (``sandbox_error``). The verdict comes from the engine (the flag or its ``oom`` event), every time."""
    verdicts = [_verdict(execute(runtime_api, HUNGRY, limits={"memory_mb": 64})) for _ in range(OOM_TRIES)]
    assert verdicts == [("oom_killed", 137, "oom")] * OOM_TRIES


def test_a_session_script_past_its_memory_limit_is_oom_killed_every_time(runtime_api: httpx.Client) -> None:
    """The same in a session's sandbox (under gVisor the session is broken afterwards: a new one each time)."""
    verdicts = []
    sid = None
    try:
        for _ in range(OOM_TRIES // 2):
            if sid is None or runtime_api.get(f"/sessions/{sid}").json()["status"] != "ready":
                if sid is not None:
                    runtime_api.delete(f"/sessions/{sid}")
                answer = runtime_api.post("/sessions", json={"limits": {"memory_mb": 64}})
                assert answer.status_code == 201, answer.text
                sid = answer.json()["session_id"]
            verdicts.append(_verdict(execute(runtime_api, HUNGRY, session_id=sid)))
    finally:
        if sid is not None:
            runtime_api.delete(f"/sessions/{sid}")
    assert verdicts == [("oom_killed", 137, "oom")] * (OOM_TRIES // 2)


@pytest.mark.parametrize(
    "ending",
    [
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "import sys\nsys.exit(137)\n",
        "import os\nos._exit(137)\n",
    ],
)
def test_a_script_that_ends_itself_with_137_is_not_oom_killed(runtime_api: httpx.Client, ending: str) -> None:
    """A SIGKILL or an exit code 137 the script chose is its own end, never an OOM kill (runc and gVisor)."""
    view = execute(runtime_api, "hog = bytearray(8 * 1024 * 1024)\n" + ending, limits={"memory_mb": 64})
    assert _verdict(view) == ("failed", 137, "nonzero_exit"), view
