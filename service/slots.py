"""The script slots every job shares: the third ledger of admission (``service.quotas`` holds the other two).

``Slots``
    ``concurrency`` slots, taken by every running script, one-shot or in a session, with at most
    ``running_jobs`` of them per owner; waiters are served first come, first served among those
    whose owner is under its cap (one owner at its cap never holds up another's job).

Kept in this process's memory and changed only on the event loop.
"""

from __future__ import annotations

import asyncio
import collections


class Slots:
    """``total`` script slots shared by every job; an owner holds at most its cap of them at once.

    ``of(owner, cap)`` gives the handle a job acquires and releases (an ``asyncio.Semaphore`` look-alike).
    Waiters are served in arrival order among those whose owner is under its cap.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = total
        self._held: collections.Counter[str] = collections.Counter()
        self._waiters: collections.deque[tuple[str, int, asyncio.Future[None]]] = collections.deque()

    def held(self, owner: str) -> int:
        """Slots ``owner`` holds now."""
        return self._held[owner]

    @property
    def in_use(self) -> int:
        """Slots held now."""
        return self.total - self._free

    def of(self, owner: str, cap: int) -> OwnerSlot:
        """The slot handle of one job of ``owner`` (whose cap is ``cap``)."""
        return OwnerSlot(self, owner, cap)

    def _take_now(self, owner: str, cap: int) -> bool:
        if self._free > 0 and self._held[owner] < cap:  # then no waiter can be served (see _serve)
            self._grant(owner)
            return True
        return False

    async def _acquire(self, owner: str, cap: int) -> None:
        if self._take_now(owner, cap):
            return
        future = asyncio.get_running_loop().create_future()
        entry = (owner, cap, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just as it was cancelled: give it back
                self._release(owner)
            else:
                self._waiters.remove(entry)
            raise

    def _grant(self, owner: str) -> None:
        self._free -= 1
        self._held[owner] += 1

    def _release(self, owner: str) -> None:
        self._free += 1
        self._held[owner] -= 1
        if self._held[owner] <= 0:
            del self._held[owner]
        self._serve()

    def _serve(self) -> None:
        """Grant free slots to the earliest waiters whose owner is under its cap."""
        for entry in list(self._waiters):
            if self._free <= 0:
                return
            owner, cap, future = entry
            if future.done():  # cancelled; its task removes it
                continue
            if self._held[owner] < cap:
                self._waiters.remove(entry)
                self._grant(owner)
                future.set_result(None)


class OwnerSlot:
    """One job's handle on ``Slots``: ``await acquire()``, then ``release()`` once."""

    def __init__(self, slots: Slots, owner: str, cap: int) -> None:
        self._slots = slots
        self._owner = owner
        self._cap = cap

    async def acquire(self) -> bool:
        """Wait for a slot (cancellable; nothing is held if cancelled). Returns True, as a semaphore does."""
        await self._slots._acquire(self._owner, self._cap)
        return True

    def take_now(self) -> bool:
        """Take a slot if one is free for this owner now (what ``acquire`` would grant without waiting)."""
        return self._slots._take_now(self._owner, self._cap)

    def release(self) -> None:
        """Give the slot back."""
        self._slots._release(self._owner)
