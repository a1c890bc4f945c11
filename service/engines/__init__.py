"""Script engines: the seam (``interface``), today's engine (``container``) and the registry of those a service
runs (``Engines``: name -> engine, built by the composition root from its table,
``service.composition.engine_table.ENGINES``).

A job's engine is chosen when it is admitted (``Engines.choose``: the request's ``engine``, else the default,
``PTC_DEFAULT_ENGINE``) and kept by name on the job; a session's scripts run on the session's engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

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
from service.errors import EngineUnavailable, InvalidField, ScriptCheckFailed
from service.toolkit.cache import CompiledManifest

__all__ = [
    "AUTO", "CONTAINER", "JAVASCRIPT", "PYTHON", "TYPESCRIPT", "CallPort", "Engine", "EngineRun", "EngineSite",
    "Engines", "ExitStatus", "OutputSink", "Sandbox", "Stream",
]  # fmt: skip

CONTAINER = "container"
"""The container engine's name (``service.engines.container.ContainerEngine``)."""
AUTO = "auto"
"""What a request names to let the service pick its engine before anything runs (``Engines.pick``)."""


class Script(Protocol):
    """What ``Engines.pick`` reads of a request (``/execute``'s)."""

    @property
    def engine(self) -> str | None: ...
    @property
    def language(self) -> str | None: ...
    @property
    def script(self) -> str: ...
    @property
    def files(self) -> Any: ...
    @property
    def env(self) -> Any: ...


class Engines(Mapping[str, Engine]):
    """The engines of one service, by name, and the one requests get by default.

    Args:
        engines: every engine, each under its own ``Engine.name``.
        default: the name of the one a request that names none gets.

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

    def choose(self, language: str | None = None, name: str | None = None) -> Engine:
        """The engine of a new job or session: ``name`` (None: the default), for a script in ``language`` (None: its
        engine's default). Raises ValueError naming what is wrong: no such engine, or it does not run ``language``."""
        chosen = self._engines.get(name or self.default)
        if chosen is None:
            raise ValueError(f"no engine {name!r}: the engines are {', '.join(sorted(self._engines))}")
        if language is not None and language not in chosen.languages:
            raise ValueError(f"the engine {chosen.name!r} does not run {language!r}")
        return chosen

    async def pick(self, request: Script, owner: str) -> Engine:
        """The engine of a new one-shot job of ``owner``: the request's ``engine`` (``choose``), or for ``auto`` the
        first engine whose ``Engine.suits`` accepts the script (decided before anything runs), else the container
        engine (the default when there is none). Raises InvalidField (``engine``): no such engine, or it does not
        run the request's language; (``files``, ``env``): the engine takes none."""
        name = request.engine
        if name == AUTO:
            name = self.default if CONTAINER not in self._engines else CONTAINER
            if not request.files and not request.env:
                for engine in self._engines.values():
                    if await engine.suits(request.script, request.language, owner):
                        name = engine.name
                        break
        try:
            chosen = self.choose(request.language, name)
        except ValueError as exc:
            raise InvalidField(str(exc), ("body", "engine")) from exc
        for field, given, takes in (
            ("files", request.files, chosen.takes_files),
            ("env", request.env, chosen.takes_env),
        ):
            if given and not takes:
                raise InvalidField(
                    f"the engine {chosen.name!r} takes no {field}: use the container engine", ("body", field)
                )
        return chosen

    async def screen(self, engine: Engine, request: Script, manifest: CompiledManifest, owner: str) -> Engine:
        """The engine of a job about to be made from ``request`` (``engine``: ``pick``'s, or its session's) and
        ``manifest``, refused before anything runs: ``engine``, or for ``auto`` the container engine when
        ``engine`` cannot offer the manifest's tools. Raises InvalidField (``tools``) naming what ``engine`` cannot
        offer (``Engine.unsupported``); ScriptCheckFailed when the request asks for ``check`` and the script has
        type errors (``check``); EngineUnavailable when no engine can check it."""
        why = await engine.unsupported(manifest, request.script)
        if why is not None and request.engine == AUTO and CONTAINER in self._engines:
            engine, why = self._engines[CONTAINER], None
        if why is not None:
            raise InvalidField(f"the engine {engine.name!r} cannot run these tools: {why}", ("body", "tools"))
        if getattr(request, "check", False):
            found = await self.check(request.script, manifest, request.language, owner, engine.name)
            if any(item["severity"] == "error" for item in found):
                raise ScriptCheckFailed([item for item in found if item["severity"] == "error"])
        return engine

    async def check(
        self, script: str, manifest: CompiledManifest, language: str | None, owner: str, target: str
    ) -> list[dict[str, Any]]:
        """The diagnostics of the first engine that checks such a script (``Engine.check``; ``target``: the engine it
        is for). Raises EngineUnavailable when none can (the checking engine cannot run here), InvalidField
        (``language``) when none checks its language."""
        unavailable: EngineUnavailable | None = None
        for engine in self._engines.values():
            try:
                found = await engine.check(script, manifest, language, owner, target)
            except EngineUnavailable as exc:
                unavailable = exc
                continue
            if found is not None:
                return found
        if unavailable is not None:
            raise unavailable
        raise InvalidField(f"no engine checks {language} scripts: only python", ("body", "language"))

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
