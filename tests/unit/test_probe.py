"""The /healthz probe times the service, not the process that runs it (tests/probe.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port
from tests.probe import HealthProbe, ProbeFailed

# A /healthz that answers after 50 ms: a request of the probe is nearly always in flight.
SLOW_HEALTHZ = """
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args): pass
    def do_GET(self):
        time.sleep(0.05)
        status = 200 if self.path == "/healthz" else 404
        self.send_response(status)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.fixture
def slow_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SLOW_HEALTHZ, str(port)])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the slow /healthz server did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def hold_the_gil(count: int) -> float:
    """Keep this process's GIL while summing ``count`` integers; the seconds it took. ``sum`` over a range runs in C
    without releasing the GIL, as a large JSON parse and the collections it triggers do."""
    began = time.perf_counter()
    sum(range(count))
    return time.perf_counter() - began


def test_the_probes_latencies_do_not_include_the_tests_own_work(slow_url: str) -> None:
    count = int(10**7 / hold_the_gil(10**7))  # about 1 s of holding
    with HealthProbe(slow_url, timeout_s=10, interval_s=0) as probe:
        holds = []
        for _ in range(3):
            holds.append(hold_the_gil(count))
            time.sleep(0.1)
    held = min(holds)
    # A probe thread in this process waited for each hold: three samples of about ``held`` seconds.
    assert len(probe.latencies) > 5 and max(probe.latencies) < min(0.5, held / 2), (held, sorted(probe.latencies)[-3:])


def test_a_failed_answer_ends_a_strict_probe() -> None:
    with pytest.raises(ProbeFailed, match="ConnectError"):
        with HealthProbe(f"http://127.0.0.1:{free_port()}", timeout_s=2):
            time.sleep(0.2)
