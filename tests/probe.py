"""A /healthz probe for load and attack runs (tests and bench/): is the service still answering others?

The probe runs in a process of its own (``python -m tests.probe``): a thread of the test's process shared its GIL
and its garbage collector, so the test's own work was timed too. The 8 MiB view of
``test_healthz_stays_responsive_while_a_jobs_http_tool_returns_8_mib``, parsed by the test while the probe ran,
took 1.1 s there (a fresh process; most of it collections walking the million lists it makes), longer late in a
full run (each full collection of the test process 0.3-0.4 s): the lone 2.5-4.7 s "outliers" that test saw.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import httpx

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


class ProbeFailed(AssertionError):
    """The service did not answer ``/healthz`` (an error, or a non-2xx status with ``strict``)."""


class HealthProbe:
    """``GET {url}/healthz`` every ``interval_s`` from a process of its own while a ``with`` block runs; keeps each
    latency. Entering returns once the probe's first answer came (at most ``timeout_s``).

    ``latencies``: seconds, one per answer, in order. A non-2xx answer counts as a latency too when ``strict`` is
    False; with ``strict``, or when a request fails, the probe ends and ``ProbeFailed`` is raised on leaving the
    block (unless the block raised). ``stalls``: seconds, how late the probe process's own 10 ms sleeps woke, the
    worst of each second: what the host's scheduling alone added to any latency then (a loaded machine).
    """

    def __init__(self, url: str, timeout_s: float = 120, interval_s: float = 0.05, strict: bool = True) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.strict = strict
        self.latencies: list[float] = []
        self.stalls: list[float] = []
        self._problem: str | None = None
        self._first = threading.Event()
        self._process: subprocess.Popen[str] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            kind, _, value = line.rstrip("\n").partition(" ")
            if kind == "latency":
                self.latencies.append(float(value))
            elif kind == "stall":
                self.stalls.append(float(value))
            else:
                self._problem = value
            self._first.set()
        self._first.set()

    def __enter__(self) -> HealthProbe:
        argv = [sys.executable, "-m", "tests.probe", self.url, str(self.timeout_s), str(self.interval_s)]
        self._process = subprocess.Popen(
            [*argv, "strict" if self.strict else "lenient"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._reader.start()
        if not self._first.wait(self.timeout_s + 30):
            self._stop()
            raise ProbeFailed(f"no /healthz answer from {self.url} within {self.timeout_s} s")
        return self

    def _stop(self) -> int:
        """End the probe process; its exit status (``-9``: killed, not ended within ``timeout_s``)."""
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.close()  # the probe's end of file: it stops after the request in flight
        try:
            return self._process.wait(self.timeout_s + 30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait()
        finally:
            self._reader.join()
            assert self._process.stdout is not None
            self._process.stdout.close()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        status = self._stop()
        if status != 0 and self._problem is None:
            self._problem = f"the probe process ended with status {status}"
        if self._problem is not None and kind is None:
            raise ProbeFailed(self._problem)

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
    result, probe = probed(url, work, timeout_s)
    return result, probe.latencies


def probed(url: str, work: Callable[[], T], timeout_s: float = 120) -> tuple[T, HealthProbe]:
    """Run ``work()`` under a ``HealthProbe`` of ``url``; returns its result and the probe (latencies, stalls)."""
    with HealthProbe(url, timeout_s=timeout_s) as probe:
        result = work()
    return result, probe


def _probe(url: str, timeout_s: float, interval_s: float, strict: bool) -> None:
    """The probe process: one line per answer on stdout (``latency <seconds>``), or ``problem <text>`` and the end;
    each second, ``stall <seconds>``: the worst lateness of its own 10 ms sleeps; stops at the end of its stdin."""
    stopping = threading.Event()
    saying = threading.Lock()

    def say(kind: str, text: object) -> None:
        """One whole line on stdout: the two threads' lines never interleave (``print`` writes its parts one by one,
        so a ``latency`` line could be cut by a ``stall`` one, which the reader took for a failed probe)."""
        with saying:
            sys.stdout.write(f"{kind} {text}\n")
            sys.stdout.flush()

    def wait_for_the_end() -> None:
        sys.stdin.read()
        stopping.set()

    def watch_the_clock() -> None:
        worst, since = 0.0, time.monotonic()
        while not stopping.is_set():
            began = time.monotonic()
            time.sleep(0.01)
            worst = max(worst, time.monotonic() - began - 0.01)
            if time.monotonic() - since >= 1:
                say("stall", worst)
                worst, since = 0.0, time.monotonic()

    threading.Thread(target=wait_for_the_end, daemon=True).start()
    threading.Thread(target=watch_the_clock, daemon=True).start()
    with httpx.Client(timeout=timeout_s) as client:
        while not stopping.is_set():
            begin = time.perf_counter()
            try:
                answer = client.get(f"{url}/healthz")
                if strict:
                    answer.raise_for_status()
            except httpx.HTTPError as exc:
                say("problem", f"{type(exc).__name__}: {exc}"[:500].replace("\n", " "))
                return
            say("latency", time.perf_counter() - begin)
            stopping.wait(interval_s)


if __name__ == "__main__":
    _probe(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "strict")
