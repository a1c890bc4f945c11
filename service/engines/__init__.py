"""Script engines: the seam (``interface``), today's engine (``container``) and the registry of those a service
runs (``Engines``: name -> engine, built by the composition root from its table,
``service.composition.engine_table.ENGINES``).

A job's engine is chosen when it is admitted (``Engines.choose``) and kept by name on the job; a session's scripts
run on the session's engine. Requests do not name an engine yet: every one gets the default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from service.engines.interface import (
    JAVASCRIPT,
    PYTHON,
    TYPESCRIPT,
    CallPort,
    Engine,
    EngineRun,
    EngineSite,
    ExitStatus,
    OutputSink,
    Sandbox,
    Stream,
)

__all__ = [
    "CONTAINER", "JAVASCRIPT", "PYTHON", "TYPESCRIPT", "CallPort", "Engine", "EngineRun", "EngineSite", "Engines",
    "ExitStatus", "OutputSink", "Sandbox", "Stream",
]  # fmt: skip

CONTAINER = "container"
"""Today's engine's name (``service.engines.container.ContainerEngine``)."""


class Engines(Mapping[str, Engine]):
    """The engines of one service, by name, and the one requests get by default.

    Args:
        engines: every engine, each under its own ``Engine.name``.
        default: the name of the one a request gets (it names none yet).

    Raises:
        ValueError: ``default`` is not one of ``engines``, or an engine is registered under a name not its own.
    """

    def __init__(self, engines: Mapping[str, Engine], default: str = CONTAINER) -> None:
        if default not in engines:
            raise ValueError(f"the default engine {default!r} is not one of {sorted(engines)}")
        for name, engine in engines.items():
            if engine.name != name:
                raise ValueError(f"the engine {engine.name!r} is registered as {name!r}")
        self._engines = dict(engines)
        self.default = default

    def __getitem__(self, name: str) -> Engine:
        return self._engines[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def choose(self, language: str | None = None) -> Engine:
        """The engine of a new job or session with a script in ``language`` (None: its engine's default): the
        default engine (requests name no engine yet). Raises ValueError when it does not run ``language``."""
        engine = self._engines[self.default]
        if language is not None and language not in engine.languages:
            raise ValueError(f"the engine {engine.name!r} does not run {language!r}")
        return engine

    async def sweep(self) -> int:
        """Every engine's sweep (``Engine.sweep``), in order; how many sandboxes were removed in all. Raises what the
        first engine that cannot be asked raises (SandboxError)."""
        removed = 0
        for engine in self._engines.values():
            removed += await engine.sweep()
        return removed

    def warm(self) -> dict[str, int]:
        """Every engine's waiting sandboxes, by profile name (``Engine.warm``)."""
        return {profile: count for engine in self._engines.values() for profile, count in engine.warm().items()}

    async def start(self) -> None:
        """Start every engine's background work, in order of registration."""
        for engine in self._engines.values():
            await engine.start()

    async def close(self) -> None:
        """Close every engine, in reverse order of registration."""
        for engine in reversed(list(self._engines.values())):
            await engine.close()
