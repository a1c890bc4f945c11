"""What the sandbox layer asks of the layers above it, as small protocols: it imports none of them.

``HostRoom`` is the host capacity sandboxes commit to (``service.quotas.HostCapacity``), ``Held`` one sandbox's
commitment (``quotas.Commitment``), ``OutputCollector`` a run's output files as checked frames
(``service.files.OutputFiles``), ``StopHook`` the report of a removed sandbox (``observability.logs``'s
``sandbox_stop`` event, handed in by the composition root), ``CallSocket`` the job's broker listening for a run's
tool calls (``service.broker.Broker``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Held(Protocol):
    """Room committed for one sandbox."""

    def release(self) -> None:
        """Give the room back (idempotent)."""


class HostRoom(Protocol):
    """The host's room for sandboxes: memory (MiB) and CPUs committed against the host's."""

    waiting: int  # jobs waiting for room: the warm pool leaves the room to them

    def shortfall(self, memory_mb: float, cpus: float) -> str | None:
        """None when a sandbox of ``memory_mb`` and ``cpus`` fits now, else the reason."""

    def commit(self, memory_mb: float, cpus: float) -> Held | None:
        """Commit room for one sandbox; None when it does not fit."""


class OutputCollector(Protocol):
    """A run's output files, taken frame by frame from the sandbox (the frames are not trusted)."""

    omitted: int  # entries the sandbox left out

    def caps(self) -> dict[str, int]:
        """The caps the runtime is told (``outputs`` of the ``run`` message)."""

    def begin(self, path: object) -> None:
        """A file starts (its path as the sandbox sent it)."""

    def add(self, data: bytes) -> None:
        """Bytes of the current file."""

    def skip(self, path: object, reason: object) -> None:
        """An entry the sandbox left out, and why."""

    def end(self) -> None:
        """Close the current file."""

    def discard(self) -> None:
        """Forget every file (the run broke the protocol mid-way)."""


class CallSocket(Protocol):
    """Where a run's tool calls go: the job's broker, listening on a unix socket in the sandbox's folder."""

    async def start(self, path: Path) -> None:
        """Listen on the unix socket ``path`` (mode 0666, so the sandbox user can connect)."""


StopHook = Callable[[str | None, str, float, str, str | None], None]
"""Told of a removed sandbox: (job id it ran last, sandbox id, seconds the removal took, folder name, why)."""
