"""A script cannot write its own verdict: the job's ``error`` is what the service observed (service.verdict)."""

from __future__ import annotations

import httpx

from service.normalize import normalize, verdict_only
from service.verdict import failure
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


def test_failure_prefers_the_compile_verdict_and_labels_the_report() -> None:
    report = {"type": "ValueError", "message": "real", "line": 3}
    assert failure(1, normalize("print(1)\n"), report) == {
        "type": "nonzero_exit",
        "message": "the script exited with code 1",
        "script_report": report,
    }
    assert failure(2, None, None) == {"type": "nonzero_exit", "message": "the script exited with code 2"}
    assert "128+15: killed by SIGTERM" in failure(143, None, None)["message"]
    broken = failure(1, verdict_only("def f(:\n"), {"type": "Forged", "message": "x"})
    assert (broken["type"], broken["line"], broken["script_report"]["type"]) == ("SyntaxError", 1, "Forged")
    assert "hint" in failure(1, normalize("```python\nprint(1)\n```\n```python\nprint(2)\n```\n"), None)
