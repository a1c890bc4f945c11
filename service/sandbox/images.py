"""The images requests may choose (``PTC_IMAGES``), and whether the engine can run each.

Requests name an image (``image`` on ``/execute`` and ``POST /sessions``); ``image_name`` refuses a name
``PTC_IMAGES`` does not offer (422 ``unknown-image``, listing the names). A name it offers may still be unusable:
its image is not present on the engine (not built, or removed), or its runtime lacks the ``session`` feature
(built before the resident interpreter). ``Images.require`` answers that before a job or session is created,
as a ``SandboxError`` naming the image by its name (503 ``sandbox-failure``); ``Images.missing`` is what
``GET /readyz`` and the start-up check report. Callers only ever see names, never image references.

The labels of a usable image are kept (an image's labels do not change under its tag without a rebuild, and a
rebuild keeps the features); a missing image is asked for again at each use, so building it later is enough.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ptc_runtime.protocol import LANGUAGES_LABEL, PYTHON

from service.errors import EngineUnavailable, InvalidField, SandboxError, UnknownImage
from service.sandbox.backend import SandboxBackend
from service.sandbox.labels import FEATURE_SESSION, features
from service.settings import DEFAULT_IMAGE, NODE_IMAGE, Settings

log = logging.getLogger(__name__)


def image_name(
    settings: Settings, asked: str | None, language: str | None = None, loc: tuple[str | int, ...] = ("body", "image")
) -> str:
    """The image name a request gets: ``asked``, or when it asks none, ``default`` for a Python script (``language``
    None or ``python``) and ``node`` for a JavaScript or TypeScript one (``NODE_IMAGE``).

    Raises:
        UnknownImage: ``asked`` is not a name in ``settings.images`` (the error lists the names, never the images).
        InvalidField: a JavaScript or TypeScript script asks no image and ``PTC_IMAGES`` offers no ``node``.
    """
    if asked is None and language not in (None, PYTHON):
        if NODE_IMAGE not in settings.images:
            raise InvalidField(
                f"{language} scripts run in an image with Node.js, which this server does not offer: PTC_IMAGES "
                f"names no {NODE_IMAGE!r} image (sandbox_image/build.sh --node builds one); name one that has it in "
                "image",
                ("body", "language"),
            )
        return NODE_IMAGE
    if asked is None:
        return DEFAULT_IMAGE
    if asked not in settings.images:
        raise UnknownImage(asked, sorted(settings.images), loc)
    return asked


def languages(labels: Mapping[str, str]) -> frozenset[str]:
    """The script languages an image's labels say it runs (``LANGUAGES_LABEL``; Python alone when absent)."""
    listed = labels.get(LANGUAGES_LABEL)
    if listed is None:
        return frozenset({PYTHON})
    return frozenset(part.strip() for part in listed.split(",") if part.strip())


class ImageUnusable(SandboxError):
    """An image ``PTC_IMAGES`` offers cannot run scripts here (not present, or without the ``session`` feature)."""


class Images:
    """The images of ``PTC_IMAGES`` (name -> image reference) as the engine knows them.

    Args:
        backend: the sandbox backend (asked for an image's labels; off the event loop).
        refs: name -> image reference (``Settings.images``: ``default`` included).
    """

    def __init__(self, backend: SandboxBackend, refs: Mapping[str, str]) -> None:
        self._backend = backend
        self._refs = dict(refs)
        self._usable: dict[str, frozenset[str]] = {}  # name -> its runtime's features, once found usable
        self._languages: dict[str, frozenset[str]] = {}  # name -> the script languages it runs, once found usable

    @property
    def names(self) -> list[str]:
        """The names requests may choose, sorted."""
        return sorted(self._refs)

    async def _problem(self, name: str) -> str | None:
        """Why image ``name`` cannot run scripts now, None if it can. Raises EngineUnavailable."""
        if name in self._usable:
            return None
        labels = await self._backend.image_labels(self._refs[name])
        if not labels:
            return f"image {name!r} is not present on the engine (build it, or remove it from PTC_IMAGES)"
        found = features(labels)
        if FEATURE_SESSION not in found:
            return f"image {name!r} cannot run scripts: its runtime is older than the service (rebuild it)"
        self._languages[name] = languages(labels)
        self._usable[name] = found
        return None

    async def require(self, name: str, language: str = PYTHON) -> None:
        """Make sure image ``name`` (a name ``image_name`` accepted) can run scripts in ``language``.

        Raises:
            ImageUnusable: it is not present, or its runtime lacks the ``session`` feature (names the image by
                its name, never its reference).
            InvalidField: its ``io.ptc-sandbox.languages`` label does not list ``language`` (a 422 on
                ``body.language``).
            EngineUnavailable: the engine cannot be asked.
        """
        problem = await self._problem(name)
        if problem is not None:
            raise ImageUnusable(problem)
        if language not in self._languages[name]:
            runs = ", ".join(sorted(self._languages[name]))
            raise InvalidField(
                f"image {name!r} cannot run {language} scripts (it runs {runs}); javascript and typescript run in an "
                "image built by sandbox_image/build.sh --node",
                ("body", "language"),
            )

    async def missing(self) -> dict[str, str]:
        """The images that cannot run scripts now: name -> why (empty when all can).

        Raises:
            EngineUnavailable: the engine cannot be asked.
        """
        problems: dict[str, str] = {}
        for name in self.names:
            try:
                problem = await self._problem(name)
            except EngineUnavailable:
                raise
            except SandboxError as exc:
                problem = f"image {name!r} could not be inspected: {exc}"
            if problem is not None:
                problems[name] = problem
        return problems
