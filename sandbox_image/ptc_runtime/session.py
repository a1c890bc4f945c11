"""Session mode (``PTC_SESSION=1``): a resident interpreter that forks one process per script.

The service creates the session's folder (mounted read-only at ``/run/ptc``)
with a listening unix socket ``control.sock`` before it starts the sandbox;
this server connects to it and then does what the service asks, one script
at a time. Before each run the service writes the run's ``script.py`` and
``tools`` package into the folder and listens on its ``tools.sock`` (the same
layout as a one-shot job), so a script sees exactly what it would see cold.

Control protocol: one JSON object per line in both directions.

- server -> service: ``{"op": "hello", "pid": n}`` once connected;
- service -> server: ``{"op": "run", "id": job_id, "env": {...}}``;
- server -> service: ``{"op": "out", "id": job_id, "stream": "stdout"|"stderr", "n": n}``
  followed by exactly n raw bytes of the script's output;
- service -> server: ``{"op": "signal", "id": job_id, "signal": "SIGTERM"|"SIGKILL"}``;
- server -> service: ``{"op": "exit", "id": job_id, "exit_code": n, "oom_killed": bool}``
  once the script's process has ended, every other process of the sandbox
  has been killed and all output has been sent; ``{"op": "error", "message":
  ...}`` for a request it cannot follow.

The script is compiled here, before the fork (up to ``PRECOMPILE_BYTES``; a
larger one is compiled by the child, so that compiling it cannot exhaust the
server). The forked child makes itself a process group, the OOM killer's
first choice and ordinary (dumpable) again; it takes pipes as stdout and
stderr, applies the run's ``env``, and returns from ``serve`` so that
``__main__`` runs it exactly as a one-shot job runs its script. The server
itself is not dumpable: a script (same user, no capabilities) cannot ptrace
it or open its memory or descriptors. ``exit_code`` follows the shell
convention: the exit status, or 128 + N for a death by signal N. The server
runs as the container's init (pid 1): it collects every orphan, and a script
can neither kill nor stop it (the kernel drops signals sent to a namespace's
init from inside it unless the init handles them).
``oom_killed`` says the kernel's OOM killer acted during the run (read from
the memory cgroup's ``oom_kill`` counter: ``memory.events`` on cgroup v2,
``memory/memory.oom_control`` on v1); where no counter is readable, a
SIGKILL the server did not send counts as an OOM kill. Nothing of a script
outlives it: files under the working directory (``/tmp``) do.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

RUN_DIR = "/run/ptc"
CONTROL_SOCKET = os.path.join(RUN_DIR, "control.sock")
SCRIPT = os.path.join(RUN_DIR, "script.py")
READ_BYTES = 64 * 1024
KILL_ROUNDS = 200
PRECOMPILE_BYTES = 64 * 1024  # larger scripts are compiled by the child: compiling them could exhaust the server
PR_SET_DUMPABLE = 4
DRAIN_S = 2.0
OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}


def set_dumpable(dumpable: bool) -> None:
    """prctl(PR_SET_DUMPABLE): a process that is not dumpable cannot be ptraced, nor its /proc/<pid>/mem or
    fd entries opened, by another process of the same user without CAP_SYS_PTRACE (which no sandbox has).
    The server makes itself so, so that a script cannot take it over; each script's process is made dumpable
    again (ordinary). Best effort: without ctypes or prctl the server runs as it is."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1 if dumpable else 0, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass


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


def _alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def kill_others() -> bool:
    """SIGKILL every process of the sandbox but init and this server, until none is left; False if some stay."""
    keep = {1, os.getpid()}
    for _ in range(KILL_ROUNDS):
        try:
            pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
        except OSError:
            return False
        live = [pid for pid in pids if pid not in keep and _alive(pid)]
        if not live:
            return True
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)
    return False


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


class _Run:
    """The script running now: its process, output pipes and how it is being ended."""

    def __init__(self, job_id: str, pid: int, pipes: Dict[int, str], oom_before: Optional[int]) -> None:
        self.job_id = job_id
        self.pid = pid
        self.pipes = pipes  # read end -> stream name
        self.oom_before = oom_before
        self.killed = False
        self.status: Optional[int] = None


class Server:
    """The session's resident interpreter (see the module docstring)."""

    def __init__(self, control: socket.socket, compile_script: Callable[[str], Any]) -> None:
        self.control = control
        self.compile_script = compile_script
        self.selector = selectors.DefaultSelector()
        self.buffer = b""
        self.run: Optional[_Run] = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def send(self, message: Dict[str, Any], payload: bytes = b"") -> None:
        self.control.sendall(json.dumps(message).encode() + b"\n" + payload)

    def serve(self) -> Optional[Tuple[Any, Dict[str, str]]]:
        """Follow the service until it hangs up (returns None); in a forked child, return (compiled, env)."""
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # The server is the container's init (pid 1): the kernel delivers it, from inside the sandbox, only the
        # signals it has a handler for, so a script can neither kill nor stop it. SIGINT's handler is dropped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.send({"op": "hello", "pid": os.getpid()})
        while True:
            for key, _ in self.selector.select():
                if key.data == "control":
                    data = self.control.recv(READ_BYTES)
                    if not data:
                        self.end_run(hung_up=True)
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
                else:
                    self.forward(key.fd, key.data)

    def handle(self, line: bytes) -> Optional[Tuple[Any, Dict[str, str]]]:
        try:
            request = json.loads(line)
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            self.send({"op": "error", "message": "unreadable request"})
            return None
        if op == "run":
            if self.run is not None:
                self.send({"op": "error", "message": "a script is running already"})
                return None
            return self.start(str(request["id"]), dict(request.get("env") or {}))
        if op == "signal" and self.run is not None and request.get("id") == self.run.job_id:
            number = SIGNALS.get(request.get("signal"), signal.SIGKILL)
            if number == signal.SIGKILL:
                self.run.killed = True
                try:
                    os.killpg(self.run.pid, signal.SIGKILL)
                except OSError:
                    pass
                kill_others()
            else:
                try:
                    os.killpg(self.run.pid, number)
                except OSError:
                    pass
            return None
        if op == "ping":
            self.send({"op": "pong"})
        return None

    def start(self, job_id: str, env: Dict[str, str]) -> Optional[Tuple[Any, Dict[str, str]]]:
        try:
            small = os.path.getsize(SCRIPT) <= PRECOMPILE_BYTES
        except OSError:
            small = False
        compiled = self.compile_script(SCRIPT) if small else None  # None: the child compiles it
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        oom_before = oom_kills()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            self.become_child(out_r, out_w, err_r, err_w)
            return compiled, env
        os.close(out_w)
        os.close(err_w)
        pipes = {out_r: "stdout", err_r: "stderr"}
        for fd, name in pipes.items():
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, name)
        self.run = _Run(job_id, pid, pipes, oom_before)
        self.reap()  # a child that ended before the handler was of interest
        return None

    def become_child(self, out_r: int, out_w: int, err_r: int, err_w: int) -> None:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
        set_dumpable(True)
        try:  # the script, not the server, is the one the OOM killer takes when the sandbox runs out of memory
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        os.environ.pop("PTC_SESSION", None)  # the script sees the environment a one-shot job sees
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        self.control.close()
        for fd in (self.wake_r, self.wake_w, out_r, err_r):
            os.close(fd)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)

    def forward(self, fd: int, stream: str) -> None:
        run = self.run
        if run is None:
            return
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return
        if data:
            self.send({"op": "out", "id": run.job_id, "stream": stream, "n": len(data)}, data)
            return
        self.selector.unregister(fd)
        os.close(fd)
        del run.pipes[fd]

    def reap(self) -> None:
        """Collect every ended child (the server is the sandbox's init: orphans are its children too); end the run
        when its script's process is among them."""
        run = self.run
        for pid, status in ended_children():
            if run is not None and pid == run.pid and run.status is None:
                run.status = status
        if run is not None and run.status is not None and self.run is run:
            self.end_run(hung_up=False)

    def end_run(self, hung_up: bool) -> None:
        """The script's process has ended (or the service left): kill the rest, send the output, then exit."""
        run = self.run
        if run is None:
            return
        if run.status is None:  # the service hung up mid-run
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except OSError:
                pass
        kill_others()
        for _ in ended_children():  # the zombies of the killed: they hold pids until init collects them
            pass
        if hung_up:
            return
        deadline = time.monotonic() + DRAIN_S
        for fd in list(run.pipes):
            while fd in run.pipes and time.monotonic() < deadline:
                self.forward(fd, run.pipes[fd])
            if fd in run.pipes:  # a writer survived the kill: give up on the rest
                self.selector.unregister(fd)
                os.close(fd)
                del run.pipes[fd]
        status = run.status or 0
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            exit_code = 128 + number
        else:
            number = 0
            exit_code = os.WEXITSTATUS(status)
        oom_after = oom_kills()
        if run.oom_before is not None and oom_after is not None:
            oom = oom_after > run.oom_before
        else:
            oom = number == signal.SIGKILL and not run.killed
        self.run = None
        self.send({"op": "exit", "id": run.job_id, "exit_code": exit_code, "oom_killed": oom})


def serve(compile_script: Callable[[str], Any]) -> Optional[Tuple[Any, Dict[str, str]]]:
    """Connect to the service's control socket and serve it; see ``Server.serve``.

    ``compile_script(path)`` returns the compiled script or the exception compiling it raised.
    """
    import asyncio  # noqa: F401 - imported now, so that a script's own import is free after the fork

    import ptc_runtime.stubs  # noqa: F401

    set_dumpable(False)
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
    return Server(control, compile_script).serve()
