"""A service started while its engine cannot be reached says so, and serves fully once the engine answers.

The engine is never stopped: the service is pointed at a socket of the test's own (``PTC_DOCKER_HOST``) where nothing
listens at first; the test then forwards that socket to the real engine's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import docker
import pytest

from service.sandbox.labels import LABEL_INSTANCE, LABEL_POOL
from tests.conftest import missing, start_service

pytestmark = pytest.mark.integration


class Forwarder:
    """A unix socket at ``path`` whose connections are forwarded, byte for byte both ways, to ``target``."""

    def __init__(self, path: Path, target: str) -> None:
        self.target = target
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(64)
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="engine forwarder", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.target)
            with self.lock:
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()
        with self.lock:
            for s in self.open:
                with contextlib.suppress(OSError):
                    s.close()


def engine_socket() -> str:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        missing(f"the engine is not on a unix socket ({host})")
    return host.removeprefix("unix://")


def test_engine_down_at_start_is_engine_unavailable_then_the_pool_fills(
    engine: docker.DockerClient, scratch: Path
) -> None:
    late = scratch / f"late-{secrets.token_hex(3)}.sock"
    instance = f"pytest-late-{secrets.token_hex(4)}"
    svc = start_service(
        instance, scratch / instance, probe="/healthz", PTC_DOCKER_HOST=f"unix://{late}", PTC_WARM_POOL_SIZE="1"
    )
    forwarder: Forwarder | None = None
    try:
        with svc.client(timeout=60) as api:
            refused = api.post("/sessions", json={})
            assert refused.status_code == 503, refused.text
            assert refused.json()["title"] == "Container engine unavailable", refused.json()

            forwarder = Forwarder(late, engine_socket())
            deadline = time.monotonic() + 60
            pooled: list[object] = []
            while time.monotonic() < deadline and not pooled:
                found = engine.containers.list(filters={"label": f"{LABEL_INSTANCE}={instance}"}, ignore_removed=True)
                pooled = [c for c in found if c.labels.get(LABEL_POOL) == "default" and c.status == "running"]
                time.sleep(0.5)
            assert "warm pool off" not in svc.log()
            assert pooled, f"no pooled sandbox within 60 s of the engine answering:\n{svc.log()[-3000:]}"

            created = api.post("/sessions", json={})
            assert created.status_code == 201, created.text
            assert api.delete(f"/sessions/{created.json()['session_id']}").status_code in (200, 204)
            executed = api.post("/execute", json={"script": "print(6 * 7)"}).json()
            assert executed["status"] == "succeeded" and executed["stdout"] == "42\n", executed
    finally:
        svc.stop()
        if forwarder is not None:
            forwarder.close()
        left = engine.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={instance}"})
        for container in left:
            container.remove(force=True)
        assert not left, f"containers left behind: {[c.name for c in left]}"
