"""The script engines a service runs and the sandbox backend they run on by default.

``ENGINES`` is the table of engines (name -> factory of an ``EngineSite``: what an engine is built from); today's
one row is ``container_engine`` (resident containers with their warm pools). ``docker_backend`` is the backend
``open_services`` builds when it is given none. Nothing here starts anything: the engines start with the job
service (``JobManager.start``), the backend's threads on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.engines import CONTAINER, Engine
from service.engines.container import ContainerEngine
from service.jobs.live import resolve_limits
from service.quotas import HostCapacity
from service.sandbox.backend import SandboxBackend
from service.sandbox.images import Images
from service.sandbox.pool import WarmPools
from service.sandbox.ports import StopHook
from service.sandbox.spec import sandbox_spec
from service.schemas.job_models import ExecuteRequest
from service.settings import Settings


@dataclass(frozen=True)
class EngineSite:
    """What an engine is built from (``ENGINES``): the settings, the sandbox backend, the host's room, the folder
    its sandboxes' folders go under, this instance's labels, and the report of a removed sandbox."""

    settings: Settings
    backend: SandboxBackend
    capacity: HostCapacity
    folder: Path
    instance_labels: dict[str, str]
    on_stop: StopHook | None = None


def container_engine(site: EngineSite) -> Engine:
    """Today's engine (``engines.container``): resident containers on ``site.backend``, with the warm pools of
    ``PTC_WARM_POOL_*`` (their profile: the default limits and image)."""
    settings = site.settings
    jobs_dir = site.folder / "jobs"
    defaults = resolve_limits(ExecuteRequest(script=""), settings)  # the default profile
    pool = WarmPools(
        site.backend,
        sandbox_spec(settings, defaults, {}, jobs_dir, site.instance_labels),
        site.folder / "pool",
        settings.warm_pool_size,
        settings.warm_pool_max_age_s,
        settings.warm_pool_max_profiles,
        capacity=site.capacity,
        image_names={ref: name for name, ref in settings.images.items()},
        on_stop=site.on_stop,
    )
    images = Images(site.backend, settings.images)
    return ContainerEngine(
        settings, site.backend, pool, site.capacity, images, jobs_dir, site.folder / "sessions",
        site.instance_labels, site.on_stop,
    )  # fmt: skip


EngineFactory = Callable[[EngineSite], Engine]
ENGINES: dict[str, EngineFactory] = {CONTAINER: container_engine}
"""The script engines a service runs, by name (``service.engines``); a new engine is one module and one row here."""


def docker_backend(settings: Settings) -> SandboxBackend:
    """The Docker backend on ``settings.docker_host`` (its SDK imported only now: tests run without it)."""
    from service.sandbox.docker import DockerBackend

    return DockerBackend(settings.docker_host, max_workers=4 * settings.concurrency() + 8, runtime=settings.runtime)
