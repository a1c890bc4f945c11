"""The control protocol between the service and a sandbox's resident interpreter: its names, once.

Standard library only (nothing at all, in fact): the sandbox image runs it under any Python >= 3.9, and the service
imports it too (``service.sandbox.resident``), so neither side spells an op name, a field or a size of its own.

The service creates the run folder (mounted read-only at ``RUN_DIR`` in the sandbox) with a unix socket
``CONTROL_SOCKET`` listening before it starts the sandbox; the resident interpreter
(``ptc_runtime.session.Server``) connects to it. Each message is one JSON object on one line (UTF-8, ``\\n``
ended), in both directions; ``FIELD_OP`` names its kind:

- sandbox -> service ``HELLO``: ``{"op": "hello", "pid": n, "features": [...]}`` once connected (``features``:
  ``FEATURE_FILES`` when it serves the file requests below; older runtimes send none);
- service -> sandbox ``RUN``: ``{"op": "run", "id": job_id, "env": {name: value}}``: run the ``SCRIPT`` now in
  the folder (one at a time; with ``"language": name``, the script of that language, ``SCRIPTS``); to a runtime
  whose hello lists ``FEATURE_ENV_FILE`` the service sends ``"env_file": ENV_FILE`` instead of ``"env"`` and
  writes the env (one JSON object) to that file in the run folder, removed once the run has ended: the script's
  own process reads it, so that no run's env passes through the resident interpreter, whose memory every later
  script of the session inherits;
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

Files (``ptc_runtime.files``; images whose label lists ``files``), only while no script runs (the service holds the
sandbox's turn); each answered by ``DONE`` ``{"op": "done", "id": rid, "error": null|code, "message": text}``
(``error`` one of ``ptc_runtime.files.ERRORS``):

- service -> sandbox ``PUT``: ``{"op": "put", "id": rid, "files": [{"path": p, "source": name}]}``: write each
  file of ``FILES_DIR`` in the run folder named ``source`` to ``p`` under the working directory (in order; the
  first failure ends it: ``"index": i`` in the answer);
- service -> sandbox ``GET``: ``{"op": "get", "id": rid, "path": p, "max_bytes": n}``: ``DATA`` frames
  ``{"op": "data", "id": rid, "n": n}`` + n raw bytes (``0 <= n <= MAX_FRAME_BYTES``) of that file, then ``DONE``
  with ``"bytes": total`` (``too_large`` and no data past ``max_bytes``);
- service -> sandbox ``LIST``: ``{"op": "list", "id": rid, "max_entries": n}``: one ``ENTRY`` frame
  ``{"op": "entry", "id": rid, "path": p, "bytes": n|null, "skipped": reason|null}`` per entry of the working
  directory (at most ``max_entries``), then ``DONE`` with ``"truncated": bool``.

Outputs: a ``RUN`` with ``"outputs": {"max_files": n, "max_bytes": n}`` (images listing ``files``) has, once the
script has ended and its output is all sent, and before ``EXIT``, everything under ``outputs/`` in the working
directory sent: per regular file a ``FILE`` frame ``{"op": "file", "id": job_id, "path": p}`` then its bytes in
``DATA`` frames; per entry left out a ``SKIPPED`` frame ``{"op": "skipped", "id": job_id, "path": p, "reason":
text}`` (a symlink, a fifo, or past a cap: ``"cap"``); ``EXIT`` then carries ``"files_omitted": n``. The folder
is emptied after (each script's outputs are its own).

The service trusts none of it: a script may have taken the interpreter over (``service.sandbox.resident``
checks every frame and ends the sandbox on anything outside this description).
"""

RUN_DIR = "/run/ptc"
"""Where the run folder appears inside the sandbox."""
CONTROL_SOCKET = "control.sock"
"""The control socket's name in the run folder (the service listens, the sandbox connects)."""
SCRIPT = "script.py"
"""The script of the next run, in the run folder (a Python run's: ``SCRIPTS``)."""
PYTHON = "python"
JAVASCRIPT = "javascript"
TYPESCRIPT = "typescript"
LANGUAGES = (PYTHON, JAVASCRIPT, TYPESCRIPT)
"""The script languages a ``RUN`` may name (its ``LANGUAGE`` field; Python when absent)."""
SCRIPTS = {PYTHON: SCRIPT, JAVASCRIPT: "script.mjs", TYPESCRIPT: "script.ts"}
"""The script of a run in each language, in the run folder."""
JS_TOOLS = "tools.mjs"
"""The generated tools module of a JavaScript or TypeScript run, in the run folder (what ``import "tools"`` gives)."""
LANGUAGE = "language"
"""A ``RUN``'s field: the script's language (one of ``LANGUAGES``), to runtimes whose hello lists
``FEATURE_LANGUAGES``."""
LANGUAGES_LABEL = "io.ptc-sandbox.languages"
"""The image label listing the script languages it runs (comma-separated); absent: Python only."""
TOOLS_SOCKET = "tools.sock"
"""The broker's socket of the current run, in the run folder (``ptc_runtime.client``)."""
FILES_DIR = ".files-in"
"""The folder of a ``PUT``'s sources in the run folder (written by the service, read by the sandbox; removed after;
not a name ``import`` can reach, though the run folder is on a script's ``sys.path``)."""
SCRIPT_UID_ENV = "PTC_SCRIPT_UID"
"""In the sandbox's environment: the uid (and gid) its scripts run as, one of the image's ``UIDS_LABEL`` range that
the service gave this sandbox alone; absent: ``ptc_runtime.confine.SCRIPT_UID`` (10001). Not in a script's."""
UIDS_LABEL = "io.ptc-sandbox.uids"
"""The image label naming the uids its ``/etc/passwd`` lists as ``sandbox`` users (``"first-last"``, inclusive)."""
SESSION_ENV = "PTC_SESSION"
"""Set to ``"1"`` in the sandbox's environment: the runtime serves this protocol instead of running one script."""

MAX_FRAME_BYTES = 64 * 1024
"""Most raw bytes one ``OUT`` frame carries."""

FEATURE_FILES = "files"
"""A ``HELLO``'s feature: the runtime serves ``PUT``/``GET``/``LIST`` and sends a run's outputs."""
FEATURE_LANGUAGES = "languages"
"""A ``HELLO``'s feature: the runtime takes a ``RUN``'s ``LANGUAGE`` (and runs the languages its image's
``LANGUAGES_LABEL`` lists)."""
FEATURE_ENV_FILE = "env_file"
"""A ``HELLO``'s feature: the runtime takes a ``RUN``'s env from ``ENV_FILE`` (its ``"env_file"`` field)."""
ENV_FILE = ".run-env.json"
"""The run's env in the run folder (``FEATURE_ENV_FILE``): written by the service before the ``RUN``, read by the
script's process (as the sandbox user: mode 0644), removed when the run ends. Not a name ``import`` can reach."""

FIELD_OP = "op"
HELLO = "hello"
RUN = "run"
OUT = "out"
SIGNAL = "signal"
EXIT = "exit"
ERROR = "error"
PING = "ping"
PONG = "pong"
PUT = "put"
GET = "get"
LIST = "list"
DONE = "done"
DATA = "data"
ENTRY = "entry"
FILE = "file"
SKIPPED = "skipped"

SIGTERM = "SIGTERM"
SIGKILL = "SIGKILL"
SIGNAL_NAMES = (SIGTERM, SIGKILL)
"""The signals the service may ask for, by name (their numbers are the platform's: 15 and 9 on Linux)."""
STREAMS = ("stdout", "stderr")
"""The ``stream`` of an ``OUT`` frame."""
