"""The warm pool: sandboxes started ahead of time, each waiting for one job.

A pooled sandbox is a resident sandbox (``service.sandbox.resident``) used
once: a container already running the runtime's resident interpreter,
with the stub library imported, connected to its control socket and waiting.
Binding a job writes the job's script and ``tools`` package into its folder,
starts the job's broker on the folder's socket and asks the interpreter to
run the script; the job ends when the interpreter reports the script's exit,
and the sandbox is then destroyed, never reused. The container start (about
200-300 ms here) is thus paid before the request arrives, and so is the
container's removal (done after the answer).

There is one pool per sandbox profile (image, runtime and the sandbox
limits; ``env`` is the run's, so it does not split profiles). The default
profile's pool always exists; a job of another profile that finds no pool
starts cold and creates that profile's pool, up to ``max_profiles`` pools; a
pool (other than the default one) that hands out nothing for ``max_age_s`` is
closed.

The pools beyond the default one are shared fairly between keys: a pool is
held by the key whose job created it until a job of another key takes from
it (then it is shared, and held by nobody). When every pool exists and a key
asks for a profile that has none, the least recently used pool of the key
that holds the most is closed for it, if that key holds at least two more
than the asking key (a key never closes its own pools, nor shared ones). So
one key's throwaway profiles (``limits`` values no one else asks for) never
keep another key's profile (a data-image job, say) from a pool.

A job that finds its pool empty gets a cold start and is never
refused for that. A pooled sandbox is handed out at most once (popped under
the event loop, never shared) and is never handed out while being destroyed.
Each pool refills in the background, one sandbox at a time, to ``size``;
sandboxes idle longer than ``max_age_s`` are replaced.

With a ``HostRoom`` (the host capacity), each pooled sandbox commits its memory and CPUs
before it starts (the job that takes it inherits the commitment); a pool
refills only into room that no job is waiting for, and ``evict`` gives idle
pooled sandboxes up when a job or session needs their room.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from service.errors import SandboxError
from service.sandbox.backend import SandboxBackend, SandboxSpec
from service.sandbox.labels import FEATURE_SESSION, LABEL_POOL, features
from service.sandbox.ports import HostRoom, StopHook
from service.sandbox.resident import ResidentSandbox
from service.settings import Settings

log = logging.getLogger(__name__)

REFILL_BACKOFF_S = 5.0  # after a failed start; also how often the image's label is asked for while the engine is down
DEFAULT_PROFILE = "default"


def profile_key(spec: SandboxSpec) -> tuple[object, ...]:
    """What makes two sandboxes interchangeable for a job (everything but the folder, env and labels)."""
    return (
        spec.image,
        spec.runtime,
        spec.memory_mb,
        spec.cpus,
        spec.pids,
        spec.tmp_mb,
        spec.file_size_mb,
        spec.open_files,
    )


@dataclass(frozen=True)
class PoolSettings:
    """How much the warm pools keep (``PTC_WARM_POOL_*``).

    Attributes:
        size: sandboxes each pool keeps waiting; 0 disables pooling.
        max_age_s: a sandbox idle longer than this is replaced; a pool (other than the default one) unused this long
            is closed (s).
        max_profiles: pools at most (the default one included).
    """

    size: int
    max_age_s: float
    max_profiles: int

    @classmethod
    def from_settings(cls, settings: Settings) -> PoolSettings:
        """``PTC_WARM_POOL_SIZE``, ``PTC_WARM_POOL_MAX_AGE_S`` and ``PTC_WARM_POOL_MAX_PROFILES``."""
        return cls(settings.warm_pool_size, settings.warm_pool_max_age_s, settings.warm_pool_max_profiles)


@dataclass
class PooledSandbox:
    """A started sandbox waiting for its job, and when it started (for ``max_age_s``)."""

    sandbox: ResidentSandbox
    started: float = field(default_factory=time.monotonic)


class WarmPool:
    """Keeps up to ``size`` sandboxes of one profile started and waiting.

    Args:
        backend: the sandbox backend.
        spec: the profile (``job_dir`` is replaced per sandbox).
        folder: host folder for the sandboxes' folders.
        pool_settings: ``size``, the sandboxes to keep waiting, and ``max_age_s``: a sandbox idle longer than this
            is replaced.
        name: the profile's name (``default``, a short hash, or ``<image name>-<hash>``) for logs and metrics.
        capacity: the host capacity its sandboxes commit to; None: not counted.
        on_stop: told of each sandbox removed (``ResidentSandbox``).
    """

    def __init__(
        self,
        backend: SandboxBackend,
        spec: SandboxSpec,
        folder: Path,
        pool_settings: PoolSettings,
        name: str,
        capacity: HostRoom | None = None,
        on_stop: StopHook | None = None,
    ) -> None:
        self._backend = backend
        self._capacity = capacity
        self._on_stop = on_stop
        self._spec = spec
        self._folder = folder
        self._size = pool_settings.size
        self._max_age_s = pool_settings.max_age_s
        self.name = name
        self._ready: deque[PooledSandbox] = deque()
        self._starting = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Task[None]] = set()
        self.last_taken = time.monotonic()
        self.holder: str | None = None  # the key whose job created it, until another key's job takes from it

    @property
    def ready(self) -> int:
        """Sandboxes waiting now."""
        return len(self._ready)

    def start(self) -> None:
        """Start refilling in the background."""
        self._folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        self._task = asyncio.create_task(self._refill(), name=f"warm pool {self.name}")

    def take(self) -> ResidentSandbox | None:
        """A waiting sandbox, handed out once; None when the pool is empty."""
        self.last_taken = time.monotonic()
        sandbox = None
        while self._ready and sandbox is None:
            candidate = self._ready.popleft()
            if time.monotonic() - candidate.started <= self._max_age_s and candidate.sandbox.broken is None:
                sandbox = candidate.sandbox
            else:
                self._discard(candidate.sandbox)
        self._wake.set()
        return sandbox

    def evict_one(self) -> bool:
        """Give up the oldest waiting sandbox: its room is released now, its container removed in the background.

        Returns whether there was one.
        """
        if not self._ready:
            return False
        sandbox = self._ready.popleft().sandbox
        if sandbox.commitment is not None:
            sandbox.commitment.release()
            sandbox.commitment = None
        self._discard(sandbox)
        return True

    def _discard(self, sandbox: ResidentSandbox) -> asyncio.Task[None]:
        """Destroy ``sandbox`` in a task of its own: cancelling whoever awaits it does not stop the removal, and
        ``close`` waits for it (a removal cut short would leave its container behind)."""
        task = asyncio.get_running_loop().create_task(sandbox.destroy(), name=f"warm pool {self.name} removal")
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)
        return task

    async def close(self) -> None:
        """Stop refilling and destroy every waiting sandbox; returns when every removal begun has ended."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._ready:
            self._discard(self._ready.popleft().sandbox)
        while self._destroying:
            await asyncio.gather(*self._destroying, return_exceptions=True)

    async def _refill(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            for pooled in [p for p in self._ready if now - p.started > self._max_age_s or p.sandbox.broken]:
                self._ready.remove(pooled)
                await asyncio.shield(self._discard(pooled.sandbox))
            if len(self._ready) + self._starting < self._size:
                if self._capacity is not None and (
                    self._capacity.waiting or self._capacity.shortfall(self._spec.memory_mb, self._spec.cpus)
                ):
                    await asyncio.sleep(REFILL_BACKOFF_S)  # the room is someone else's: look again later
                    continue
                try:
                    self._ready.append(await self._start_one())
                except SandboxError as exc:
                    log.warning("warm pool %s: could not start a sandbox: %s", self.name, exc)
                    await asyncio.sleep(REFILL_BACKOFF_S)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(self._max_age_s / 4, 1.0))

    async def _start_one(self) -> PooledSandbox:
        sandbox = ResidentSandbox(
            self._backend, replace(self._spec, job_dir=self._folder / secrets.token_hex(8)), self._on_stop
        )
        sandbox.stop_reason = "pool"  # until a job takes it (then the job's status)
        if self._capacity is not None:  # checked by the caller, without an await since
            sandbox.commitment = self._capacity.commit(self._spec.memory_mb, self._spec.cpus)
        self._starting += 1
        starting = asyncio.ensure_future(sandbox.start())
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:  # the pool is closing: let the start finish, then undo it
            with contextlib.suppress(Exception):
                await starting
            await asyncio.shield(self._discard(sandbox))
            raise
        finally:
            self._starting -= 1
        return PooledSandbox(sandbox)


class WarmPools:
    """One ``WarmPool`` per sandbox profile (see the module docstring).

    Args:
        backend: the sandbox backend.
        default: the default profile (server image, runtime and default limits).
        folder: host folder for the pools' sandboxes (emptied at start).
        pool_settings: sandboxes each pool keeps waiting (0 disables pooling), their and the pools' idle age
            (``max_age_s``), pools at most (``max_profiles``, the default one included).
        capacity: the host capacity pooled sandboxes commit to; None: not counted.
        image_names: image reference -> its name in ``PTC_IMAGES``: a pool of an image other than the default
            one is named ``<name>-<hash>`` (in logs and the ``profile`` label of metrics), else ``<hash>``.
        on_stop: told of each pooled sandbox removed (``ResidentSandbox``).
    """

    def __init__(
        self,
        backend: SandboxBackend,
        default: SandboxSpec,
        folder: Path,
        pool_settings: PoolSettings,
        capacity: HostRoom | None = None,
        image_names: Mapping[str, str] | None = None,
        on_stop: StopHook | None = None,
    ) -> None:
        self._backend = backend
        self._capacity = capacity
        self._on_stop = on_stop
        self._default = default
        self._image_names = {ref: name for ref, name in (image_names or {}).items() if ref != default.image}
        self._folder = folder
        self._pool_settings = pool_settings
        self._size = pool_settings.size  # 0 once the image turns out unable to serve pooled jobs (``_open``)
        self._max_age_s = pool_settings.max_age_s
        self._max_profiles = pool_settings.max_profiles
        self._pools: dict[tuple[object, ...], WarmPool] = {}
        self._retiring: set[WarmPool] = set()  # closed (unused, or given up), their removals perhaps not ended
        self._closing: set[asyncio.Task[None]] = set()  # the closes of pools given up for another key's profile
        self._opened = False  # the image's label was read: the default pool runs (or pooling is off)
        self._opening: asyncio.Task[None] | None = None
        self._retire: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Empty the pools' folder and start the default profile's pool.

        Pooling stays off when the image's runtime cannot serve a job from a pool (an image built before:
        its label ``io.ptc-sandbox.runtime`` lacks ``session``); jobs then start cold. When the engine cannot be
        asked now (it is down), the label is asked for again every ``REFILL_BACKOFF_S`` in the background, and
        jobs start cold until it answers.
        """
        await asyncio.to_thread(shutil.rmtree, self._folder, True)
        self._folder.mkdir(parents=True, mode=0o700)
        if self._size <= 0:
            return
        try:
            self._open(await self._backend.image_labels(self._default.image))
        except SandboxError as exc:
            log.warning("warm pool waits for the engine to read image %s's label: %s", self._default.image, exc)
            self._opening = asyncio.create_task(self._open_when_engine_answers(), name="warm pool opening")

    async def _open_when_engine_answers(self) -> None:
        """Ask for the image's labels every ``REFILL_BACKOFF_S`` until the engine answers, then ``_open``."""
        while True:
            await asyncio.sleep(REFILL_BACKOFF_S)
            try:
                labels = await self._backend.image_labels(self._default.image)
            except SandboxError as exc:
                log.debug("warm pool still waits for the engine: %s", exc)
                continue
            self._open(labels)
            log.info("warm pool: the engine answers again")
            return

    def _open(self, image_labels: dict[str, str]) -> None:
        """Start the default profile's pool if the image's labels list the ``session`` feature; else pool nothing."""
        self._opened = True
        if FEATURE_SESSION not in features(image_labels):
            log.warning(
                "warm pool off: image %s cannot serve pooled jobs (rebuild it with sandbox_image/build.sh)",
                self._default.image,
            )
            self._size = 0
            return
        self._pool_for(self._default, DEFAULT_PROFILE)
        self._retire = asyncio.create_task(self._retire_loop(), name="warm pool retirement")

    @property
    def enabled(self) -> bool:
        """Whether pooled sandboxes are handed out (pooling is on and the image's label was read)."""
        return self._opened and self._size > 0

    def take(self, spec: SandboxSpec, owner: str = "") -> ResidentSandbox | None:
        """A waiting sandbox of ``spec``'s profile for a job of ``owner`` (an API key's name), or None: the
        profile's pool is then created if there is room, or if the key holding the most pools gives one up
        (see the module docstring)."""
        if not self.enabled:
            return None
        key = profile_key(spec)
        pool = self._pools.get(key)
        if pool is None:
            if len(self._pools) >= self._max_profiles and not self._give_up_one_for(owner):
                return None
            name = hashlib.sha256(repr(key).encode()).hexdigest()[:8]
            if spec.image in self._image_names:
                name = f"{self._image_names[spec.image]}-{name}"
            self._pool_for(spec, name).holder = owner
            return None
        if pool.holder is not None and pool.holder != owner:
            pool.holder = None  # wanted by two keys: shared
        return pool.take()

    def _give_up_one_for(self, owner: str) -> bool:
        """Close the least recently used pool of the key holding the most pools, if it holds at least two more
        than ``owner``; whether one was closed."""
        held: dict[str, list[tuple[tuple[object, ...], WarmPool]]] = {}
        for key, pool in self._pools.items():
            if pool.name != DEFAULT_PROFILE and pool.holder is not None:
                held.setdefault(pool.holder, []).append((key, pool))
        if not held:
            return False
        biggest = max(held, key=lambda holder: len(held[holder]))
        if biggest == owner or len(held[biggest]) < len(held.get(owner, [])) + 2:
            return False
        key, pool = min(held[biggest], key=lambda entry: entry[1].last_taken)
        del self._pools[key]
        self._retiring.add(pool)

        async def closing() -> None:
            try:
                await pool.close()
            finally:
                self._retiring.discard(pool)
            log.info("warm pool %s closed: its room went to another key's profile", pool.name)

        task = asyncio.get_running_loop().create_task(closing(), name=f"warm pool {pool.name} closing")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return True

    def evict(self, fits: Callable[[], bool]) -> bool:
        """Give up idle pooled sandboxes (other profiles' first, then the default's) until ``fits()``.

        Synchronous: their room is free when it returns. Returns ``fits()``.
        """
        pools = sorted(self._pools.values(), key=lambda pool: pool.name == DEFAULT_PROFILE)
        for pool in pools:
            while not fits() and pool.evict_one():
                pass
        return fits()

    def sizes(self) -> dict[str, int]:
        """Waiting sandboxes per profile name."""
        return {pool.name: pool.ready for pool in self._pools.values()}

    async def close(self) -> None:
        """Close every pool (their waiting sandboxes are destroyed)."""
        for task in (self._opening, self._retire):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        pools = [*self._pools.values(), *self._retiring]
        await asyncio.gather(*(pool.close() for pool in pools), *self._closing, return_exceptions=True)
        self._pools.clear()

    def _pool_for(self, spec: SandboxSpec, name: str) -> WarmPool:
        pool = WarmPool(
            self._backend,
            replace(spec, env={}, labels={**self._default.labels, LABEL_POOL: name}),
            self._folder / name,
            self._pool_settings,  # its size is ``_size``: no pool is made once pooling is off
            name,
            self._capacity,
            self._on_stop,
        )
        self._pools[profile_key(spec)] = pool
        pool.start()
        log.info("warm pool %s started (size %d)", name, self._size)
        return pool

    async def _retire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self._max_age_s / 4, 1.0))
            now = time.monotonic()
            for key, pool in list(self._pools.items()):
                if pool.name != DEFAULT_PROFILE and now - pool.last_taken > self._max_age_s:
                    del self._pools[key]
                    self._retiring.add(pool)
                    await pool.close()  # cancelled by ``close``: that closes it again, waiting for its removals
                    self._retiring.discard(pool)
                    log.info("warm pool %s closed: unused for %g s", pool.name, self._max_age_s)
