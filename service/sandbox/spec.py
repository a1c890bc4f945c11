"""The sandbox a run gets, built from the settings and the run's resolved limits."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from service.sandbox.backend import SandboxSpec
from service.settings import DEFAULT_IMAGE, Settings


class SandboxLimits(Protocol):
    """A run's own sandbox limits, after defaults and server maxima were applied (``jobs.live.ResolvedLimits``)."""

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
    env: Mapping[str, str],
    job_dir: Path,
    labels: Mapping[str, str],
    image: str = DEFAULT_IMAGE,
) -> SandboxSpec:
    """The sandbox of a run (a job's, or a pooled or session sandbox) with ``limits`` and ``env``.

    ``image`` is a name in ``PTC_IMAGES`` (checked before: ``image_name``); the spec holds its image
    reference, so that sandboxes of two images are never of one warm pool's profile (``pool.profile_key``).
    The runtime, ``file_size_mb`` and ``open_files`` are the settings'; ``env`` is the environment of each
    run (``ResidentSandbox.run``), not the container's; ``labels`` are all of the sandbox's labels (the instance's,
    ``labels.instance_labels``, included: what the start-up sweep removes).
    """
    return SandboxSpec(
        image=settings.images[image],
        job_dir=job_dir,
        memory_mb=limits.memory_mb,
        cpus=limits.cpus,
        pids=limits.pids,
        tmp_mb=limits.tmp_mb,
        file_size_mb=settings.file_size_mb,
        open_files=settings.open_files,
        env=dict(env),
        labels=dict(labels),
        runtime=settings.runtime,
    )
