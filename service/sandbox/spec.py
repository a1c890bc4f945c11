"""The sandbox a run gets, built from the settings and the run's resolved limits."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from service.sandbox.base import SandboxSpec
from service.sandbox.labels import LABEL_JOB, instance_labels
from service.settings import Settings


class SandboxLimits(Protocol):
    """A run's own sandbox limits, after defaults and server maxima were applied (e.g. ``jobs.ResolvedLimits``)."""

    @property
    def memory_mb(self) -> int:
        """Memory limit (MiB)."""

    @property
    def cpus(self) -> float:
        """CPU quota (CPUs)."""

    @property
    def pids(self) -> int:
        """Processes and threads at most."""

    @property
    def tmp_mb(self) -> int:
        """Size of the sandbox's ``/tmp`` (MiB)."""


def sandbox_spec(
    settings: Settings,
    limits: SandboxLimits,
    job_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    job_id: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> SandboxSpec:
    """The sandbox of a run with ``limits`` (``job_id`` None: a pooled or session sandbox, no job label).

    The image, runtime, ``file_size_mb`` and ``open_files`` are the settings'; the labels are the instance's
    (``labels.instance_labels``: what the start-up sweep removes), the job's, then ``labels``; ``env`` is the
    environment of each run (``ResidentSandbox.run``), not the container's.
    """
    return SandboxSpec(
        image=settings.sandbox_image,
        job_dir=job_dir,
        memory_mb=limits.memory_mb,
        cpus=limits.cpus,
        pids=limits.pids,
        tmp_mb=limits.tmp_mb,
        file_size_mb=settings.file_size_mb,
        open_files=settings.open_files,
        env=dict(env or {}),
        labels={**instance_labels(settings.instance()), **({LABEL_JOB: job_id} if job_id else {}), **(labels or {})},
        runtime=settings.runtime,
    )
