"""A one-shot script's output leaves its process line by line: kept at any end, visible while it runs.

Python block-buffers ``sys.stdout`` when it is a pipe (the sandbox's case): a script killed by its time limit,
a stop, the OOM killer or ``os._exit`` would lose every line still in that buffer, and a running job's view
would show nothing until the buffer filled. ``live()`` makes the script's ``sys.stdout`` and ``sys.stderr``
behave as at a terminal: each complete line (and every ``flush()``) is written to the pipe at once, where the
kernel keeps it whatever happens to the script next; a line without its newline waits for the next newline, a
flush or the script's exit, as at a terminal. The cost is one ``write`` system call per line.

The service runs every script (cold, warm pool, session) through the resident interpreter of
``ptc_runtime.session``, whose scripts write into rings shared with it instead (``ptc_runtime.ring``: no system
call per line); ``live()`` serves ``python3 -m ptc_runtime`` run by hand (``docker run``). A process forked
from a session's script writes line by line as here.

Python interpreters the script starts (``subprocess``, multiprocessing's spawn) get ``PYTHONUNBUFFERED=1`` so
that their output, written to the same pipe, is kept too. Other programs buffer as they do anywhere.
"""

from __future__ import annotations

import os
import sys

UNBUFFERED_ENV = {"PYTHONUNBUFFERED": "1"}


def live() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` line-buffered and write-through; set ``UNBUFFERED_ENV``."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True, write_through=True)
            except (OSError, ValueError):  # a closed stream: nothing to keep
                pass
    os.environ.update(UNBUFFERED_ENV)
