"""Compiled manifests, cached by content: parsing, schema checks and stub generation run once per manifest.

A manifest is identified by the SHA-256 of its canonical JSON (keys sorted),
so the same tools sent again (the usual case: an agent re-sends its manifest
with every script) cost one hash. Compilation runs on threads of its own
(``PTC_MANIFEST_THREADS``), never on the event loop nor on the default
executor that jobs' file work uses: a large manifest takes seconds to check.
Compiles are fair between keys (a ``CheckScheduler`` with the owner as the
group: one compile per key at a time, keys taken round-robin), so one key's
stream of large manifests delays another key's compile by at most one
compile per key ahead of it; and one compile may take at most
``PTC_MANIFEST_BUDGET_S`` of CPU time (past it: ManifestError, a 422).
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from service.errors import CheckTooCostly, ManifestError
from service.toolkit.manifest import parse_manifest
from service.toolkit.specs import ToolSpec
from service.toolkit.stubs import generate_stub_module
from service.toolkit.ts_stubs import typescript_declarations
from service.toolkit.validation import CheckScheduler

CACHED_MANIFESTS = 256
KEPT_DECLARATIONS_CHARS = 256 * 1024  # TypeScript declarations kept with a compiled manifest, at most
CACHED_BYTES = 32 * 1024 * 1024  # of canonical manifest JSON; a compiled manifest takes some 20 times that


@dataclass(frozen=True)
class CompiledManifest:
    """A manifest ready to run: its tools by original name, the ``tools`` package source, and its content id.

    ``toolset_id`` is ``ts_`` + the first 32 hex digits of an HMAC-SHA-256 of
    the manifest's canonical JSON, keyed with the installation's secret salt
    (so the id, which a caller sees, reveals nothing about endpoint headers);
    None when the manifest has no canonical JSON (e.g. a lone surrogate). The TypeScript declarations of its tools
    (for JavaScript and TypeScript scripts) are made on first use and kept with it (``declarations``).
    """

    tools: dict[str, ToolSpec]
    stub_source: str
    toolset_id: str | None = None
    _declarations: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def declarations(self) -> str:
        """The tools' TypeScript declarations (``ts_stubs.typescript_declarations``), generated once and kept.

        The first call is CPU work that grows with the schemas (call it off the event loop for a large manifest);
        the next ones, from any thread, return the kept text (two first calls at once both generate it, equal).
        Text over ``KEPT_DECLARATIONS_CHARS`` is not kept (the cache's byte bound counts manifests only). Raises
        InvalidField (``ts_stubs.typescript_declarations``: past its size bound).
        """
        text = self._declarations.get("typescript")
        if text is None:
            text = typescript_declarations(self.tools.values())
            if len(text) <= KEPT_DECLARATIONS_CHARS:  # a larger one is made again when asked (its size is bounded)
                self._declarations["typescript"] = text
        return text

    def declarations_ready(self) -> bool:
        """Whether ``declarations`` returns at once (generated already)."""
        return "typescript" in self._declarations


def compile_manifest(entries: list[dict[str, Any]], toolset_id: str | None = None) -> CompiledManifest:
    """Parse and generate stubs; raises ManifestError (located under ``body.tools``)."""
    tools = parse_manifest(entries, ("body", "tools"))
    return CompiledManifest(tools, generate_stub_module(tools.values()), toolset_id)


class ManifestCache:
    """An LRU of ``CompiledManifest`` by content hash (at most ``size`` entries), compiled fairly (module doc).

    Args:
        salt: the installation's secret, keying toolset ids.
        threads: compile threads, shared by all keys.
        budget_s: CPU time one compile may take (s).

    Use from one event loop only; ``close`` when done.
    """

    def __init__(
        self,
        salt: bytes,
        size: int = CACHED_MANIFESTS,
        max_bytes: int = CACHED_BYTES,
        *,
        threads: int = 2,
        budget_s: float = 10.0,
    ) -> None:
        self._salt = salt
        self._compiles = CheckScheduler(threads, budget_s)
        self._size = size
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[bytes, tuple[CompiledManifest, int]] = OrderedDict()

    def close(self) -> None:
        """Stop the compile threads once their compiles are done (queued ones are cancelled)."""
        self._compiles.close()

    async def compile(self, entries: list[dict[str, Any]], owner: str) -> CompiledManifest:
        """The compiled manifest, from the cache or built on a compile thread in ``owner``'s turn.

        Raises:
            ManifestError: an entry is unusable, or the compile ran past the CPU budget (its message says so).
        """
        try:
            canonical: bytes | None = orjson.dumps(entries, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # not representable as canonical JSON (e.g. a lone surrogate): compile, don't cache
            canonical = None
        key = hmac.new(self._salt, canonical, hashlib.sha256).digest() if canonical is not None else None
        if key is not None and key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][0]
        toolset_id = "ts_" + key.hex()[:32] if key else None
        try:
            compiled = await self._compiles.run(owner, owner, compile_manifest, entries, toolset_id)
        except CheckTooCostly as exc:
            raise ManifestError(
                f"compiling this manifest took more than {exc.budget_s:g} s of CPU time (PTC_MANIFEST_BUDGET_S); "
                "send fewer tools or smaller schemas",
                ("body", "tools"),
            ) from exc
        if key is not None and canonical is not None and len(canonical) <= self._max_bytes // 4:
            self._entries[key] = (compiled, len(canonical))
            self._bytes += len(canonical)
            while len(self._entries) > self._size or self._bytes > self._max_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self._bytes -= size
        return compiled
