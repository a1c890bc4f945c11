"""A /healthz probe for load and attack runs (tests and bench/): is the service still answering others?"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import httpx

T = TypeVar("T")


class HealthProbe:
    """``GET {url}/healthz`` every ``interval_s`` while a ``with`` block runs; keeps each latency.

    ``latencies``: seconds, one per answer, in order. A non-2xx answer counts as a latency too when ``strict`` is
    False; with ``strict`` it ends the probe with the ``httpx.HTTPStatusError`` re-raised on leaving the block.
    """

    def __init__(self, url: str, timeout_s: float = 120, interval_s: float = 0.05, strict: bool = True) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.strict = strict
        self.latencies: list[float] = []
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout_s) as client:
                while not self._stopping.is_set():
                    begin = time.perf_counter()
                    answer = client.get(f"{self.url}/healthz")
                    if self.strict:
                        answer.raise_for_status()
                    self.latencies.append(time.perf_counter() - begin)
                    self._stopping.wait(self.interval_s)
        except BaseException as exc:  # handed to the thread that leaves the block
            self._error = exc

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stopping.set()
        self._thread.join()
        if self._error is not None and kind is None:
            raise self._error

    def summary_ms(self) -> dict[str, float | int | None]:
        """``healthz_median_ms``, ``healthz_max_ms`` (ms, one decimal; None without a sample), ``healthz_probes``."""
        samples = [s * 1000 for s in self.latencies]
        return {
            "healthz_median_ms": round(statistics.median(samples), 1) if samples else None,
            "healthz_max_ms": round(max(samples), 1) if samples else None,
            "healthz_probes": len(samples),
        }


def healthz_while(url: str, work: Callable[[], T], timeout_s: float = 120) -> tuple[T, list[float]]:
    """Run ``work()`` under a ``HealthProbe`` of ``url``; returns its result and the latencies (s)."""
    with HealthProbe(url, timeout_s=timeout_s) as probe:
        result = work()
    return result, probe.latencies
