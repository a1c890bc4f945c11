"""JavaScript and TypeScript scripts: the forked script process becomes Node.js (``exec``), confined already.

A run's language comes with its ``RUN`` frame (``protocol.LANGUAGE``, Python when absent). For JavaScript and
TypeScript, the spare process (forked, confined and given the run's pipes by ``ptc_runtime.session``, its env applied
from the go) replaces itself with ``node`` running ``js/main.mjs`` on the run's script (``protocol.SCRIPTS``): the
same process, so the server collects it, signals it and kills whatever it started exactly as it does a Python
script's; its output goes to the run's pipes (Node writes pipes synchronously on Linux, so nothing printed is lost at
``process.exit``). The images that can do this carry ``javascript`` and ``typescript`` in their
``io.ptc-sandbox.languages`` label (``sandbox_image/build.sh --node``).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ptc_runtime.protocol import RUN_DIR, SCRIPTS, TYPESCRIPT

NODE = "/usr/bin/node"
MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "js", "main.mjs")
EXIT_CANNOT_RUN = 126


def run(language: str) -> NoReturn:
    """Become ``node`` running the run's script of ``language`` (``javascript`` or ``typescript``); on failure, a
    line on stderr and exit code 126 (as a shell reports a command it cannot run)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    script = os.path.join(RUN_DIR, SCRIPTS[language])
    argv = [NODE]
    if language == TYPESCRIPT:  # stack traces in the lines of the script as sent (its inline source map)
        argv.append("--enable-source-maps")
    argv += [MAIN, script]
    try:
        os.execv(NODE, argv)
    except OSError as exc:
        os.write(2, ("ptc_runtime: cannot run %s scripts in this image (%s: %s)\n" % (language, NODE, exc)).encode())
    os._exit(EXIT_CANNOT_RUN)
