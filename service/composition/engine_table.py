"""The script engines a service runs and the sandbox backend they run on by default.

``ENGINES`` is the table of engines (name -> factory of an ``engines.EngineSite``: what an engine is built
from); today's one row is ``container_engine`` (resident containers with their warm pools). ``docker_backend`` is
the backend ``open_services`` builds when it is given none. Nothing here starts anything: the engines start with
the job service (``JobManager.start``), the backend's threads on first use.
"""

from __future__ import annotations

from collections.abc import Callable

from service.engines import CONTAINER, Engine, EngineSite
from service.engines.container import ContainerEngine
from service.jobs.live import resolve_limits
from service.sandbox.backend import SandboxBackend
from service.sandbox.images import Images
from service.sandbox.pool import PoolSettings, WarmPools
from service.sandbox.spec import sandbox_spec
from service.schemas.job_models import ExecuteRequest
from service.settings import Settings


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
        PoolSettings.from_settings(settings),
        capacity=site.capacity,
        image_names={ref: name for name, ref in settings.images.items()},
        on_stop=site.on_stop,
    )
    return ContainerEngine(site, pool, Images(site.backend, settings.images))


EngineFactory = Callable[[EngineSite], Engine]
ENGINES: dict[str, EngineFactory] = {CONTAINER: container_engine}
"""The script engines a service runs, by name (``service.engines``); a new engine is one module and one row here."""


def docker_backend(settings: Settings) -> SandboxBackend:
    """The Docker backend on ``settings.docker_host`` (its SDK imported only now: tests run without it)."""
    from service.sandbox.docker import DockerBackend

    return DockerBackend(settings.docker_host, max_workers=4 * settings.concurrency() + 8, runtime=settings.runtime)
