"""The cyclic garbage collector paused around large JSON parses, on any thread (one counter for the service), and
kept off what start-up made (``freeze_startup``).

Parsing allocates one object per JSON value, none in a cycle; with the collector on, those allocations
trigger collections that walk every object of the process again and again while holding the GIL, so the
event loop waits even when the parse runs on a worker thread: 2.4 million empty arrays parse in 0.9 s with
it, 0.05 s without (1 MiB of ``[[],[],...]``: 0.18 s against 0.03 s). Used for request bodies
(``api.bodies.parse_body``) and for tool-call lines and results (``broker``).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_GC_PAUSE = threading.Lock()
GC_PAUSE_MAX_S = 1.0  # paused longer (parses overlapping back to back): each parse's end collects young cycles
_gc_pauses = 0
_gc_was_enabled = True
_gc_paused_at = 0.0


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the block runs (counted: off until the last of several ends).

    Objects that die meanwhile still go by reference counting; only cycles wait for the collector's next run
    (at most ``GC_PAUSE_MAX_S`` for young ones while parses overlap back to back).
    """
    global _gc_pauses, _gc_was_enabled, _gc_paused_at
    with _GC_PAUSE:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            _gc_paused_at = time.monotonic()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _GC_PAUSE:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()
            overdue = _gc_pauses > 0 and _gc_was_enabled and time.monotonic() - _gc_paused_at > GC_PAUSE_MAX_S
            if overdue:
                _gc_paused_at = time.monotonic()
        if overdue:  # under a stream of bodies the pauses overlap: cycles still get collected, the young ones
            gc.collect(1)


def freeze_startup() -> None:
    """Collect, then move every object made so far (the modules, the app, its services: what start-up made, kept for
    the process's life) to the collector's permanent generation (``gc.freeze``): a full collection then walks only
    what was made since (without it, each full collection walks every object of start-up again). Call once, at
    the end of start-up."""
    gc.collect()
    gc.freeze()
