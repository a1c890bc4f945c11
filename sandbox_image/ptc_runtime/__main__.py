"""Run one script: ``python3 -m ptc_runtime [SCRIPT]`` (default ``/run/ptc/script.py``).

The script runs as ``__main__`` in this process, with ``/run/ptc`` first on
``sys.path`` so that ``import tools`` finds the generated package. Its exit
code is the process's. When it ends with an uncaught exception (a
SyntaxError included) the traceback goes to stderr as Python prints it, and
a short description (type, message, line) is sent to the broker so that the
job view can carry it; that report is informational only.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

from ptc_runtime.client import ToolError, client

RUN_DIR = "/run/ptc"
MESSAGE_CAP = 2000


def _report(error: Dict[str, Any]) -> None:
    try:
        client().request({"op": "report", "error": error}, timeout=2.0)
    except ToolError:
        pass


def _script_line(tb: Any, filename: str) -> Optional[int]:
    line = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == filename:
            line = lineno
    return line


def main(argv: List[str]) -> int:
    path = argv[1] if len(argv) > 1 else os.path.join(RUN_DIR, "script.py")
    sys.path.insert(0, os.path.dirname(path) or RUN_DIR)
    sys.argv = [path]
    with open(path, "rb") as f:
        source = f.read()
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        error: Dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)[:MESSAGE_CAP]}
        if isinstance(exc, SyntaxError):
            error.update(
                message=str(exc.msg)[:MESSAGE_CAP],
                line=exc.lineno,
                column=exc.offset,
                text=(exc.text or "").rstrip("\n")[:MESSAGE_CAP] or None,
            )
        _report(error)
        return 1
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as exc:  # the script's own failure: report it like Python would
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb)))
        _report({"type": type(exc).__name__, "message": str(exc)[:MESSAGE_CAP], "line": _script_line(tb, path)})
        return 1
    return 0


def wait_for_job() -> None:
    """Warm-pool mode (``PTC_WAIT_FOR_JOB=1``): import what scripts and stubs need, then wait for ``go``."""
    import asyncio  # noqa: F401 - imported now so that a script's own import is free
    import json  # noqa: F401

    import ptc_runtime.stubs  # noqa: F401

    go = os.path.join(RUN_DIR, "go")
    while not os.path.exists(go):
        time.sleep(0.002)


if __name__ == "__main__":
    if os.environ.get("PTC_WAIT_FOR_JOB") == "1":
        wait_for_job()
    try:
        code = main(sys.argv)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    sys.exit(code)
