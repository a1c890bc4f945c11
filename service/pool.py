"""The warm pool: sandboxes started ahead of time, each waiting for one job.

A pooled sandbox is a container already running the runtime with the stub
library imported, its (still empty) folder mounted at ``/run/ptc``, waiting
for the file ``/run/ptc/go`` (``PTC_WAIT_FOR_JOB=1``). Binding a job writes the
job's script and ``tools`` package into that folder, starts its broker on the
folder's socket, points the sandbox's output at the job, and creates ``go``.
The container start is thus paid before the request arrives.

Rules: one pool, for the default profile (server image, runtime and default
limits, no ``env``); a job of any other profile, or one that finds the pool
empty, gets a cold start and is never refused for that. A pooled sandbox is
handed out at most once (popped under the event loop, never shared) and is
destroyed with its job. The pool refills in the background, one sandbox at a
time, to ``size``; sandboxes idle longer than ``max_age_s`` are replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from service import logs
from service.errors import SandboxError
from service.sandbox.base import OutputSink, SandboxBackend, SandboxHandle, SandboxSpec, Stream

log = logging.getLogger(__name__)

GO_FILE = "go"
RUNTIME_LABEL = "io.ptc-sandbox.runtime"
WAIT_FEATURE = "wait-for-job"
REFILL_BACKOFF_S = 5.0
EARLY_OUTPUT_BYTES = 64 * 1024


class SwitchableSink:
    """An OutputSink that keeps (a little of) what arrives before a job is bound, then forwards to the job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: OutputSink | None = None
        self._early: list[tuple[Stream, bytes]] = []
        self._early_bytes = 0

    def __call__(self, stream: Stream, data: bytes) -> None:
        with self._lock:
            if self._target is None:
                if self._early_bytes < EARLY_OUTPUT_BYTES:
                    self._early.append((stream, data))
                    self._early_bytes += len(data)
                return
            target = self._target
        target(stream, data)

    def bind(self, target: OutputSink) -> None:
        """From now on, output goes to ``target`` (what came before is dropped: it is not the job's)."""
        with self._lock:
            self._target = target
            self._early.clear()


@dataclass
class PooledSandbox:
    """A started sandbox waiting for its job: its handle, host folder, output switch and start time."""

    handle: SandboxHandle
    folder: Path
    sink: SwitchableSink
    started: float = field(default_factory=time.monotonic)


class WarmPool:
    """Keeps up to ``size`` sandboxes of ``spec``'s profile started and waiting.

    Args:
        backend: the sandbox backend.
        spec: the profile (``job_dir`` is replaced per sandbox).
        folder: host folder for the sandboxes' folders (emptied at start).
        size: sandboxes to keep waiting; 0 disables the pool.
        max_age_s: a sandbox idle longer than this is replaced.
    """

    def __init__(self, backend: SandboxBackend, spec: SandboxSpec, folder: Path, size: int, max_age_s: float) -> None:
        self._backend = backend
        self._spec = spec
        self._folder = folder
        self._size = size
        self._max_age_s = max_age_s
        self._ready: deque[PooledSandbox] = deque()
        self._starting = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> int:
        """Sandboxes waiting now."""
        return len(self._ready)

    def matches(self, spec: SandboxSpec) -> bool:
        """Whether a job with ``spec`` may use a pooled sandbox (same profile)."""
        p = self._spec
        return self._size > 0 and (
            spec.image,
            spec.runtime,
            spec.memory_mb,
            spec.cpus,
            spec.pids,
            spec.tmp_mb,
            spec.file_size_mb,
            spec.open_files,
            dict(spec.env),
        ) == (p.image, p.runtime, p.memory_mb, p.cpus, p.pids, p.tmp_mb, p.file_size_mb, p.open_files, dict(p.env))

    async def start(self) -> None:
        """Empty the pool's folder and start refilling in the background.

        The pool stays off when the image's runtime cannot wait for a job (an image built before the warm
        pool: its label ``io.ptc-sandbox.runtime`` lacks ``wait-for-job``); jobs then start cold.
        """
        shutil.rmtree(self._folder, ignore_errors=True)
        self._folder.mkdir(parents=True, mode=0o700)
        if self._size <= 0:
            return
        try:
            features = (await self._backend.image_labels(self._spec.image)).get(RUNTIME_LABEL, "")
        except SandboxError:
            features = WAIT_FEATURE  # the engine is down now; the refill loop retries starts
        if WAIT_FEATURE not in features.split(","):
            log.warning(
                "warm pool off: image %s cannot wait for a job (rebuild it with sandbox_image/build.sh)",
                self._spec.image,
            )
            self._size = 0
            return
        self._task = asyncio.create_task(self._refill(), name="warm pool")

    def take(self) -> PooledSandbox | None:
        """A waiting sandbox of the pool's profile, handed out once; None when the pool is empty."""
        sandbox = None
        while self._ready and sandbox is None:
            candidate = self._ready.popleft()
            if time.monotonic() - candidate.started <= self._max_age_s:
                sandbox = candidate
            else:
                asyncio.get_running_loop().create_task(self._destroy(candidate))
        self._wake.set()
        return sandbox

    async def close(self) -> None:
        """Stop refilling and destroy every waiting sandbox."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._ready:
            await self._destroy(self._ready.popleft())

    async def _refill(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            for sandbox in [s for s in self._ready if now - s.started > self._max_age_s]:
                self._ready.remove(sandbox)
                await self._destroy(sandbox)
            if len(self._ready) + self._starting < self._size:
                try:
                    self._ready.append(await self._start_one())
                except SandboxError as exc:
                    log.warning("warm pool: could not start a sandbox: %s", exc)
                    await asyncio.sleep(REFILL_BACKOFF_S)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(self._max_age_s / 4, 1.0))

    async def _start_one(self) -> PooledSandbox:
        folder = self._folder / secrets.token_hex(8)
        folder.mkdir(mode=0o755)
        sink = SwitchableSink()
        spec = SandboxSpec(
            image=self._spec.image,
            job_dir=folder,
            memory_mb=self._spec.memory_mb,
            cpus=self._spec.cpus,
            pids=self._spec.pids,
            tmp_mb=self._spec.tmp_mb,
            file_size_mb=self._spec.file_size_mb,
            open_files=self._spec.open_files,
            env={**self._spec.env, "PTC_WAIT_FOR_JOB": "1"},
            labels=self._spec.labels,
            runtime=self._spec.runtime,
        )
        self._starting += 1
        begin = time.monotonic()
        starting = asyncio.ensure_future(self._backend.start(spec, sink))
        try:
            handle = await asyncio.shield(starting)
        except asyncio.CancelledError:  # the pool is closing: the start goes on in its thread, so undo it
            with contextlib.suppress(Exception):
                await self._backend.remove(await starting)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            self._starting -= 1
        logs.sandbox("sandbox_start", None, handle.id, time.monotonic() - begin, mode="pool")
        return PooledSandbox(handle, folder, sink)

    async def _destroy(self, sandbox: PooledSandbox) -> None:
        begin = time.monotonic()
        try:
            await self._backend.remove(sandbox.handle)
        except SandboxError as exc:
            log.warning("warm pool: could not remove sandbox %s: %s", sandbox.handle.id[:12], exc)
        logs.sandbox("sandbox_stop", None, sandbox.handle.id, time.monotonic() - begin, reason="pool")
        await asyncio.to_thread(shutil.rmtree, sandbox.folder, True)


def release(sandbox: PooledSandbox, sink: OutputSink) -> None:
    """Bind a taken sandbox to its job: output to ``sink``, then ``go`` (the job's files must be in place)."""
    sandbox.sink.bind(sink)
    go = sandbox.folder / GO_FILE
    go.touch(mode=0o644)
    os.chmod(go, 0o644)
