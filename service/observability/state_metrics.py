"""The gauges computed when scraped (``StateCollector``): ``ptc_jobs{status}``, ``ptc_parked_jobs`` and
``ptc_sandbox_pool_size{profile}``, read from what the service holds (no bookkeeping on the hot path)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.jobs.model import LIVE


class StateCollector(Collector):
    """``ptc_jobs``, ``ptc_parked_jobs`` and ``ptc_sandbox_pool_size``, computed when scraped (no bookkeeping on
    the hot path)."""

    def __init__(self) -> None:
        self.live: Mapping[str, Any] = {}
        self.pools: Callable[[], Mapping[str, int]] = dict
        self.parked: Callable[[], int] = int

    def describe(self) -> Iterable[Metric]:
        return [_jobs_family(), _parked_family(), _pool_family()]

    def collect(self) -> Iterator[Metric]:
        counts = Tally({status.value: 0 for status in LIVE})
        counts.update(str(job.status) for job in list(self.live.values()))
        jobs = _jobs_family()
        for status, count in sorted(counts.items()):
            jobs.add_metric([status], count)
        yield jobs
        parked = _parked_family()
        parked.add_metric([], self.parked())
        yield parked
        pools = _pool_family()
        for profile, ready in sorted(self.pools().items()):
            pools.add_metric([profile], ready)
        yield pools


def _jobs_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "ptc_jobs", "Jobs the service holds now (not yet saved as ended), by status.", labels=["status"]
    )


def _parked_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("ptc_parked_jobs", "Jobs parked now, waiting for the harness without a sandbox.")


def _pool_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "ptc_sandbox_pool_size", "Warm pool sandboxes waiting for a job, by profile.", labels=["profile"]
    )
