"""JavaScript and TypeScript scripts: a script's spare process becomes Node.js (``exec``), confined already.

A run's language comes with its ``RUN`` frame (``protocol.LANGUAGE``, Python when absent). The resident interpreter
(``ptc_runtime.session``) forks each script's process ahead of its run (the spare), of the language of the run before
it; a JavaScript or TypeScript spare, once confined and given the run's pipes, replaces itself with ``node`` running
``js/main.mjs``, which prepares what it can (its module hooks, the tools runtime) and then waits for the run's go on
fd 3 (``GO_FD``: the env, or the env file to read, and the language), so that Node's start-up (~40 ms, several
times that under gVisor) is off the run's path. A run of another language than its spare's gets a spare forked then.
It is the same process, so the server collects it, signals it and kills whatever it started exactly as it does a
Python script's; its output goes to the run's pipes (Node writes pipes synchronously on Linux, so nothing printed is
lost at ``process.exit``). Images that can do this list ``javascript`` and ``typescript`` in their
``io.ptc-sandbox.languages`` label (``sandbox_image/build.sh --node``).
"""

from __future__ import annotations

import os
from typing import NoReturn

from ptc_runtime.protocol import PYTHON

NODE = "/usr/bin/node"
MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "js", "main.mjs")
GO_FD = 3
EXIT_CANNOT_RUN = 126


def kind(language: str) -> str:
    """The kind of process that runs ``language``'s scripts: ``python`` (the resident interpreter, forked) or ``node``
    (JavaScript and TypeScript alike: the script's language comes with the go)."""
    return "python" if language == PYTHON else "node"


def spare(go: int) -> NoReturn:
    """Become ``node`` waiting for its run's go on ``GO_FD`` (``go``: the go pipe's read end); on failure, a line on
    stderr and exit code 126 (as a shell reports a command it cannot run), which is the run's end."""
    try:
        if go != GO_FD:
            os.dup2(go, GO_FD)
            os.close(go)
        os.set_inheritable(GO_FD, True)
        os.execv(NODE, [NODE, MAIN])
    except OSError as exc:
        os.write(2, ("ptc_runtime: cannot run JavaScript in this image (%s: %s)\n" % (NODE, exc)).encode())
    os._exit(EXIT_CANNOT_RUN)
