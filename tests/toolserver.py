"""A real HTTP tool server for the tests (stdlib ``http.server`` on 127.0.0.1, in a thread).

Routes (POST, JSON object body = the tool's arguments):

- ``/triangle_area``   ``{"base", "height"}`` -> ``0.5 * base * height``
- ``/circumference``   ``{"radius"}`` -> ``2 * pi * radius``
- ``/square_perimeter`` ``{"side"}`` -> ``4 * side``
- ``/population``      ``{"country"}`` -> ``{"country", "population"}`` from ``POPULATIONS`` (404 if unknown)
- ``/hang``            never answers within the test's tool timeout (sleeps ``HANG_S``)
- ``/fail``            answers 500 with a text body
- ``/not_json``        answers 200 with a body that is not JSON
- ``/trickle``         answers 200 but sends its body one byte every 0.5 s (for ``HANG_S``)
- ``/flaky``           ``{"key"}``: answers 503 to the first two calls with a key, then ``{"key", "calls"}``
- ``/slow``            sleeps 0.1 s, answers ``{"ok": true}``; ``max_in_flight`` keeps the most at once
- ``/wrong_shape``     answers ``{"ok": "yes"}`` (for output-schema checks)
- ``/auth_echo``       answers 401 with the request's Authorization header in its body
- ``/echo``            answers ``{"args": <the arguments as received>}`` (stdlib ``json``: integers exact)
- ``/big``             answers ``BIG_RESULT`` (integers past 64 bits)
- ``/nested``          answers ``NESTED``: 8 MiB of ``[[],[],...]`` (costly to parse and walk, cheap to send)

``headers`` keeps the headers of every request, in order.

Every request is appended to ``requests`` as ``(path, args)``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

POPULATIONS = {
    "China": 1_411_750_000,
    "India": 1_428_627_663,
    "United States": 339_996_563,
    "Indonesia": 277_534_122,
    "Pakistan": 240_485_658,
    "Nigeria": 223_804_632,
    "Brazil": 216_422_446,
}
HANG_S = 30.0
BIG_RESULT = {"id": 12345678901234567890123, "neg": -(2**70), "edge": 2**64, "list": [2**100, -(2**64) - 1]}
NESTED = b"[" + b"[]," * (8 * 1024 * 1024 // 3 - 1) + b"[]]"  # 8 MiB - 1 byte, 2.8 million empty arrays


class ToolServer:
    """Start with ``start()``; ``url(route)`` gives the endpoint URL; ``stop()`` ends it."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.flaky_calls: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                args = json.loads(self.rfile.read(length) or b"null")
                server.requests.append((self.path, args))
                server.headers.append(dict(self.headers))
                if self.path == "/trickle":
                    self.trickle()
                    return
                if self.path == "/auth_echo":
                    denied = f"denied for {self.headers.get('Authorization')}".encode()
                    self.send_response(401)
                    self.send_header("content-length", str(len(denied)))
                    self.end_headers()
                    self.wfile.write(denied)
                    return
                status, body = server.answer(self.path, args)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def trickle(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(int(HANG_S * 2)))
                self.end_headers()
                try:
                    for _ in range(int(HANG_S * 2)):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def answer(self, path: str, args: Any) -> tuple[int, Any]:
        if path == "/flaky":
            with self._lock:
                calls = self.flaky_calls[args["key"]] = self.flaky_calls.get(args["key"], 0) + 1
            return (503, b"try again") if calls <= 2 else (200, {"key": args["key"], "calls": calls})
        if path == "/slow":
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            time.sleep(0.1)
            with self._lock:
                self.in_flight -= 1
            return 200, {"ok": True}
        if path == "/echo":
            return 200, {"args": args}
        if path == "/big":
            return 200, BIG_RESULT
        if path == "/wrong_shape":
            return 200, {"ok": "yes"}
        if path == "/triangle_area":
            return 200, 0.5 * args["base"] * args["height"]
        if path == "/circumference":
            return 200, 2 * math.pi * args["radius"]
        if path == "/square_perimeter":
            return 200, 4 * args["side"]
        if path == "/population":
            country = args["country"]
            if country not in POPULATIONS:
                return 404, {"error": f"unknown country {country}"}
            return 200, {"country": country, "population": POPULATIONS[country]}
        if path == "/hang":
            time.sleep(HANG_S)
            return 200, None
        if path == "/fail":
            return 500, b"internal failure in the tool"
        if path == "/nested":
            return 200, NESTED
        if path == "/not_json":
            return 200, b"<html>not json</html>"
        return 404, {"error": "no such route"}

    def url(self, route: str) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/{route}"

    def start(self) -> ToolServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def main() -> None:
    """``python -m tests.toolserver [--port N]``: serve the demo tools until interrupted (README example)."""
    import argparse

    parser = argparse.ArgumentParser(description="Demo HTTP tool server for ptc-sandbox (127.0.0.1 only).")
    parser.add_argument("--port", type=int, default=8765)
    port = parser.parse_args().port
    server = ToolServer(port)
    print(f"demo tools on http://127.0.0.1:{port}/{{triangle_area,circumference,square_perimeter,population}}")
    try:
        server._httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
