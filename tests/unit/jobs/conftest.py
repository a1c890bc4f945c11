"""Engine-free parts for the job package's unit tests: settings in a temporary work dir, a store that can be told
to fail, live jobs, a runner wired with stand-ins for what no test here reaches (engines, sessions)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from service.broker import BrokerShared, CallMemory
from service.jobs.admission import Admission
from service.jobs.events import Events
from service.jobs.live import LiveJob, LiveJobs, resolve_limits
from service.jobs.placement import Sandboxes
from service.jobs.runner import Runner
from service.jobs.state import JobState
from service.jobs.tasks import Tasks
from service.output import OutputLog
from service.quotas import HostCapacity, Quotas
from service.replicas.registration import Replicas
from service.schemas.job_models import ExecuteRequest
from service.settings import Settings
from service.slots import Slots
from service.store import Incarnation, StoredJob
from service.toolkit.endpoints import EndpointClients
from service.toolkit.validation import CheckScheduler
from service.views import render


class StoreDown(OSError):
    """What the fake store raises while ``failing``."""


@dataclass
class FakeStore:
    """The part of ``JobStore`` the runner and the views use (``jobs``: ``put``, ``save``, ``get``), in memory;
    ``failing`` makes ``put`` raise."""

    rows: dict[str, StoredJob] = field(default_factory=dict)
    failing: bool = False
    puts: int = 0
    shares_output: bool = False

    @property
    def jobs(self) -> FakeStore:
        """The job records: this fake itself."""
        return self

    async def put(self, job: StoredJob) -> None:
        self.puts += 1
        if self.failing:
            raise StoreDown("the store is down")
        self.rows[job.job_id] = job

    async def save(self, job: StoredJob, incarnation: Incarnation) -> bool:
        await self.put(job)
        return True

    async def get(self, job_id: str) -> StoredJob | None:
        return self.rows.get(job_id)

    async def page(self, query: Any) -> tuple[list[StoredJob], str | None]:
        """Every row, in one page (no filter, no order: enough for one job's tests)."""
        return list(self.rows.values()), None


@dataclass
class FakeSession:
    """What a session placement touches of ``sessions.Session``."""

    id: str = "ses_1"
    owner: str = "alice"
    queued: int = 0
    status: str = "ready"
    current_job_id: str | None = None
    executions: int = 0
    stub_source: str | None = None
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used_at: Any = None
    sandbox: Any = None

    @property
    def ended(self) -> bool:
        return self.status in ("closed", "expired", "broken")


@dataclass
class Parts:
    settings: Settings
    store: FakeStore
    quotas: Quotas
    admission: Admission
    events: Events
    tasks: Tasks
    live: LiveJobs
    runner: Runner
    new_job: Callable[[str], LiveJob]


@pytest.fixture
def parts(tmp_path: Path) -> Parts:
    settings = Settings(work_dir=tmp_path, max_concurrent_sandboxes=2, max_queue=2, instance_id="test")
    store = FakeStore()
    capacity = HostCapacity(64 * 1024, 64)
    quotas = Quotas(settings, capacity)
    sessions_queued: list[int] = [0]
    admission = Admission(settings, quotas, Slots(settings.concurrency()), lambda: sessions_queued[0])
    events, tasks = Events(), Tasks()
    live = LiveJobs()
    sandboxes = Sandboxes(cast(Any, {}), admission, cast(Any, None), set())
    runner = Runner(
        settings,
        cast(Any, store),
        JobState(live, events, tasks, render.ViewCache(1 << 20)),
        sandboxes,
        BrokerShared(EndpointClients(5.0, 1 << 20), CheckScheduler(1, 5.0), CallMemory(1 << 20, 1 << 20)),
        Replicas.adopted(settings, cast(Any, store), Incarnation("test", 1)),
    )

    made = iter(range(1 << 30))

    def new_job(owner: str) -> LiveJob:
        limits = resolve_limits(ExecuteRequest(script="print(1)"), settings)
        job_id = f"job_{next(made)}"
        folder = tmp_path / "output" / job_id
        folder.mkdir(parents=True)
        budget = quotas.output(owner)
        job = LiveJob(
            id=job_id,
            owner=owner,
            limits=limits,
            metadata={},
            callback_url=None,
            output_dir=folder,
            stdout=OutputLog(folder / "stdout", limits.output_bytes, 1 << 20, budget),
            stderr=OutputLog(folder / "stderr", limits.output_bytes, 1 << 20, budget),
            loop=asyncio.get_running_loop(),
        )
        live.add(job)
        return job

    return Parts(settings, store, quotas, admission, events, tasks, live, runner, new_job)
