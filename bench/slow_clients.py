"""Issue 11, item 12, measured: N connections from one address send half a request line and nothing more.

``python -m bench.slow_clients [--connections 3000] [--seconds 15]`` starts a service with default settings,
opens the connections from 127.0.0.1, and reports how many were refused at once (429), how many the service had
closed after ``--seconds`` (408 after the header timeout), how many were still open, and the latency of a normal
client's ``/healthz`` from 127.0.0.2 meanwhile.
"""

from __future__ import annotations

import argparse
import json
import secrets
import selectors
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import start_service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=15)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ptc-slow-"))
    service = start_service(f"bench-slow-{secrets.token_hex(4)}", scratch / "svc", probe="/healthz")
    host, port = service.url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    try:
        for _ in range(args.connections):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"GET /jobs HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            sock.setblocking(False)
            socks.append(sock)
        started = time.monotonic()
        answers: dict[int, bytes] = {}
        closed_at: dict[int, float] = {}
        selector = selectors.DefaultSelector()
        for i, sock in enumerate(socks):
            selector.register(sock, selectors.EVENT_READ, i)
        latencies = []
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=service.url, transport=transport, timeout=30) as normal:
            next_probe = 0.0
            while time.monotonic() - started < args.seconds:
                if time.monotonic() >= next_probe:
                    t = time.perf_counter()
                    normal.get("/healthz")
                    latencies.append((time.perf_counter() - t) * 1000)
                    next_probe = time.monotonic() + 0.5
                for key, _ in selector.select(timeout=0.1):
                    i = key.data
                    try:
                        chunk = socks[i].recv(65536)
                    except OSError:
                        chunk = b""
                    answers[i] = answers.get(i, b"") + chunk
                    if not chunk:
                        closed_at[i] = time.monotonic() - started
                        selector.unregister(socks[i])
        refused = sum(a.startswith(b"HTTP/1.1 429") for a in answers.values())
        timed_out = sum(a.startswith(b"HTTP/1.1 408") for a in answers.values())
        result = {
            "connections": args.connections,
            "refused_429": refused,
            "closed_408": timed_out,
            "closed_other": len(closed_at) - refused - timed_out,
            "still_open_after_s": {str(args.seconds): args.connections - len(closed_at)},
            "last_408_closed_at_s": round(
                max((closed_at[i] for i, a in answers.items() if a.startswith(b"HTTP/1.1 408")), default=0), 2
            ),
            "healthz_from_another_address_ms": {
                "median": round(statistics.median(latencies), 1),
                "max": round(max(latencies), 1),
            },
        }
    finally:
        for sock in socks:
            sock.close()
        service.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
