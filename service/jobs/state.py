"""The job service's state in memory, one of each for the whole service, shared by its parts (``JobState``): the
live jobs, the lifecycle events, the background tasks, the ended jobs' views kept for reading and the parked jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.jobs.events import Events
from service.jobs.live import LiveJobs
from service.jobs.parking import ParkedJobs
from service.jobs.tasks import Tasks
from service.views.render import ViewCache


@dataclass(frozen=True)
class JobState:
    """What the job service holds in memory (built once by the composition root, ``assembly.build_jobs``).

    Attributes:
        live: the live jobs (job id -> job): admission adds, the runner removes once the final view is saved.
        events: where lifecycle events are published (``JobEnded``, ``JobLost``, ...).
        tasks: where run tasks and other background work (deliveries, saves, the workers) are held.
        final_views: ended jobs' encoded views kept for reading (``ViewCache``: a saved final view, a delivered
            callback's attempts; a purged job leaves it).
        parked: the jobs parked on this service, waiting for the harness without a sandbox (``ParkedJobs``).
    """

    live: LiveJobs
    events: Events
    tasks: Tasks
    final_views: ViewCache
    parked: ParkedJobs = field(default_factory=lambda: ParkedJobs(0, shared=False))  # none: parking is off
