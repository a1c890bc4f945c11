"""A script cannot write its own verdict: the job's ``error`` is what the service observed (service.verdict)."""

from __future__ import annotations

import httpx

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
