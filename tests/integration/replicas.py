"""The replicas' cluster for the integration tests (docs/scaling.md, Tests): two real ``ptc-sandbox serve``
processes (``t1``, ``t2``: their own work dirs, ports and ``PTC_INSTANCE_ID``, ``t1-<random>``, ``t2-<random>``:
two clusters on one engine never sweep each other's sandboxes) on the shared engine and one fresh
PostgreSQL database, with HAProxy (Debian's package, ``deploy/local.sh setup`` installs it) in front on
127.0.0.1, round-robin, health-checked on ``/readyz`` (``deploy/replicas/haproxy.cfg``).

Without HAProxy, PostgreSQL (``PTC_TEST_STORE_URL``) or the engine the tests skip; under ``CI=true`` they fail.
At the end both services are stopped (no container of theirs may remain) and so is HAProxy.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import docker
import httpx
import pytest

from service.tenancy import hash_token
from tests.conftest import ROOT, Service, free_port, in_ci, start_service, stop_clean

HAPROXY_CFG = ROOT / "deploy" / "replicas" / "haproxy.cfg"
REPLICA_ENV = {
    "PTC_WARM_POOL_SIZE": "2",
    "PTC_REPLICA_HEARTBEAT_S": "0.5",
    "PTC_REPLICA_LEASE_S": "3",
    "PTC_REPLICA_SCAN_S": "0.5",
    "PTC_PROGRESS_SAVE_S": "0.5",
    "PTC_QUOTA_RUNNING_JOBS": "4",  # the kill test's three running jobs on one replica, of one key
    "PTC_CALLBACK_SECRET": "the-replicas-callback-secret",  # the same on both: either may deliver a callback
}
"""Settings of both replicas (docs/scaling.md, Tests): short heartbeats and leases."""


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)


def require(problem: str | None) -> None:
    """Skip with ``problem`` (fail under CI=true); nothing when None."""
    if problem:
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)


@dataclass
class Cluster:
    """Two replicas on one store behind HAProxy; every client sends the one API key both replicas know.
    ``members`` holds each replica's current process (``restart`` replaces it); ``env`` is what both were given."""

    members: dict[str, Service]
    balancer_url: str
    store_url: str
    token: str
    env: dict[str, str]
    other_token: str = ""
    """The token of another key (``other``) both replicas know: another tenant."""

    @property
    def t1(self) -> Service:
        return self.members["t1"]

    @property
    def t2(self) -> Service:
        return self.members["t2"]

    @property
    def replicas(self) -> tuple[Service, Service]:
        return (self.t1, self.t2)

    def name_of(self, instance_id: str) -> str:
        """``t1`` or ``t2`` for a replica's instance id."""
        return next(name for name, svc in self.members.items() if svc.instance_id == instance_id)

    def restart(self, name: str) -> Service:
        """Start ``name`` again (after ``kill``): the same instance id, work dir and port (HAProxy's backend)."""
        old = self.members[name]
        port = int(old.url.rsplit(":", 1)[1])
        svc = start_service(old.instance_id, old.work_dir, **{**self.env, "PTC_PORT": str(port)})
        svc.token = self.token
        self.members[name] = svc
        return svc

    def client(self, url: str, timeout: float = 120.0, token: str | None = None) -> httpx.Client:
        bearer = token or self.token
        return httpx.Client(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {bearer}"})

    def balancer(self, timeout: float = 120.0) -> httpx.Client:
        return self.client(self.balancer_url, timeout)


class Balancer:
    """``haproxy -db -f deploy/replicas/haproxy.cfg`` in the foreground, on a free port of 127.0.0.1."""

    def __init__(self, binary: str, backends: tuple[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {
            **os.environ,
            "PTC_LB_BIND": f"127.0.0.1:{self.port}",
            "PTC_REPLICA_1": backends[0],
            "PTC_REPLICA_2": backends[1],
        }
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(HAPROXY_CFG)], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Until the balancer answers ``/readyz`` with 200 (a replica behind it is up); RuntimeError else."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"haproxy not ready in {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(engine: docker.DockerClient, postgres: None, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The module's cluster: a fresh PostgreSQL database, ``t1`` and ``t2``, HAProxy; all stopped after. A test
    module's ``CLUSTER_ENV`` (a dict), if it has one, is added to both replicas' settings."""
    from tests import pgstore

    binary = haproxy_binary()
    require(None if binary else "no haproxy (deploy/local.sh setup installs Debian's package)")
    assert binary is not None
    scratch = Path(tempfile.mkdtemp(prefix="ptcc", dir="/tmp"))  # short: the sandboxes' unix sockets live here
    token, other = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    keys = {
        "PTC_API_KEYS": f"pytest:{hash_token(token)},other:{hash_token(other)}",  # other: another tenant
        "PTC_INTERNAL_SECRET": secrets.token_urlsafe(32) + " " + secrets.token_urlsafe(32),  # the same on both
        **REPLICA_ENV,
        **getattr(request.module, "CLUSTER_ENV", {}),
    }
    try:
        with pgstore.fresh_database() as store_url, ExitStack() as stack:
            made = Cluster({}, "", store_url, token, {"PTC_STORE_URL": store_url, **keys}, other)

            def stop(name: str) -> None:
                if made.members[name].process.poll() is not None:  # killed: its restart sweeps what it left
                    made.restart(name)
                stop_clean(engine, made.members[name])

            suffix = secrets.token_hex(3)  # the engine is shared: another cluster's sweep must not take these
            for name in ("t1", "t2"):
                work_dir = scratch / name
                work_dir.mkdir()
                svc = start_service(f"{name}-{suffix}", work_dir, **made.env)
                svc.token = token
                made.members[name] = svc
                stack.callback(stop, name)  # the last started is stopped first (its current process)
            backends = (made.t1.url.removeprefix("http://"), made.t2.url.removeprefix("http://"))
            balancer = Balancer(binary, backends, scratch / "haproxy.log")
            stack.callback(balancer.stop)  # before the services
            balancer.wait_ready()
            made.balancer_url = balancer.url
            yield made
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
