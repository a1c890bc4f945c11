"""Jobs: one script run, from request to final status, and the run path.

The package, by stage of one ``POST /execute``:

==============  ===================================================================================================
module          what it does
==============  ===================================================================================================
``model``       statuses, allowed transitions, ``FINAL``/``LIVE``, ``Failure``, the end-of-run rules (no imports)
``live``        a job held in memory (``LiveJob``), the set of them (``LiveJobs``), its resolved limits
``admission``   queue bounds, quotas, script slots; a request becomes a live job (``Intake``) or is refused
``runner``      the run path (save, sandbox, broker, supervise, end-of-run, final save, then tell)
``placement``   one-shot (pooled or cold sandbox, destroyed after) and in-session (the session's turn, kept)
``events``      lifecycle events (status changed, call ended, job ended...): metrics, logs and webhooks subscribe
``webhooks``    completion callbacks, with their own HTTP client
``recovery``    start-up sweep (work-dir lock, sandboxes left behind, lost jobs) and the retention purge
``shared``      ended jobs' output and files in a shared store (PostgreSQL)
``tasks``       background tasks, held and their failures logged
``state``       what the job service holds in memory (``JobState``: live jobs, events, tasks, kept views)
==============  ===================================================================================================

Reading jobs is ``service.views.read`` , session requests ``service.sessions.requests``
, toolsets ``service.toolsets`` . The parts are built by the
composition root (``service.composition``: ``assembly.build_jobs``, held by ``job_manager.JobManager``), which also
subscribes metrics, logs and webhooks to ``events``.
"""

from __future__ import annotations

from service.jobs.model import FINAL, LIVE, Failure, Job, JobStatus

__all__ = ["FINAL", "LIVE", "Failure", "Job", "JobStatus"]
