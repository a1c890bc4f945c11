"""A script cannot write its own verdict: the job's ``error`` is what the service observed (service.verdict)."""

from __future__ import annotations

from service.normalize import normalize, verdict_only
from service.verdict import failure


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
