"""Session mode (``PTC_SESSION=1``): a resident interpreter that forks one process per script.

The service creates the session's folder (mounted read-only at ``/run/ptc``)
with a listening unix socket ``control.sock`` before it starts the sandbox;
this server connects to it and then does what the service asks, one script
at a time. Before each run the service writes the run's ``script.py`` and
``tools`` package into the folder and listens on its ``tools.sock`` (the same
layout as a one-shot job), so a script sees exactly what it would see cold.

Control protocol (its names and sizes live in ``ptc_runtime.protocol``): one JSON object per line both ways.

- server -> service: ``{"op": "hello", "pid": n}`` once connected;
- service -> server: ``{"op": "run", "id": job_id, "env": {...}}``;
- server -> service: ``{"op": "out", "id": job_id, "stream": "stdout"|"stderr", "n": n}``
  followed by exactly n raw bytes of the script's output (n <= ``READ_BYTES``);
- service -> server: ``{"op": "signal", "id": job_id, "signal": "SIGTERM"|"SIGKILL"}``;
- server -> service: ``{"op": "exit", "id": job_id, "exit_code": n, "signal": n|null, "killed": bool,
  "oom_killed": bool, "left": n, "files_omitted": n, "stamps": {...}}``
  once the script's process has ended, every other process of the sandbox
  has been killed and all output has been sent; ``signal`` is the signal the
  script's process died by (null: it exited), ``killed`` whether that signal
  is one this server sent at the service's request while the process was
  still alive (a request that arrives after the script ended is ignored, so
  an exit of its own is never reported as killed); ``left`` counts the
  processes still listed after ``KILL_DEADLINE_S`` (anything but 0 and the
  service ends the sandbox); ``stamps`` gives the run's moments in ``time.monotonic_ns()``
  (``run_received``, ``go_sent``: its process released, ``script_ended``: collected, ``reaped``: the rest
  killed, ``drained``: output taken), for the service's per-stage timing only; ``{"op": "error", "message": ...}`` for a
  request it cannot follow.

Each script runs in a process forked ahead of its run: when no script runs and none is waiting, the server forks
the next one (the spare), which confines itself (``ptc_runtime.confine.drop``: its own session, the sandbox user
10001 with no capability, dumpable, the OOM killer's first choice, no user namespaces, a clean import path for its
subprocesses), takes the run's pipes as stdout and stderr and its rings, and then waits, running nothing else,
for its run frame. So a run's critical path holds neither the fork nor the confinement (~3 ms of page faults on a
virtual machine): on the ``run`` frame the server sends the spare its go (the go pipe), the spare reads the run's
``env`` from the run folder's env file (``protocol.ENV_FILE``; from the go itself for an older service) and applies
it and returns from ``serve`` so that ``__main__`` compiles and runs the script exactly as a one-shot job
runs its script. The spare is forked from the server after the previous run ended (every process of it killed and
gone), so it holds nothing of any script, and it is the only process besides the server between runs; a spare
that ended before its run (the OOM killer, a failed confinement) is replaced at the run frame by one forked then,
whose end, if it ends too, is the run's. ``exit_code`` follows the shell convention: the exit status, or 128 + N
for a death by signal N.

Output is live and kept. The child's ``sys.stdout`` and ``sys.stderr`` write into a ring per stream
(``ptc_runtime.ring``: ``STDOUT_RING_BYTES``, ``STDERR_RING_BYTES``), an anonymous shared mapping this server makes
before it forks the spare: a print is a copy into memory the server keeps whatever ends the script, with no system
call (a ``write`` per line cost ~20 us under gVisor). Everything else that writes fds 1 and 2 (subprocesses, forked
processes, ``os.write``) writes the pipes, as before. The server takes both in passes: per stream, it reads the
ring's ``HEAD``, then the pipe (at most its capacity: what was in it when the pass began), then the ring up to that
``HEAD``, and sends them in frames of at most ``READ_BYTES``; the child empties its rings before anything that lets
another writer write its fds (the order rule: ``ptc_runtime.ring``). While output flows a pass runs every ``REST_S``
(sooner after a pipe was half full), so that many short lines cost one wake-up and a few frames per pass. A pass
that finds nothing sets the rings' ``ASLEEP`` flag, watches the pipes and sleeps up to ``IDLE_S``: the script's next
write nudges the server awake (one byte on the nudge pipe), a pipe's data wakes it too. A run starts as if output
flowed (``ASLEEP`` clear, the first pass ``REST_S`` after its go), so that a short script's output goes with its
``exit``, in one write (``Server.corked``), with no nudge and no wake-up before. A printed line therefore
reaches the service within about ``REST_S`` (``IDLE_S`` at worst). A full ring makes the script wait for the
server's ack (back-pressure, like a full pipe). The stdout pipe is enlarged to ``STDOUT_PIPE_BYTES`` where the
kernel allows it (the pages count against the creating user's ``pipe-user-pages-soft``, 64 MiB by default, shared
with that user's other processes on the host: 1 MiB per running script, set at its run frame, never for a spare
waiting; past it the kernel refuses and the pipe keeps its 64 KiB). At any end of the script (exit, signal, the OOM
killer, ``os._exit``) the server, after ``kill(-1)``, reads each pipe to its end and then takes what the ring still
holds (the mapping outlives the child) before it sends ``exit``. The script cannot hurt the server through the
mapping: the server keeps its own ``TAIL`` and bounds everything it reads (``ptc_runtime.ring.RingReader``). The
rings are the script's memory (1.25 MiB at most, counted in its memory limit) for the run only (made with its spare,
released at the run's end).

The server is the container's init (pid 1) and, when the service starts the
sandbox as root with only ``CAP_SETUID``/``CAP_SETGID``/``CAP_KILL`` (images
labelled ``privsep``), stays root while every script runs as 10001: no script
can signal it, ptrace it or open its ``/proc`` files, under runc (which also
drops signals sent to a namespace's init from inside it) and gVisor (which
does not) alike. It also makes itself not dumpable, and its fd 0 ``/dev/null``. It collects every orphan.

No run's data passes through its memory, which every later script's process inherits (fork): a run's env is read
by the script's own process (the env file), files put in are copied by the kernel (``files.write_file``:
``sendfile``). It imports the image's ``PTC_PRELOAD`` modules as the sandbox user (effective uid and gid 10001),
so whatever they make under ``/tmp`` (matplotlib's config folder and font cache) is the scripts' to write.

Nothing of a script outlives it. When the script's process has ended (or is
to be killed), the server sends SIGKILL to every other process with
``kill(-1)`` (the kernel's list, not names or ``/proc`` states: a process whose
main thread has exited shows as a zombie there but is killed like any other),
collects them, and checks that ``/proc`` lists nothing but itself; what is
still listed after ``KILL_DEADLINE_S`` is reported (``left``). Files under the
working directory (``/tmp``) do outlive the script.

Files (``ptc_runtime.files``; the hello lists ``files``): between runs the server answers ``put``, ``get`` and
``list`` (files in, a session's files), and a run whose ``run`` frame carries ``outputs`` has its ``outputs/``
folder made before its script is released (its go) and sent, after ``kill(-1)`` and its output, before ``exit``
(then emptied). All of it is done with the effective user switched to 10001 and with no symlink followed, while no
script runs (a spare only waits for its go; a run that left processes behind has no outputs sent: the service ends
that sandbox anyway).

``oom_killed`` says the kernel's OOM killer ended the script: its process died
by SIGKILL, not one this server sent first, and the memory cgroup's
``oom_kill`` counter (``memory.events`` on cgroup v2,
``memory/memory.oom_control`` on v1, which a script cannot write) rose during
the run (for the service's own SIGKILL: before it was sent). A script that
exits by itself is never OOM-killed, whatever its children met. Where no
counter is readable (gVisor) it is never claimed: a SIGKILL proves nothing,
and gVisor's OOM kill ends the whole sandbox, which the engine reports.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ptc_runtime import files, node, protocol
from ptc_runtime.confine import (
    drop,
    install_filter,
    no_user_namespaces_filter,
    prepare,
    script_env,
    script_ids,
    set_dumpable,
    set_env,
)
from ptc_runtime.ring import (
    STDERR_RING_BYTES,
    STDOUT_RING_BYTES,
    Ring,
    RingReader,
    Streams,
    hook,
    install,
    make_streams,
)
from ptc_runtime.stdio import UNBUFFERED_ENV

CONTROL_SOCKET = os.path.join(protocol.RUN_DIR, protocol.CONTROL_SOCKET)
SCRIPT = os.path.join(protocol.RUN_DIR, protocol.SCRIPT)
READ_BYTES = protocol.MAX_FRAME_BYTES  # a read of a pipe or a ring is one output frame at most
CORK_BYTES = 64 * 1024  # frames kept at most before a corked send (``Server.corked``) writes them
REST_S = 0.01  # while output flows, how long the rings and pipes are left to fill between passes
IDLE_S = 0.1  # a pass that found nothing: the longest sleep (bounds a printed line's delay should a nudge be missed)
F_SETPIPE_SZ = 1031
F_GETPIPE_SZ = 1032
STDOUT_PIPE_BYTES = 1024 * 1024  # measured: 100,000 prints of 100 bytes ~3x faster than with 64 KiB (bench)
DEFAULT_PIPE_BYTES = 64 * 1024
KILL_DEADLINE_S = 2.0  # how long the end of a run waits for the killed to be gone before it gives up on the sandbox
DRAIN_S = 2.0
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
PRELOAD_ENV = "PTC_PRELOAD"  # the image's modules to import before forking: "numpy,pandas" (``preload``)
SIGNALS = {protocol.SIGTERM: signal.SIGTERM, protocol.SIGKILL: signal.SIGKILL}
WORKDIR = "/tmp"  # the scripts' working directory (the image's WORKDIR): files in go there, outputs come from there
FILE_OPS = (protocol.PUT, protocol.GET, protocol.LIST)
SPARE_LANGUAGE_ENV = "PTC_SPARE_LANGUAGE"  # the image's language of the first spare (the node image: javascript)
Child = Tuple[Any, Dict[str, str], str]
"""What ``serve`` returns in a script's forked process once its run starts: (None, the run's env, its language)."""


def oom_kills() -> Optional[int]:
    """The memory cgroup's ``oom_kill`` counter, or None when no counter is readable."""
    for path in OOM_COUNTERS:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def others() -> List[str]:
    """Every process of the sandbox but this one (which is its init), alive or a zombie not yet collected, as
    the kernel lists them: ``/proc`` of the sandbox's pid namespace, which a script cannot hide a process from."""
    keep = {str(os.getpid()), "1"}  # "1": the init, should the interpreter not be it
    return [name for name in os.listdir("/proc") if name.isdigit() and name not in keep]


def kill_all_once() -> None:
    """kill(-1, SIGKILL) from the sandbox's init: the kernel sends it to every process of the pid namespace (and
    those below it) but the caller, whatever their state or name; ``CAP_KILL`` reaches the sandbox user's."""
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:  # ESRCH: nobody else there
        pass


def ended_children() -> Iterator[Tuple[int, int]]:
    """(pid, wait status) of every child that has ended, collected now (never blocks)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


class _Stream:
    """One output stream of the running script: its pipe (for subprocesses and anything writing the fd) and its
    ring (the script's own ``sys.stdout``/``sys.stderr``, ``ptc_runtime.ring``)."""

    def __init__(self, name: str, pipe: int, ring: Ring) -> None:
        self.name = name
        self.pipe: Optional[int] = pipe  # read end (non-blocking); None once at its end
        self.size = DEFAULT_PIPE_BYTES  # the pipe's capacity (bytes)
        self.ring = ring
        self.reader = RingReader(ring)


class _Run:
    """A script's process: forked ahead of its run (the spare: waiting for its ``go``), then the script running
    now, with its output streams and how it is being ended."""

    def __init__(self, pid: int, streams: List[_Stream], nudge: int, ack: int, go: int) -> None:
        self.job_id = ""  # the run's id, from its run frame on
        self.pid = pid
        self.streams = streams
        self.nudge: Optional[int] = nudge  # read end of the nudge pipe (in the selector once it runs); None at its end
        self.ack = ack  # write end of the ack pipe (non-blocking)
        self.go: Optional[int] = go  # write end of the go pipe (blocking); None once the run's env was sent
        self.watching = False  # whether the pipes are in the selector (between passes they rest)
        self.next_pass = 0.0  # time.monotonic() of the next pass over the streams
        self.oom_before: Optional[int] = None  # the memory cgroup's oom_kill counter when its run started
        self.oom_at_kill: Optional[int] = None  # the counter when the service's SIGKILL was sent
        self.sent: List[int] = []  # signals sent at the service's request while the process was alive
        self.outputs: Optional[Dict[str, Any]] = None  # the run's caps on files out (None: the service wants none)
        self.status: Optional[int] = None
        self.stamps: Dict[str, int] = {}  # time.monotonic_ns() of the run's moments (the exit frame's "stamps")
        self.script_streams: Optional[Streams] = None  # its sys.stdout and sys.stderr, made here before the fork
        self.language = protocol.PYTHON  # what it runs: Python (this interpreter, forked) or node (``spare``)

    def ended(self) -> bool:
        """Whether the script's process has ended (collected, or a zombie not collected yet)."""
        if self.status is not None:
            return True
        try:  # WNOWAIT: leave it to collect(), which keeps its wait status
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        except OSError:
            return False
        return info is not None and info.si_pid == self.pid


class Server:
    """The session's resident interpreter (see the module docstring)."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.buffer = b""
        self.run: Optional[_Run] = None
        self.spare: Optional[_Run] = None  # the next script's process, confined and waiting for its run frame
        # The language of the next spare: the last run's (a session's scripts share one), at first the image's
        # ``SPARE_LANGUAGE_ENV`` (the node image: javascript), else Python. A JavaScript or TypeScript spare is node
        # itself, started and waiting for its go (``ptc_runtime.node``): its start-up is off the run's path.
        self.spare_language = os.environ.get(SPARE_LANGUAGE_ENV, protocol.PYTHON)
        if self.spare_language not in protocol.LANGUAGES:
            self.spare_language = protocol.PYTHON
        self.wake_r, self.wake_w = os.pipe()
        self.cork: Optional[List[bytes]] = None  # frames kept to go out in one write (``corked``)
        self.cork_bytes = 0
        self.filter = no_user_namespaces_filter()
        prepare(self.filter)
        # The filter on this interpreter itself (it makes no user namespace either): every script's process, forked
        # from it, inherits it, so none installs its own (``drop`` with None). Where the kernel refuses it here,
        # each script's process installs it, as before.
        if install_filter(self.filter):
            self.filter = None
        script_ids()  # the scripts' user, read (and checked: ValueError) once, before any fork
        # Every script's environment, set once here, where each fork inherits it (changed in a script's process, each
        # change would copy pages of this interpreter's memory there): the environment a one-shot job's script sees
        # (``script_env``: no ``PTC_SCRIPT_UID``, the clean import path; no ``PTC_SESSION``), and Python interpreters
        # it starts write each line to the pipe at once (``UNBUFFERED_ENV``).
        script_env()
        set_env(UNBUFFERED_ENV, (protocol.SESSION_ENV,))
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def send(self, message: Dict[str, Any], payload: bytes = b"") -> None:
        """Send one frame; while corked (``corked``), keep it to go out with the others in one write."""
        frame = json.dumps(message).encode() + b"\n" + payload
        if self.cork is None:
            self.control.sendall(frame)
            return
        self.cork.append(frame)
        self.cork_bytes += len(frame)
        if self.cork_bytes >= CORK_BYTES:
            self.flush_cork()

    def flush_cork(self) -> None:
        """Send the frames kept so far, in one write."""
        if self.cork:
            frames, self.cork[:] = b"".join(self.cork), []
            self.cork_bytes = 0
            self.control.sendall(frames)

    @contextlib.contextmanager
    def corked(self) -> Iterator[None]:
        """Frames sent inside go out together when it ends (or each ``CORK_BYTES``): the output a pass or the end of
        a run finds and the ``exit`` after it cost the service one read, not one per frame."""
        if self.cork is not None:  # corked already: the outer one sends
            yield
            return
        self.cork, self.cork_bytes = [], 0
        try:
            yield
        finally:
            try:
                self.flush_cork()
            finally:
                self.cork = None

    def serve(self) -> Optional[Child]:
        """Follow the service until it hangs up (returns None); in a forked child, return (None, env, language) once
        its run starts (``__main__`` compiles and runs the script)."""
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # The server is the container's init (pid 1): the kernel delivers it, from inside the sandbox, only the
        # signals it has a handler for, so a script can neither kill nor stop it. SIGINT's handler is dropped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        features = [protocol.FEATURE_FILES, protocol.FEATURE_ENV_FILE, protocol.FEATURE_LANGUAGES]
        self.send({protocol.FIELD_OP: protocol.HELLO, "pid": os.getpid(), "features": features})
        while True:
            if self.run is None and self.spare is None:  # no script's process exists: fork the next one now
                child = self.spawn(self.spare_language)
                if child is not None:
                    return child
            due = False
            for key, _ in self.selector.select(self.pass_timeout()):
                if key.data == "control":
                    data = self.control.recv(READ_BYTES)
                    if not data:
                        self.end_run(hung_up=True)
                        if self.spare is not None:
                            kill_all_once()
                            self.collect()
                        return None
                    self.buffer += data
                    while b"\n" in self.buffer:
                        line, self.buffer = self.buffer.split(b"\n", 1)
                        child = self.handle(line)
                        if child is not None:
                            return child
                elif key.data == "wake":
                    try:
                        os.read(self.wake_r, READ_BYTES)
                    except BlockingIOError:
                        pass
                    self.reap()
                elif key.data == "nudge":
                    self.read_nudges()
                    due = True
                else:  # a pipe has data while the streams sleep
                    due = True
            run = self.run
            if run is not None and (due or time.monotonic() >= run.next_pass):
                self.take_pass(run)

    def handle(self, line: bytes) -> Optional[Child]:
        try:
            request = json.loads(line)
            op = request[protocol.FIELD_OP]
        except (ValueError, KeyError, TypeError):
            self.send({protocol.FIELD_OP: protocol.ERROR, "message": "unreadable request"})
            return None
        if op == protocol.RUN:
            if self.run is not None:
                self.send({protocol.FIELD_OP: protocol.ERROR, "message": "a script is running already"})
                return None
            outputs = request.get("outputs")
            # The env file: read by the script's process itself (``wait_for_go``), never by this one.
            go: Dict[str, Any] = {"env": dict(request.get("env") or {})}
            if request.get("env_file") == protocol.ENV_FILE:
                go = {"env_file": os.path.join(protocol.RUN_DIR, protocol.ENV_FILE)}
            language = request.get(protocol.LANGUAGE, protocol.PYTHON)
            if language not in protocol.LANGUAGES:
                self.send({protocol.FIELD_OP: protocol.ERROR, "message": "unknown language"})
                return None
            go[protocol.LANGUAGE] = language
            return self.start(str(request["id"]), go, outputs if isinstance(outputs, dict) else None)
        if op in FILE_OPS:
            if self.run is not None:
                message = {"error": files.FAILED, "message": "a script is running"}
                self.send({protocol.FIELD_OP: protocol.DONE, "id": str(request.get("id")), **message})
                return None
            files.serve_request(request, self.send, WORKDIR, protocol.RUN_DIR, switch_user=os.geteuid() == 0)
            return None
        if op == protocol.SIGNAL and self.run is not None and request.get("id") == self.run.job_id:
            self.send_signal(self.run, SIGNALS.get(request.get("signal"), signal.SIGKILL))
            return None
        if op == protocol.PING:
            self.send({protocol.FIELD_OP: protocol.PONG})
        return None

    def send_signal(self, run: _Run, number: int) -> None:
        """Send the service's signal to the script (SIGKILL: to every process of the sandbox). A script that has
        ended already is left alone: its end is its own (``end_run`` follows from SIGCHLD)."""
        if run.ended():
            return
        run.sent.append(number)
        if number == signal.SIGKILL:  # everything of the script: the end of the run checks that it is gone
            run.oom_at_kill = oom_kills()
            kill_all_once()
            return
        try:
            os.killpg(run.pid, number)
        except ProcessLookupError:  # forked but not yet in its own process group (confine.drop: setsid)
            try:
                os.kill(run.pid, number)
            except OSError:
                pass
        except OSError:
            pass

    def spawn(self, language: str) -> Optional[Child]:
        """Fork the next script's process now, while no script runs (``spare``): it confines itself, takes the
        run's pipes and rings and waits for its run frame's ``go`` (``wait_for_go``). Returns None in the server;
        in the child, (None, env, language) once its run starts."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        nudge_r, nudge_w = os.pipe()
        ack_r, ack_w = os.pipe()
        go_r, go_w = os.pipe()
        rings = [Ring(STDOUT_RING_BYTES), Ring(STDERR_RING_BYTES)]
        # ``ASLEEP`` clear (a new mapping is zeros): the run starts as if output flowed, its first pass ``REST_S``
        # after the go (the module docstring).
        script_streams = make_streams(rings, nudge_w, ack_r)  # made here: the child only puts them in place
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            for fd in (out_r, err_r, nudge_r, ack_w, go_w):
                os.close(fd)
            self.become_child(out_w, err_w, script_streams)
            if language != protocol.PYTHON:
                node.spare(go_r)  # becomes node, which waits for its go itself; never returns
            env, asked = wait_for_go(go_r)
            if asked != protocol.PYTHON:  # a Python spare is never given another language's run (``start``)
                os.write(2, ("ptc_runtime: a Python process was given a %s run\n" % asked[:20]).encode())
                os._exit(126)
            return None, env, asked
        for fd in (out_w, err_w, nudge_w, ack_r, go_r):
            os.close(fd)
        streams = [_Stream("stdout", out_r, rings[0]), _Stream("stderr", err_r, rings[1])]
        for fd in (out_r, err_r, nudge_r, ack_w):
            os.set_blocking(fd, False)
        self.spare = _Run(pid, streams, nudge_r, ack_w, go_w)
        self.spare.language = language
        # Kept until the run ends (``close_run``): let go of now, they would be freed while the spare shares this
        # interpreter's pages, each page they are on copied.
        self.spare.script_streams = script_streams
        return None

    def start(self, job_id: str, go: Dict[str, Any], outputs: Optional[Dict[str, Any]] = None) -> Optional[Child]:
        """Start the run with the spare process (one forked now if there is none, or it has ended: an OOM kill
        between runs, a failed confinement, which the new one then reports as the run's); ``go``: what ``send_go``
        sends it."""
        received = time.monotonic_ns()
        run, self.spare = self.spare, None
        language = go.get(protocol.LANGUAGE, protocol.PYTHON)
        self.spare_language = language
        if run is not None and node.kind(run.language) != node.kind(language) and not run.ended():  # another kind
            kill_spare(run)
        if run is None or run.ended():
            if run is not None:
                self.discard(run)
            child = self.spawn(language)
            if child is not None:
                return child
            run, self.spare = self.spare, None
            assert run is not None
        if outputs is not None:  # before the go: no script runs
            files.prepare_outputs(WORKDIR, switch_user=os.geteuid() == 0)
        stdout = run.streams[0].pipe
        try:  # the read end names the same pipe; set now, so that only a running script's pipe is large
            fcntl.fcntl(stdout or 0, F_SETPIPE_SZ, STDOUT_PIPE_BYTES)
        except OSError:  # past the user's pipe-user-pages-soft (or pipe-max-size): the kernel's 64 KiB
            pass
        for stream in run.streams:
            try:
                stream.size = fcntl.fcntl(stream.pipe or 0, F_GETPIPE_SZ)
            except OSError:
                pass
        run.job_id = job_id
        run.outputs = outputs
        run.oom_before = oom_kills()
        if run.nudge is not None:
            self.selector.register(run.nudge, selectors.EVENT_READ, "nudge")
        self.run = run
        self.watch(run, True)
        run.next_pass = time.monotonic() + REST_S
        self.send_go(run, go)
        run.stamps.update(run_received=received, go_sent=time.monotonic_ns())
        self.reap()  # a child that ended before the handler was of interest
        return None

    def send_go(self, run: _Run, message: Dict[str, Any]) -> None:
        """Release the run's process: ``message`` on the go pipe (``{"env": {...}}``, or ``{"env_file": path}``:
        the file it reads its env from, see ``wait_for_go``), then the pipe's end. A process that has ended already
        (the pipe is broken) is the run's all the same: its end is reported as any script's."""
        go, run.go = run.go, None
        if go is None:
            return
        data = json.dumps(message).encode()
        try:
            while data:
                data = data[os.write(go, data) :]
        except OSError:
            pass
        os.close(go)

    def discard(self, spare: _Run) -> None:
        """Release the pipes and rings of a spare process that ended before its run (collected already)."""
        spare.script_streams = None
        for stream in spare.streams:
            self.close_pipe(spare, stream)
            stream.ring.close()
        for fd in (spare.nudge, spare.ack, spare.go):
            if fd is not None:
                os.close(fd)

    def become_child(self, out_w: int, err_w: int, streams: Streams) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
        try:
            drop(self.filter, env=False)  # its own session, the sandbox user, no capability (ptc_runtime.confine)
        except (OSError, ValueError) as exc:
            os.write(err_w, ("ptc_runtime: cannot drop privileges: %s\n" % exc).encode())
            os._exit(126)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        self.control.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        install(streams)  # sys.stdout and sys.stderr write into the rings (ptc_runtime.ring)

    def watch(self, run: _Run, watching: bool) -> None:
        """Put the run's pipes in the selector (the streams sleep: data wakes the server) or take them out (output
        flows: the next pass is at most ``REST_S`` away)."""
        if run.watching == watching:
            return
        for stream in run.streams:
            if stream.pipe is not None:
                if watching:
                    self.selector.register(stream.pipe, selectors.EVENT_READ, stream.name)
                else:
                    self.selector.unregister(stream.pipe)
        run.watching = watching

    def read_nudges(self) -> None:
        run = self.run
        if run is None or run.nudge is None:
            return
        try:
            if os.read(run.nudge, READ_BYTES):
                return
        except BlockingIOError:
            return
        self.selector.unregister(run.nudge)  # the script closed its end: passes every IDLE_S serve it still
        os.close(run.nudge)
        run.nudge = None

    def pass_timeout(self) -> Optional[float]:
        """Seconds until the next pass over the running script's streams (None: no script runs)."""
        run = self.run
        if run is None:
            return None
        return max(0.0, run.next_pass - time.monotonic())

    def take_pass(self, run: _Run) -> None:
        """``pass_over`` with its frames sent in one write (``corked``)."""
        with self.corked():
            self.pass_over(run)

    def pass_over(self, run: _Run) -> None:
        """Send what each stream holds (``take``); ack a child that waits. Output found: the next pass in
        ``REST_S`` (sooner for a pipe that was half full). Nothing: the streams sleep (``ASLEEP`` set, the rings
        looked at once more, the pipes watched) for up to ``IDLE_S``."""
        found = 0
        rest = REST_S
        for stream in run.streams:
            head = stream.reader.head()  # before the pipe is read: the order rule of ptc_runtime.ring
            from_pipe = self.take(run, stream, final=False)
            found += from_pipe
            found += self.take_ring(run, stream, head)
            if from_pipe >= stream.size // 2:
                rest = 0.0
        for stream in run.streams:
            if stream.reader.waited():
                try:
                    os.write(run.ack, b"\0")
                except OSError:  # full: the child has acks to read
                    pass
        now = time.monotonic()
        if found:
            self.watch(run, False)
            run.next_pass = now + rest
            return
        for stream in run.streams:
            stream.reader.sleep()
        if any(stream.reader.pending() for stream in run.streams):  # written before ASLEEP was seen
            run.next_pass = now
            return
        self.watch(run, True)
        run.next_pass = now + IDLE_S

    def take(self, run: _Run, stream: _Stream, final: bool) -> int:
        """Send what the stream's pipe holds; returns the bytes sent. While the script runs (``final`` False) at
        most the pipe's capacity: whatever was in it when the pass began. At the end of the run (``final``) to its
        end, waiting up to ``DRAIN_S`` for a writer that survived the kill; the pipe is closed after."""
        sent = 0
        deadline = time.monotonic() + DRAIN_S
        while stream.pipe is not None and (final or sent < stream.size):
            try:
                data = os.read(stream.pipe, READ_BYTES)
            except BlockingIOError:
                if not final:
                    break
                if time.monotonic() > deadline:  # a writer survived the kill: give up on the rest
                    self.close_pipe(run, stream)
                    break
                time.sleep(0.0005)
                continue
            if not data:
                self.close_pipe(run, stream)
                break
            self.send({protocol.FIELD_OP: protocol.OUT, "id": run.job_id, "stream": stream.name, "n": len(data)}, data)
            sent += len(data)
        return sent

    def take_ring(self, run: _Run, stream: _Stream, head: Optional[int]) -> int:
        """Send what the stream's ring holds up to ``head`` (what ``RingReader.head`` gave before the pipe was
        read; None: the ring is ended, nothing more comes from it); returns the bytes sent."""
        reader = stream.reader
        sent = 0
        while head is not None and reader.tail != head:
            data = reader.take(head, READ_BYTES)
            if not data:
                break
            self.send({protocol.FIELD_OP: protocol.OUT, "id": run.job_id, "stream": stream.name, "n": len(data)}, data)
            sent += len(data)
        return sent

    def close_pipe(self, run: _Run, stream: _Stream) -> None:
        """Stop reading the stream's pipe (at its end, or when a writer survived the end of the run)."""
        if stream.pipe is None:
            return
        if run.watching:
            self.selector.unregister(stream.pipe)
        os.close(stream.pipe)
        stream.pipe = None

    def collect(self) -> None:
        """Collect every ended child (the server is the sandbox's init: orphans are its children too), keeping the
        wait status of the run's script and of the spare."""
        run, spare = self.run, self.spare
        for pid, status in ended_children():
            if run is not None and pid == run.pid and run.status is None:
                run.status = status
                run.stamps["script_ended"] = time.monotonic_ns()
            elif spare is not None and pid == spare.pid and spare.status is None:
                spare.status = status

    def reap(self) -> None:
        """Collect ended children; end the run when its script's process is among them."""
        run = self.run
        self.collect()
        if run is not None and run.status is not None and self.run is run:
            self.end_run(hung_up=False)

    def kill_all(self) -> List[str]:
        """SIGKILL every process of the sandbox but this one, collect them, and return the pids still listed
        after ``KILL_DEADLINE_S`` ([] when none is: the sandbox holds nothing but the interpreter)."""
        deadline = time.monotonic() + KILL_DEADLINE_S
        while True:
            kill_all_once()
            self.collect()
            left = others()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.0005)

    def end_run(self, hung_up: bool) -> None:
        """``finish_run`` with its frames (the last output, files out, ``exit``) sent in one write (``corked``)."""
        with self.corked():
            self.finish_run(hung_up)

    def finish_run(self, hung_up: bool) -> None:
        """The script's process has ended (or the service left): kill the rest, send the output, then exit."""
        run = self.run
        if run is None:
            return
        left = self.kill_all()
        run.stamps["reaped"] = time.monotonic_ns()
        if not hung_up:  # every byte the script and its processes wrote before the end: pipe first, then ring
            for stream in run.streams:
                head = stream.reader.head()  # final: every writer of the ring is gone
                self.take(run, stream, final=True)
                self.take_ring(run, stream, head)
        self.close_run(run)
        run.stamps["drained"] = time.monotonic_ns()
        if hung_up:
            return
        omitted = 0
        if run.outputs is not None and not left:  # every process of the script is gone: nothing writes there
            omitted = files.send_outputs(run.job_id, run.outputs, self.send, WORKDIR, switch_user=os.geteuid() == 0)
        status = run.status or 0
        number: Optional[int] = None
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            exit_code = 128 + number
        else:
            exit_code = os.WEXITSTATUS(status)
        killed = number is not None and number in run.sent
        # OOM: the counter rose (before the service's SIGKILL, if it sent one) and the script died by SIGKILL.
        # No counter (gVisor shows none): no claim. A SIGKILL alone proves nothing (a script can send it to itself);
        # gVisor's OOM kills the whole sandbox, which the engine reports.
        oom_after = run.oom_at_kill if signal.SIGKILL in run.sent else oom_kills()
        rose = run.oom_before is not None and oom_after is not None and oom_after > run.oom_before
        oom = number == signal.SIGKILL and rose
        if oom:
            killed = False  # the OOM killer came first
        self.run = None
        message = {
            protocol.FIELD_OP: protocol.EXIT,
            "id": run.job_id,
            "exit_code": exit_code,
            "signal": number,
            "killed": killed,
        }
        message.update(oom_killed=oom, left=len(left), files_omitted=omitted, stamps=run.stamps)
        self.send(message)

    def close_run(self, run: _Run) -> None:
        """Release the run's pipes and rings."""
        run.script_streams = None
        for stream in run.streams:
            self.close_pipe(run, stream)
            stream.ring.close()
        if run.nudge is not None:
            self.selector.unregister(run.nudge)
            os.close(run.nudge)
            run.nudge = None
        os.close(run.ack)
        if run.go is not None:
            os.close(run.go)
            run.go = None


def kill_spare(spare: _Run) -> None:
    """End a spare process that waits for its go (and collect it: ``_Run.ended`` is then true)."""
    try:
        os.kill(spare.pid, signal.SIGKILL)
        _, status = os.waitpid(spare.pid, 0)
        spare.status = status
    except ChildProcessError:  # collected already (``collect``)
        pass
    except OSError:
        pass


def wait_for_go(go: int) -> Tuple[Dict[str, str], str]:
    """In a spare process: block until the server sends its go (``Server.send_go``: JSON, then the pipe's end) and
    return the run's env and language (``protocol.LANGUAGES``). The env is the go's own, or the one in the env file
    it names (``protocol.ENV_FILE``), read here,
    as the sandbox user, so that the resident interpreter never holds it. The process exits when the server never
    sends a go (it left), and with 126 and a line on stderr when the env file cannot be read."""
    chunks = []
    while True:
        data = os.read(go, READ_BYTES)
        if not data:
            break
        chunks.append(data)
    os.close(go)
    try:
        message = json.loads(b"".join(chunks))
    except ValueError:
        message = None
    if not isinstance(message, dict):
        os._exit(0)
    env = message.get("env")
    path = message.get("env_file")
    if isinstance(path, str):
        try:
            with open(path, "rb") as f:
                env = json.loads(f.read())
        except (OSError, ValueError) as exc:
            os.write(2, ("ptc_runtime: cannot read the run's env: %s\n" % exc).encode())
            os._exit(126)
    if not isinstance(env, dict):
        os.write(2, b"ptc_runtime: the run's env is not an object\n")
        os._exit(126)
    language = message.get(protocol.LANGUAGE, protocol.PYTHON)
    return {str(name): str(value) for name, value in env.items()}, str(language)


def preload(names: str) -> List[str]:
    """Import the modules ``names`` lists (comma-separated, the image's ``PTC_PRELOAD``) in the resident interpreter,
    so that every script forked from it finds them imported (``import pandas`` is then a dictionary lookup); returns
    the names imported.

    A module that fails to import (any exception, ``SystemExit`` included) is said on the server's stderr (the
    sandbox's log, not a script's output) and skipped: the sandbox still serves. Isolation is unchanged: each script
    is a fresh fork of this interpreter and changes only its own copy of a module's state (``pandas.options``, a
    monkeypatch), which ends with its process; the next script forks from the untouched original. A module that
    hangs on import keeps the sandbox from starting (the service's start timeout ends it)."""
    imported: List[str] = []
    for raw in names.split(","):
        name = raw.strip()
        if not name:
            continue
        try:
            __import__(name)
        except (Exception, SystemExit) as exc:
            sys.stderr.write("ptc_runtime: preload of %s failed: %s: %s\n" % (name, type(exc).__name__, exc))
            sys.stderr.flush()
            continue
        imported.append(name)
    return imported


def no_stdin() -> None:
    """Make fd 0 ``/dev/null``: the container's stdin is nothing a script should read or reach through
    ``/proc/1/fd/0`` (gVisor lets any user open it), and every script inherits this fd 0 as its own stdin."""
    try:
        null = os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return
    if null != 0:
        os.dup2(null, 0)
        os.close(null)


def serve() -> Optional[Child]:
    """Connect to the service's control socket and serve it; see ``Server.serve``."""
    import asyncio  # noqa: F401 - imported now, so that a script's own import is free after the fork

    import ptc_runtime.stubs  # noqa: F401

    # The codec ``__main__.compile_script`` decodes every script with, looked up (its module imported) here once:
    # ~1.5 ms of page faults in each script's process otherwise. ``gc``: what ``finalize_main`` imports.
    codecs.lookup("utf-8-sig")
    # As the sandbox user: whatever an import makes (matplotlib's config folder and font cache under /tmp, any
    # cache under HOME=/tmp) is the scripts' to write, as a one-shot job's first import would have made it. The real
    # ids too: matplotlib checks its folder with os.access (the real user), and one it finds unwritable it replaces
    # by a temporary folder that an atexit hook of every forked script removes.
    with files.as_sandbox_user(real=True):
        preload(os.environ.get(PRELOAD_ENV, ""))
    hook()  # the rings' wrappers of os and subprocess functions, made once here (``ptc_runtime.ring.hook``)
    # What the imports made stays out of every script's collections: a collection in a script's process would write
    # the header of every object it walks, copying this interpreter's pages there.
    gc.collect()
    gc.freeze()
    set_dumpable(False)
    no_stdin()
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 10
    while True:
        try:
            control.connect(CONTROL_SOCKET)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    return Server(control).serve()
