"""Run one script: ``python3 -m ptc_runtime [SCRIPT]`` (default ``/run/ptc/script.py``).

Modes: a cold one-shot job runs the script at once; ``PTC_SESSION=1`` serves
a session or a warm-pool sandbox (``ptc_runtime.session``): a resident
interpreter that forks one process per script.

The script is this process's ``__main__`` module, as with ``python3 script.py``:
a fresh module named ``__main__`` in ``sys.modules`` with ``__file__`` the
script's path, ``__spec__`` None and ``sys.argv == [path]``, so pickling what
the script defines, process pools (their forked workers inherit it),
``inspect`` and warnings work, and tracebacks show the script's lines.
``/run/ptc`` is first on ``sys.path`` so that ``import tools`` finds the
generated package, and the manifest's tools are also in the script's globals
(``ptc_runtime.stubs.Toolbox.script_globals``; not the names of builtins). A
script with top-level ``await`` (compiled with ``PyCF_ALLOW_TOP_LEVEL_AWAIT``,
its code flagged ``CO_COROUTINE``) runs as a coroutine in a new event loop,
as ``asyncio.run`` would, and the runtime tells the broker so
(``{"op": "report", "ran_as": "coroutine"}``). Its exit code is the process's.
When it ends with an uncaught exception (a SyntaxError included) the traceback goes to stderr as Python prints it, and
a short description (type, message, line) is sent to the broker so that the
job view can carry it; that report is informational only.
"""

from __future__ import annotations

import ast
import builtins
import os
import sys
import traceback
import types
from typing import Any, Dict, List, Optional, Set

from ptc_runtime.client import ToolError, client
from ptc_runtime.protocol import RUN_DIR, SCRIPT, SESSION_ENV

MESSAGE_CAP = 2000
EXIT_KEYBOARD_INTERRUPT = 130  # 128 + SIGINT: how python3 ends on an uncaught KeyboardInterrupt
CO_COROUTINE = 0x0080  # inspect.CO_COROUTINE: a top-level-await script's code (inspect itself costs an import)


def _report(error: Dict[str, Any]) -> None:
    try:
        client().request({"op": "report", "error": error}, timeout=2.0)
    except ToolError:
        pass


def _from_script(tb: Any, filename: str) -> Any:
    """The traceback from the script's first frame on (the runtime's and asyncio's frames before it left out, as
    ``python3 script.py`` shows none); past the runtime's own frame when the script has none (a compile error)."""
    first = tb.tb_next if tb is not None else None
    node = first
    while node is not None and node.tb_frame.f_code.co_filename != filename:
        node = node.tb_next
    return node if node is not None else first


def _script_line(tb: Any, filename: str) -> Optional[int]:
    line = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code.co_filename == filename:
            line = lineno
    return line


def compile_script(path: str) -> Any:
    """The script at ``path`` compiled, or the exception compiling it raised (SyntaxError, ValueError for a
    NUL byte, RecursionError or MemoryError for a pathological expression: never raised, so that a session's
    resident interpreter survives any script).

    The script arrived as text (the service writes it as UTF-8): it is compiled as that text, as the service's own
    compile (its verdict, normalization) sees it, so a coding declaration copied into it (``# -*- coding: latin-1
    -*-``) cannot turn ``'café'`` into ``'cafÃ©'`` or an unknown codec's name into a SyntaxError; a leading
    byte-order mark is dropped, as Python drops it from a file. Bytes that are not UTF-8 compile as bytes."""
    try:
        with open(path, "rb") as f:
            source: Any = f.read()
        try:
            source = source.decode("utf-8-sig")
        except UnicodeDecodeError:
            pass
        return compile(source, path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except Exception as exc:
        return exc


_script_module: Optional[types.ModuleType] = None  # the script's module, once made (``finalize_main``)


def main_module(path: str) -> types.ModuleType:
    """A fresh ``__main__`` module for the script at ``path``, installed as ``sys.modules["__main__"]`` (what
    ``pickle`` and ``multiprocessing`` look names up in), with what ``python3 path`` gives its module."""
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    module.__spec__ = None
    # importlib.machinery.SourceFileLoader, as python3 gives a script, without importing importlib (~1 ms cold)
    source_loader = getattr(sys.modules.get("_frozen_importlib_external"), "SourceFileLoader", None)
    module.__loader__ = source_loader("__main__", path) if source_loader is not None else None
    module.__cached__ = None  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    global _script_module
    _script_module = module
    return module


def referenced_names(code: types.CodeType) -> Set[str]:
    """Every global, attribute or imported name the code and the functions and classes in it refer to
    (``co_names`` of each code object): what decides whether the tools are worth importing."""
    names: Set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return names


_NO_TOOLS = '["aio", "ToolError"]'  # the ``__all__`` of a generated package with no tool (service.toolkit.stubs)


def tool_names(package: str) -> Set[str]:
    """The names the generated ``tools`` package at ``package`` exports (its one-line ``__all__``), read without
    importing it; empty when there is no such package."""
    try:
        with open(os.path.join(package, "__init__.py"), "rb") as f:  # bytes: no text layer made for one line
            for raw in f:
                if raw.startswith(b"__all__ = ["):
                    line = raw.decode("utf-8").split("=", 1)[1].strip()
                    if line == _NO_TOOLS:  # what a manifest with no tools gives: nothing to compile
                        return set()
                    names = ast.literal_eval(line)
                    return {n for n in names if isinstance(n, str)} - {"aio", "ToolError"}
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError):
        pass
    return set()


def offer_tools(module: types.ModuleType, code: types.CodeType) -> bool:
    """Put the manifest's tools into ``module``'s globals (not over a builtin's name), when the script refers to
    one of their names (importing ``tools`` compiles it: ~45 ms for 100 tools, not paid by a script that names
    none, say through ``globals()`` or ``eval`` only); returns whether it did."""
    path = module.__file__ or ""
    builtin_names = vars(builtins)
    wanted = referenced_names(code) - builtin_names.keys()
    if not wanted:  # no tool is offered under a builtin's name: nothing to read (``print(1)``)
        return False
    offerable = tool_names(os.path.join(os.path.dirname(path), "tools")) - builtin_names.keys()
    if not offerable & wanted:
        return False
    offered = _toolbox_call("script_globals")
    for name, value in offered.items():
        if name not in builtin_names and not name.startswith("__"):
            setattr(module, name, value)
    return bool(offered)


def _toolbox_call(method: str) -> Dict[str, Any]:
    """``tools._ptc_toolbox.<method>()`` (``script_globals`` or ``tool_paths``, a fixed table), {} when the
    package cannot be imported or is not a generated one."""
    try:
        import tools  # type: ignore[import-not-found]

        toolbox = tools._ptc_toolbox
        found: Dict[str, Any] = {"script_globals": toolbox.script_globals, "tool_paths": toolbox.tool_paths}[method]()
        return found
    except Exception:  # no package: the script sees no tools, as without a manifest
        return {}


def _report_mode(mode: str) -> None:
    try:
        client().request({"op": "report", "ran_as": mode}, timeout=2.0)
    except ToolError:
        pass


def _hint_tool(exc: NameError) -> None:
    """Append to ``exc``'s message which tool its name is close to (difflib), if any."""
    name = getattr(exc, "name", None)
    if not isinstance(name, str) or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return
    tool_paths = _toolbox_call("tool_paths")
    import difflib

    close = difflib.get_close_matches(name, list(tool_paths), n=3, cutoff=0.7)
    paths = list(dict.fromkeys(tool_paths[c] for c in close))
    if paths:
        exc.args = (exc.args[0] + ". A tool has a close name: " + ", ".join("tools." + p for p in paths),)


def main(argv: List[str], compiled: Any = None) -> int:
    """Run the script (``argv[1]``, default ``/run/ptc/script.py``), compiled here unless ``compiled`` is given."""
    path = argv[1] if len(argv) > 1 else os.path.join(RUN_DIR, SCRIPT)
    sys.path.insert(0, os.path.dirname(path) or RUN_DIR)
    sys.argv = [path]
    code = compile_script(path) if compiled is None else compiled
    if isinstance(code, BaseException):
        exc = code
        exc.__traceback__ = None  # the runtime's compile call is not the script's
        sys.__excepthook__(type(exc), exc, None)  # the interpreter's own printer, as ``python3 script.py`` uses
        error: Dict[str, Any] = {"type": type(exc).__name__, "message": _text(exc)[:MESSAGE_CAP]}
        if isinstance(exc, SyntaxError):
            error.update(
                message=str(exc.msg)[:MESSAGE_CAP],
                line=exc.lineno,
                column=exc.offset,
                text=(exc.text or "").rstrip("\n")[:MESSAGE_CAP] or None,
            )
        _report(error)
        return 1
    module = main_module(path)
    offer_tools(module, code)
    try:
        if code.co_flags & CO_COROUTINE:  # top-level await: run it as asyncio.run would
            import asyncio

            _report_mode("coroutine")
            asyncio.run(eval(code, module.__dict__))  # the code of a top-level-await script makes a coroutine
        else:
            exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # the script's own failure: report it like Python would
        tb = _from_script(exc.__traceback__, path)
        if isinstance(exc, NameError) and not isinstance(exc, UnboundLocalError):
            _hint_tool(exc)
        _print_uncaught(exc, tb)
        _report({"type": type(exc).__name__, "message": _text(exc)[:MESSAGE_CAP], "line": _script_line(tb, path)})
        # The script's frames refer back to this one (f_back), which would hold them in a cycle through ``tb``: the
        # collector finalizes a cycle's objects in any order, and a file the script left open in a frame (its raw
        # file closed first) would lose what it buffered. Without the cycle they go when ``exc`` does, in order.
        del tb
        return EXIT_KEYBOARD_INTERRUPT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _text(exc: BaseException) -> str:
    """``str(exc)``, or what Python prints when that fails (a script's exception may raise in ``__str__``)."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def _print_uncaught(exc: BaseException, tb: Any) -> None:
    """Print an uncaught exception as the interpreter does: through ``sys.excepthook`` (the script may have set its
    own), with the traceback from the script's first frame on; a hook that fails is reported as Python does."""
    exc.__traceback__ = tb
    hook = sys.excepthook
    try:
        hook(type(exc), exc, tb)
    except BaseException as failure:
        if hook is sys.__excepthook__:
            return
        sys.stderr.write("Error in sys.excepthook:\n")
        if failure.__traceback__ is not None:
            failure.__traceback__ = failure.__traceback__.tb_next  # from the hook's frame on
        if failure.__context__ is exc:  # raised while the runtime handled exc: not a context the script made
            failure.__context__ = None
        sys.__excepthook__(type(failure), failure, failure.__traceback__)
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(type(exc), exc, tb)


_CLEAR_NAMES = compile("for name in names: namespace[name] = None", "sys", "exec")


def finalize_main() -> None:
    """Finalize the script's module as the interpreter does at exit, which ``exit_fast`` otherwise skips: its
    globals are set to None (names starting with ``_`` first, ``__builtins__`` kept), so that what only they held
    is finalized: a file the script left open is flushed and closed (a later script of the session reads all of
    it), ``__del__`` methods run. Objects in reference cycles need the collector, which finalizes them in any
    order (a raw file may be closed before its buffer is flushed): when a regular file is still open, every
    buffered writer is flushed, then the collector runs (~25 ms with asyncio imported; skipped otherwise)."""
    import gc

    # No automatic collection from here on: one triggered while the names are cleared would finalize a cycle
    # holding a file in any order, before its buffer is flushed below (the collector's counts are inherited from
    # the resident interpreter, so when that happens depends on the session's history).
    gc.disable()
    namespace = getattr(_script_module, "__dict__", None)  # None: the script did not run (a compile error)
    if isinstance(namespace, dict):
        names = [k for k in namespace if isinstance(k, str) and k.startswith("_") and k != "__builtins__"]
        names += [k for k in namespace if not (isinstance(k, str) and k.startswith("_"))]
        # Run as code of a file named "sys", line 1: a warning raised by a finalizer (a coroutine never awaited)
        # is attributed as CPython attributes it at exit ("sys:1: RuntimeWarning: ..."), not to this module.
        exec(_CLEAR_NAMES, {"names": names, "namespace": namespace})
    if _regular_file_open():  # flush before collecting: the collector may close a raw file before its buffer
        import io

        for obj in gc.get_objects():
            if isinstance(obj, (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)):
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:
                    pass
        gc.collect()


def _regular_file_open() -> bool:
    """Whether the process holds a descriptor of a regular file (other than 0-2)."""
    import stat

    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        return True
    for fd in fds:
        if fd > 2:
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    return True
            except OSError:
                continue
    return False


def exit_fast(code: Any) -> None:
    """End the process as the interpreter would (non-daemon threads joined, the script's open matplotlib figures
    saved: ``ptc_runtime.charts``, atexit handlers run, ``SystemExit``'s code applied, streams flushed) but without
    tearing the interpreter down: with the stub library and asyncio imported that costs ~10 ms per script for
    nothing, as the process (or the container) is gone right after."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls at exit to join threads
    if shutdown is not None:
        shutdown()
    if "matplotlib.pyplot" in sys.modules:  # the open figures, as PNG files out, before pyplot's atexit closes them
        from ptc_runtime.charts import save_figures

        save_figures()
    atexit._run_exitfuncs()
    finalize_main()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF if -(1 << 63) <= code < 1 << 63 else 255  # past a C long: -1, as CPython exits
    else:
        for text in (code, "\n"):  # the line break even when str() of the script's object fails, as CPython
            try:
                sys.stderr.write(str(text))
            except Exception:
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
    if os.environ.get(SESSION_ENV) == "1":
        from ptc_runtime.confine import CLEAN_IMPORT_ENV, set_env
        from ptc_runtime.session import serve

        run = serve()
        if run is None:  # the service closed the session
            sys.exit(0)
        compiled, env, _ = run  # in the forked child of one script (a Python one): run it like a one-shot job
        set_env(env)
        set_env(CLEAN_IMPORT_ENV)  # never the run's to change (the service refuses PYTHON* names anyway)
        if "TZ" in env:
            import time

            time.tzset()
    else:  # one-shot: this process runs the script itself, as the sandbox user
        from ptc_runtime.confine import drop, no_user_namespaces_filter

        drop(no_user_namespaces_filter(), own_session=False)
        from ptc_runtime.stdio import live

        live()  # each printed line leaves the process at once: kept at any end (a session's child: ptc_runtime.ring)
    try:
        exit_fast(main(sys.argv, compiled))
    except SystemExit as exc:
        exit_fast(exc.code)
