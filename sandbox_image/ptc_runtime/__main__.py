"""Run one script: ``python3 -m ptc_runtime [SCRIPT]`` (default ``/run/ptc/script.py``).

Modes: a cold one-shot job runs the script at once; ``PTC_SESSION=1`` serves
a session or a warm-pool sandbox (``ptc_runtime.session``): a resident
interpreter that forks one process per script.

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


def compile_script(path: str) -> Any:
    """The script at ``path`` compiled, or the exception compiling it raised (SyntaxError, ValueError for a
    NUL byte, RecursionError or MemoryError for a pathological expression: never raised, so that a session's
    resident interpreter survives any script)."""
    try:
        with open(path, "rb") as f:
            source = f.read()
        return compile(source, path, "exec", dont_inherit=True)
    except Exception as exc:
        return exc


def main(argv: List[str], compiled: Any = None) -> int:
    """Run the script (``argv[1]``, default ``/run/ptc/script.py``), compiled here unless ``compiled`` is given."""
    path = argv[1] if len(argv) > 1 else os.path.join(RUN_DIR, "script.py")
    sys.path.insert(0, os.path.dirname(path) or RUN_DIR)
    sys.argv = [path]
    code = compile_script(path) if compiled is None else compiled
    if isinstance(code, BaseException):
        exc = code
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


def exit_fast(code: Any) -> None:
    """End the process as the interpreter would (non-daemon threads joined, atexit handlers run, ``SystemExit``'s
    code applied, streams flushed) but without tearing the interpreter down: with the stub library and asyncio
    imported that costs ~10 ms per script for nothing, as the process (or the container) is gone right after."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls at exit to join threads
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        try:
            sys.stderr.write(str(code) + "\n")
        except (OSError, ValueError):
            pass
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    # ``-m`` put the working directory (/tmp) first on sys.path; a script run as ``python3 script.py`` has its
    # own folder there instead (main adds it). Without this, a file a session's script left in /tmp (csv.py,
    # random.py) would shadow the standard library for the scripts after it.
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
    compiled = None
    if os.environ.get("PTC_SESSION") == "1":
        from ptc_runtime.confine import CLEAN_IMPORT_ENV
        from ptc_runtime.session import serve

        run = serve(compile_script)
        if run is None:  # the service closed the session
            sys.exit(0)
        compiled, env = run  # in the forked child of one script: run it like a one-shot job
        os.environ.update(env)
        os.environ.update(CLEAN_IMPORT_ENV)  # never the run's to change (the service refuses PYTHON* names anyway)
        if "TZ" in env:
            import time

            time.tzset()
    else:  # one-shot: this process runs the script itself, as the sandbox user
        from ptc_runtime.confine import drop, no_user_namespaces_filter

        drop(no_user_namespaces_filter(), own_session=False)
        from ptc_runtime.stdio import live

        live()  # each printed line leaves the process at once: kept at any end (a session's child does the same)
    try:
        exit_fast(main(sys.argv, compiled))
    except SystemExit as exc:
        exit_fast(exc.code)
