"""Answers sent while the client takes them, bounded per key: a session's file download and ``GET /jobs``.

Such an answer is never held whole: a session file goes from the sandbox into an unlinked spool file on the work
dir's disk, then to the client a slice at a time (``responses.output_slices``); a page of jobs is read from the
store ``LIST_BATCH`` rows at a time, each batch parsed and encoded in a thread and sent before the next is read.
What one such answer holds in memory is a slice or a batch, while the client is slow or gone too.

Each key may have at most ``PTC_MAX_READS_PER_KEY`` of them under way at once (``ReadSlots``); one more is
answered ``429`` (problem type ``quota-exceeded``, reason ``concurrent_reads``, ``Retry-After``) at once, before
any work: so one key's many big lists or downloads cannot take the loop, memory or disk from the other keys. A
slot is given back when the answer's last piece was sent, when the client went away, or when the answer is
dropped unsent (a finalizer of its pieces).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable

from service.errors import QuotaExceeded

LIST_BATCH = 50
"""Rows of ``GET /jobs`` read from the store, parsed and encoded at a time (a row's summary: at most about the
request's metadata, 64 KiB, so a batch holds at most about 3 MiB)."""


class ReadSlots:
    """How many answers of ``reads`` each key has under way, at most ``per_key``.

    Args:
        per_key: answers one key may have under way at once (``PTC_MAX_READS_PER_KEY``).
        retry_after_s: the ``Retry-After`` of a refusal (s).
    """

    def __init__(self, per_key: int, retry_after_s: int) -> None:
        self.per_key = per_key
        self.retry_after_s = retry_after_s
        self._held: dict[str, int] = {}

    def held(self, owner: str) -> int:
        """Answers ``owner`` has under way."""
        return self._held.get(owner, 0)

    def take(self, owner: str) -> Callable[[], None]:
        """Take one of ``owner``'s slots; returns its release (idempotent).

        Raises:
            QuotaExceeded: ``owner`` has ``per_key`` answers under way (reason ``concurrent_reads``).
        """
        if self.held(owner) >= self.per_key:
            raise QuotaExceeded(
                f"key {owner!r} has {self.per_key} downloads or job lists under way, its limit "
                "(PTC_MAX_READS_PER_KEY); retry when one has been read",
                "concurrent_reads",
                self.per_key,
                self.retry_after_s,
            )
        self._held[owner] = self.held(owner) + 1
        given_back = False

        def release() -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            left = self._held.get(owner, 1) - 1
            if left > 0:
                self._held[owner] = left
            else:
                self._held.pop(owner, None)

        return release


def holding(pieces: AsyncIterator[bytes], *ends: Callable[[], None]) -> AsyncIterator[bytes]:
    """``pieces``, then each of ``ends`` (idempotent: a slot's release, closing a file) once they end, fail, or
    are dropped unsent (a response never sent never starts its pieces, so no ``finally`` of theirs runs)."""

    def end() -> None:
        for each in ends:
            each()

    async def sent() -> AsyncIterator[bytes]:
        try:
            async for piece in pieces:
                yield piece
        finally:
            end()

    held = sent()
    weakref.finalize(held, end)
    return held
