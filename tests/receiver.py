"""A callback receiver for the tests: an HTTP server on 127.0.0.1 that records every delivery."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


class Receiver:
    """A callback receiver on 127.0.0.1 that answers 500 to the first ``failures`` deliveries."""

    def __init__(self, failures: int, port: int = 0) -> None:
        self.deliveries: list[tuple[int, dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                status = 500 if len(receiver.deliveries) < failures else 204
                receiver.deliveries.append((status, dict(self.headers), body))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"

    def close(self) -> None:
        """Stop serving and close the listening socket (``shutdown`` alone leaves it open)."""
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(failures=2)
    yield r
    r.close()
