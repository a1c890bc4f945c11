"""Registered toolsets' manifests (tables ``toolsets`` and ``toolset_owners``; ``POST /toolsets``).

Each registered toolset has one ``toolset_owners`` row per key that registered it. A store made before owners
were recorded gives its toolsets no owner row, so only the admin role can use them. ``ToolsetManifests`` is the
resource's interface; ``sqlite_manifests`` and ``pg_manifests`` implement it.
"""

from __future__ import annotations

from typing import Protocol


class ToolsetManifests(Protocol):
    """Manifests under their toolset ids, with their owners. Coroutines, safe to call concurrently."""

    async def put(self, toolset_id: str, manifest: bytes, owner: str) -> None:
        """Keep a registered manifest (JSON bytes) under its id, owned (also) by ``owner``, in one transaction.

        The same id always holds the same manifest; each owner that registers it may use it.
        """
        ...

    async def get(self, toolset_id: str, owner: str | None) -> bytes | None:
        """The manifest registered under ``toolset_id`` by ``owner`` (None: by anyone, or before owners), or None."""
        ...
