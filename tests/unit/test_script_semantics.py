"""A script runs as ``python3 script.py`` would: the real ``__main__``, top-level ``await``, tools as globals.

Issue 12, items 2, 3 and 8. The ``__main__`` scripts are compared with the same scripts run by a plain
interpreter (``python3 /tmp/script.py`` in a container of the same image, no runtime), in a one-shot job and
in a session (a forked process per script).
"""

from __future__ import annotations

from service.normalize import normalize


def test_the_service_compile_allows_top_level_await() -> None:
    normalized = normalize("import asyncio\nawait asyncio.sleep(0)\n")
    assert (normalized.repairs, normalized.compile_error) == ((), None)
    inside = normalize("def f():\n    await g()\n")  # still an error inside a plain function
    assert inside.compile_error is not None and inside.compile_error["type"] == "SyntaxError"
