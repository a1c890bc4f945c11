"""The control protocol between the service and a sandbox's resident interpreter: its names, once.

Standard library only (nothing at all, in fact): the sandbox image runs it under any Python >= 3.9, and the service
imports it too (``service.sandbox.resident``), so neither side spells an op name, a field or a size of its own.

The service creates the run folder (mounted read-only at ``RUN_DIR`` in the sandbox) with a unix socket
``CONTROL_SOCKET`` listening before it starts the sandbox; the resident interpreter
(``ptc_runtime.session.Server``) connects to it. Each message is one JSON object on one line (UTF-8, ``\\n``
ended), in both directions; ``FIELD_OP`` names its kind:

- sandbox -> service ``HELLO``: ``{"op": "hello", "pid": n}`` once connected;
- service -> sandbox ``RUN``: ``{"op": "run", "id": job_id, "env": {name: value}}``: run the ``SCRIPT`` now in
  the folder (one at a time);
- sandbox -> service ``OUT``: ``{"op": "out", "id": job_id, "stream": "stdout"|"stderr", "n": n}`` followed by
  exactly ``n`` raw bytes of the script's output, ``0 <= n <= MAX_FRAME_BYTES``;
- service -> sandbox ``SIGNAL``: ``{"op": "signal", "id": job_id, "signal": "SIGTERM"|"SIGKILL"}`` (one of
  ``SIGNAL_NAMES``); SIGKILL ends everything of the script;
- sandbox -> service ``EXIT``: ``{"op": "exit", "id": job_id, "exit_code": n, "signal": n|null, "killed": bool,
  "oom_killed": bool, "left": n}`` once the script's process has ended, every other process of the sandbox has
  been killed and all its output sent. ``exit_code`` is 0..255 (128 + N for a death by signal N), ``signal`` the
  signal the process died by (null: it exited), ``killed`` whether that signal is one the sandbox sent at the
  service's request while the script still ran, ``oom_killed`` whether the kernel's OOM killer ended it, and
  ``left`` how many processes were still there after the final SIGKILL (anything but 0 and the service ends the
  sandbox);
- sandbox -> service ``ERROR``: ``{"op": "error", "message": text}`` for a request it cannot follow;
- service -> sandbox ``PING``, answered by ``PONG`` (``{"op": "pong"}``).

The service trusts none of it: a script may have taken the interpreter over (``service.sandbox.resident``
checks every frame and ends the sandbox on anything outside this description).
"""

RUN_DIR = "/run/ptc"
"""Where the run folder appears inside the sandbox."""
CONTROL_SOCKET = "control.sock"
"""The control socket's name in the run folder (the service listens, the sandbox connects)."""
SCRIPT = "script.py"
"""The script of the next run, in the run folder."""
TOOLS_SOCKET = "tools.sock"
"""The broker's socket of the current run, in the run folder (``ptc_runtime.client``)."""
SESSION_ENV = "PTC_SESSION"
"""Set to ``"1"`` in the sandbox's environment: the runtime serves this protocol instead of running one script."""

MAX_FRAME_BYTES = 64 * 1024
"""Most raw bytes one ``OUT`` frame carries."""

FIELD_OP = "op"
HELLO = "hello"
RUN = "run"
OUT = "out"
SIGNAL = "signal"
EXIT = "exit"
ERROR = "error"
PING = "ping"
PONG = "pong"

SIGTERM = "SIGTERM"
SIGKILL = "SIGKILL"
SIGNAL_NAMES = (SIGTERM, SIGKILL)
"""The signals the service may ask for, by name (their numbers are the platform's: 15 and 9 on Linux)."""
STREAMS = ("stdout", "stderr")
"""The ``stream`` of an ``OUT`` frame."""
