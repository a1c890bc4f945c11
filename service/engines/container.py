"""Today's engine: scripts in a container: Python (CPython, fed by the generated ``tools`` package), JavaScript and
TypeScript (Node.js, fed by the generated ``tools.mjs`` module: ``toolkit.js_stubs``; in an image that has it,
``sandbox_image/build.sh --node``).

Its sandbox is a ``service.sandbox.resident.ResidentSandbox`` (a container whose resident interpreter forks one
process per script, over the folder's ``control.sock``) on a ``SandboxBackend``: the Docker one in service, the
fake one (``service.sandbox.fake.FakeBackend``, scripts as host subprocesses) in tests without an engine. A one-shot
job takes a sandbox of the warm pool (``sandbox.pool.WarmPools``) or a new one with its memory and CPUs committed on
the host (``quotas.HostCapacity``), idle pooled sandboxes giving up their room when it is needed; a session's
sandbox commits its room the same way and is kept for the session's scripts. Calls reach the broker over the
``tools.sock`` it listens on in the sandbox's folder (``CallPort.start``).
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from service import normalize
from service.engines import CONTAINER
from service.engines.interface import JAVASCRIPT, PYTHON, TYPESCRIPT, Engine, EngineSite, Sandbox
from service.normalize import Normalized
from service.sandbox.images import Images
from service.sandbox.labels import LABEL_JOB, LABEL_SESSION
from service.sandbox.pool import WarmPools
from service.sandbox.ports import Held
from service.sandbox.resident import KILL_CONFIRM_S, ResidentSandbox
from service.sandbox.spec import SandboxLimits, sandbox_spec
from service.settings import DEFAULT_IMAGE
from service.toolkit.cache import CompiledManifest
from service.toolkit.js_stubs import javascript_module


class ContainerEngine(Engine):
    """Scripts in resident containers (module docstring).

    Args:
        site: what it is built from (``EngineSite``): the sandboxes' settings (``sandbox.spec.sandbox_spec``:
            images, runtime, file limits), the sandbox backend (Docker, or the fake one), the host's room that
            sandboxes commit to, the folder of its sandboxes' folders (one-shot jobs' under ``<folder>/jobs/<job_id>``,
            sessions' under ``<folder>/sessions``, emptied at ``start``), this instance's labels (what the start-up
            sweep removes), the report of each sandbox removed.
        pool: the warm pools (started and closed with the engine).
        images: the images of ``PTC_IMAGES`` as the backend knows them.
    """

    name = CONTAINER
    languages = (PYTHON, JAVASCRIPT, TYPESCRIPT)
    kill_confirm_s = KILL_CONFIRM_S

    def prepare(self, script: str, repair: bool, language: str = PYTHON) -> Normalized:
        """Python's repairs of a script that does not compile, and the compile verdict (``service.normalize``); a
        JavaScript or TypeScript script runs as sent (its syntax errors are the runtime's to report)."""
        if language != PYTHON:
            return Normalized(script, script)
        return normalize.prepare(script, repair)

    def __init__(self, site: EngineSite, pool: WarmPools, images: Images) -> None:
        self._settings = site.settings
        self.backend = site.backend
        self.pool = pool
        self._capacity = site.capacity
        self.images = images
        self._jobs_dir = site.folder / "jobs"
        self._sessions_dir = site.folder / "sessions"
        self._labels = dict(site.instance_labels)
        self._on_stop = site.on_stop

    def stubs(self, manifest: CompiledManifest, language: str) -> str:
        """Python: the ``tools`` package's source (``toolkit.stubs``), generated once per manifest content when the
        manifest was compiled (``toolkit.cache``, on the manifest threads); JavaScript and TypeScript: the
        ``tools.mjs`` module (``toolkit.js_stubs``: the tools' names only, kept per manifest)."""
        if language == PYTHON:
            return manifest.stub_source
        return javascript_module(manifest.tools)

    def take(
        self, job_id: str, owner: str, limits: SandboxLimits, image: str, hash_seed: int | None = None
    ) -> Sandbox | None:
        """A pooled sandbox of the job's profile (started: ``warm``), or a new one (``cold``) with its room
        committed, idle pooled sandboxes evicted for it when needed; None when they cannot make room. The room is
        committed last, once the sandbox is made: a raise before it leaves nothing held for the job
        (``Engine.take``). With ``hash_seed`` (a replay), always a new one, its interpreter seeded so, in a folder
        of its own (the job's earlier sandbox may not be removed yet: a job parked and answered at once)."""
        capacity = self._capacity
        labels = {**self._labels, LABEL_JOB: job_id}
        folder = job_id if hash_seed is None else f"{job_id}.{secrets.token_hex(4)}"
        spec = sandbox_spec(self._settings, limits, {}, self._jobs_dir / folder, labels, image)
        spec = replace(spec, hash_seed=hash_seed)

        def fits() -> bool:
            return capacity.shortfall(spec.memory_mb, spec.cpus) is None

        sandbox = self.pool.take(spec, owner) if hash_seed is None else None
        if sandbox is None and self.pool.evict(fits):
            sandbox = ResidentSandbox(self.backend, spec, self._on_stop)
            sandbox.commitment = capacity.commit(spec.memory_mb, spec.cpus)  # given back at its removal
        return sandbox

    async def room_released(self, stop: asyncio.Event) -> None:
        """Until a sandbox gives its room back (or ``stop``); counted as waiting meanwhile, so the warm pool leaves
        the room to the job."""
        capacity = self._capacity
        changed = asyncio.ensure_future(capacity.changed().wait())
        stopped = asyncio.ensure_future(stop.wait())
        capacity.waiting += 1
        try:
            await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            capacity.waiting -= 1
            changed.cancel()
            stopped.cancel()

    def hold_room(self, limits: SandboxLimits) -> Held | None:
        """Commit the session's memory and CPUs on the host, idle pooled sandboxes giving up theirs for it.

        Raises:
            QuotaExceeded: the host has no room (``host_memory_mb``, ``host_cpus``).
        """
        memory_mb, cpus, capacity = limits.memory_mb, limits.cpus, self._capacity

        def fits() -> bool:
            return capacity.shortfall(memory_mb, cpus) is None

        if not self.pool.evict(fits):
            raise capacity.refusal(memory_mb, cpus, capacity.shortfall(memory_mb, cpus) or "")
        return capacity.commit(memory_mb, cpus)

    async def open_session(
        self,
        session_id: str,
        limits: SandboxLimits,
        env: Mapping[str, str],
        image: str,
        runtime: str | None,
        held: Held | None,
    ) -> Sandbox:
        """Start the session's resident sandbox in ``<sessions_dir>/<session_id>``; ``held`` is given back at its
        removal. Raises SandboxError (the sandbox could not start: nothing is left, ``held`` is the caller's)."""
        labels = {**self._labels, LABEL_SESSION: "1"}
        spec = sandbox_spec(self._settings, limits, env, self._sessions_dir / session_id, labels, image)
        sandbox = ResidentSandbox(self.backend, replace(spec, runtime=runtime), self._on_stop)
        await sandbox.start()
        sandbox.commitment = held
        return sandbox

    async def require_image(self, image: str, language: str = PYTHON) -> None:
        """Raise ``ImageUnusable`` (503) unless the image is present with the ``session`` feature, InvalidField
        (422) unless its labels list ``language``; EngineUnavailable when the backend cannot be asked."""
        await self.images.require(image, language)

    async def ready(self) -> tuple[bool, str]:
        """The backend answers, has the runtime of ``PTC_RUNTIME``, and the default image (``PTC_SANDBOX_IMAGE``) is
        present (``SandboxBackend.ready``)."""
        return await self.backend.ready(self._settings.sandbox_image)

    async def missing_images(self) -> dict[str, str]:
        """The images of ``PTC_IMAGES`` but the default one (``ready``'s) that are not present or lack the
        ``session`` feature, asked anew (``Images.missing``: an image removed since it was used is reported).
        Raises EngineUnavailable."""
        others = {name: ref for name, ref in self._settings.images.items() if name != DEFAULT_IMAGE}
        return await Images(self.backend, others).missing() if others else {}

    async def sweep(self) -> int:
        """Remove every container carrying this instance's labels (``SandboxBackend.remove_labelled``). Raises
        SandboxError, EngineUnavailable."""
        return await self.backend.remove_labelled(self._labels)

    def warm(self) -> dict[str, int]:
        """The warm pools' waiting sandboxes, by profile name."""
        return self.pool.sizes()

    async def start(self) -> None:
        """Empty the sessions' folder (their sandboxes were swept with the instance's), start the warm pools."""
        await asyncio.to_thread(_empty, self._sessions_dir)
        await self.pool.start()

    async def close(self) -> None:
        """Remove the pooled sandboxes."""
        await self.pool.close()


def _empty(folder: Path) -> None:
    """``folder`` made anew, empty, mode 0700."""
    shutil.rmtree(folder, True)
    folder.mkdir(parents=True, mode=0o700)
