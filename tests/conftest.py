"""Fixtures: a real ptc-sandbox service process on the real Docker engine, and a real HTTP tool server.

Integration tests skip when no engine or sandbox image is present, except
under ``CI=true``, where that is a failure. Isolation tests take ``runtime_api``
(or ``runtime``) and run once per OCI runtime in ``RUNTIMES``: ``runc`` on the
shared service, ``runsc`` (gVisor) on a second service started with
``PTC_RUNTIME=runsc``; an engine without ``runsc`` skips those (fails under CI).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import docker
import httpx
import pytest

from service.sandbox.docker import runtime_problem
from service.sandbox.labels import LABEL_INSTANCE, LABEL_JOB
from service.tenancy import hash_token
from tests.toolserver import ToolServer

IMAGE = os.environ.get("PTC_SANDBOX_IMAGE", "ptc-sandbox-runtime:latest")
ROOT = Path(__file__).resolve().parent.parent
RUNTIMES = ("runc", "runsc")
"""The OCI runtimes the isolation tests run under: the engine's default and gVisor."""
TEST_EGRESS_RULES = ("*://localhost:*", "*://127.0.0.0/8:*", "*://[::1]:*")
"""``PTC_EGRESS_ALLOW`` of the services the tests start, in-process (``pytest_configure``) and as processes
(``start_service``): the tests' tool servers, MCP servers and callback receivers listen on the loopback at ports
chosen when they start (and the own-address tests aim at every spelling of it). The default allows nothing; a test
of the default removes the variable."""


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def missing(problem: str, *, xfail: bool = False) -> NoReturn:
    """A test's prerequisite (a tool, a package, a free port) is missing: skip (``xfail``: an expected failure)
    on a developer's machine; under ``CI=true`` fail, as ``deploy/local.sh setup`` installs every one."""
    if in_ci():
        pytest.fail(problem)
    if xfail:
        pytest.xfail(problem)
    pytest.skip(problem)


def _engine_problem() -> str | None:
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(IMAGE)
    except Exception as exc:
        return f"no Docker engine with image {IMAGE}: {exc}"
    return None


@pytest.fixture(scope="session")
def engine() -> docker.DockerClient:
    """The real engine; skips (fails under CI=true) without one."""
    problem = _engine_problem()
    if problem:
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)
    return docker.from_env()


def require_runtime(engine: docker.DockerClient, runtime: str) -> None:
    """Skip (fail under CI=true) unless the engine has ``runtime`` registered as the service needs it (gVisor
    with ``--oci-seccomp``; ``deploy/local.sh setup`` does it)."""
    problem = runtime_problem(runtime, engine.info().get("Runtimes") or {})
    if problem:
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    """A running ``ptc-sandbox serve`` process; ``token`` is the API key its ``client()`` sends."""

    url: str
    instance_id: str
    work_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    token: str = ""

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header of ``token``."""
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """``kill -9``: no shutdown of any kind (its sandboxes stay, its lease is left to pass)."""
        self.process.kill()
        self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


INTERNAL_SECRET = "ptc-tests-internal-secret-" + secrets.token_hex(16)
"""``PTC_INTERNAL_SECRET`` of every service the tests start (one per test run: replicas of a test share it)."""


def pytest_configure(config: pytest.Config) -> None:
    """Services built in-process (``Settings()``) read ``PTC_EGRESS_ALLOW``: the tests' loopback servers, unless the
    environment names others."""
    os.environ.setdefault("PTC_EGRESS_ALLOW", ",".join(TEST_EGRESS_RULES))


def start_service(instance_id: str, work_dir: Path, probe: str = "/readyz", **env: str | None) -> Service:
    """Start the service as a subprocess and wait until ``probe`` answers 200 (on ``env``'s ``PTC_PORT`` if given,
    else a free port). A variable of ``env`` given as None is removed from the service's environment.

    Egress is ``TEST_EGRESS_RULES`` unless the environment or ``env`` says otherwise.

    Authentication is on: a new API key (name ``pytest``, which may read ``/metrics``) is configured, and
    ``Service.client()`` sends it.
    """
    port = int(env.get("PTC_PORT") or free_port())
    log_path = work_dir.with_suffix(".log")
    token = secrets.token_urlsafe(32)
    environ = {
        **os.environ,
        "PTC_PORT": str(port),
        "PTC_INSTANCE_ID": instance_id,
        "PTC_WORK_DIR": str(work_dir),
        "PTC_SANDBOX_IMAGE": IMAGE,
        "PTC_AUTH": "required",
        "PTC_API_KEYS": f"pytest:{hash_token(token)}",
        "PTC_METRICS_KEYS": "pytest",  # the suite scrapes /metrics with its key (the metrics and monitoring tests)
        "PTC_INTERNAL_SECRET": INTERNAL_SECRET,  # needed with PTC_STORE_URL; the same for every replica of a test
        "PTC_EGRESS_ALLOW": os.environ.get("PTC_EGRESS_ALLOW", ",".join(TEST_EGRESS_RULES)),
        "PTC_DRAIN_S": "3",  # a stop waits at most this for running jobs (Service.stop gives the process 20 s)
        **{name: value for name, value in env.items() if value is not None},
    }
    for name in [name for name, value in env.items() if value is None]:
        del environ[name]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"], cwd=ROOT, env=environ, stdout=log_file, stderr=subprocess.STDOUT
        )
    service = Service(f"http://127.0.0.1:{port}", instance_id, work_dir, process, log_path, token)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"service exited with {process.returncode}:\n{service.log()}")
        try:
            if httpx.get(f"{service.url}{probe}", timeout=2).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    service.stop()
    raise RuntimeError(f"service not ready in 30 s:\n{service.log()}")


def auth_headers(service: Service | None) -> dict[str, str]:
    """The headers for a benchmark's service: its own key, or for ``--url`` the token in ``PTC_TOKEN`` (if set)."""
    if service is not None:
        return service.headers
    token = os.environ.get("PTC_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def labelled_containers(engine: docker.DockerClient, instance_id: str, include_pool: bool = False) -> list[Any]:
    """Sandboxes of a service instance that hold (or held) a job; with ``include_pool``, its warm pool's too."""
    found = engine.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={instance_id}"}, ignore_removed=True)
    return [c for c in found if include_pool or LABEL_JOB in c.labels]


def pool_ready(api: httpx.Client, profile: str | None = None) -> int:
    """Sandboxes of the service's warm pools (of ``profile``, e.g. ``default``; None: all) ready for a job now
    (``ptc_sandbox_pool_size``): what a job is given from the pool. A container of the pool that the engine
    lists may still be starting; a job that comes then starts cold."""
    prefix = "ptc_sandbox_pool_size{" + (f'profile="{profile}"' if profile is not None else "")
    text = api.get("/metrics").raise_for_status().text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(prefix))


def stop_clean(engine: docker.DockerClient, svc: Service) -> None:
    """Stop ``svc``; then no container it labelled (pool included) may remain (AssertionError naming them)."""
    svc.stop()
    left = labelled_containers(engine, svc.instance_id, include_pool=True)
    assert not left, f"containers left behind: {[c.name for c in left]}"


def container_gone(engine: docker.DockerClient, container_id: str) -> bool:
    """Whether the engine no longer has the container."""
    try:
        engine.containers.get(container_id)
    except docker.errors.NotFound:
        return True
    return False


@pytest.fixture(scope="session")
def scratch() -> Iterator[Path]:
    """A short temporary folder (unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ptc", dir="/tmp"))
    yield path
    if not os.environ.get("PTC_TEST_KEEP_SCRATCH"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """The shared service; at the end, no container it labelled may remain."""
    svc = start_service(f"pytest-{secrets.token_hex(4)}", scratch / "svc")
    yield svc
    stop_clean(engine, svc)


SMALL_TOKEN = secrets.token_urlsafe(32)
SMALL_KEY_LIMITS = '{"small": {"timeout_s": 1, "tools": 2}}'


@pytest.fixture(scope="session")
def restricted_service(engine: docker.DockerClient, scratch: Path, tool_server: ToolServer) -> Iterator[Service]:
    """A second service with narrow operator settings: egress only to the tool server's port, timeouts and
    waits of at most 10 s, no warm pool, and besides its ``pytest`` key a key ``small`` (token ``SMALL_TOKEN``,
    from ``PTC_API_KEYS_FILE``) limited to ``timeout_s`` 1 and 2 tools."""
    port = tool_server.url("").rsplit(":", 1)[1].split("/")[0]
    keys_file = scratch / "restricted.keys"
    keys_file.write_text(f"# the small agent\nsmall:{hash_token(SMALL_TOKEN)}\n")
    svc = start_service(
        f"pytest-{secrets.token_hex(4)}",
        scratch / "restricted",
        PTC_WARM_POOL_SIZE="0",
        PTC_EGRESS_ALLOW=f"http://127.0.0.1:{port}",
        PTC_API_KEYS_FILE=str(keys_file),
        PTC_KEY_LIMITS=SMALL_KEY_LIMITS,
        PTC_MAX_TIMEOUT_S="10",
        PTC_DEFAULT_TIMEOUT_S="10",
        PTC_MAX_WAIT_S="10",
        PTC_DEFAULT_WAIT_S="10",
        PTC_CALLBACK_SECRET=secrets.token_hex(16),
    )
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="session")
def api(service: Service) -> Iterator[httpx.Client]:
    with service.client() as client:
        yield client


@pytest.fixture(scope="session")
def runsc_service(engine: docker.DockerClient, scratch: Path) -> Iterator[Service]:
    """A second service whose sandboxes run under gVisor; at the end, no container it labelled may remain."""
    require_runtime(engine, "runsc")
    svc = start_service(f"pytest-runsc-{secrets.token_hex(4)}", scratch / "svc-runsc", PTC_RUNTIME="runsc")
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest, engine: docker.DockerClient) -> str:
    """Each OCI runtime of ``RUNTIMES`` in turn (a test taking it runs once per runtime)."""
    name: str = request.param
    require_runtime(engine, name)
    return name


@pytest.fixture
def runtime_service(request: pytest.FixtureRequest, runtime: str) -> Service:
    """The service whose sandboxes run under ``runtime``."""
    svc: Service = request.getfixturevalue("runsc_service" if runtime == "runsc" else "service")
    return svc


@pytest.fixture(scope="session")
def runsc_api(runsc_service: Service) -> Iterator[httpx.Client]:
    with runsc_service.client() as client:
        yield client


@pytest.fixture
def runtime_api(request: pytest.FixtureRequest, runtime: str) -> httpx.Client:
    """A client of ``runtime_service`` (a test taking it runs once per runtime)."""
    client: httpx.Client = request.getfixturevalue("runsc_api" if runtime == "runsc" else "api")
    return client


@pytest.fixture(scope="session")
def tool_server() -> Iterator[ToolServer]:
    server = ToolServer().start()
    yield server
    server.stop()


def wait_until(condition: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> None:
    """Poll ``condition`` until it is truthy; fails the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        time.sleep(interval_s)


def execute(api: httpx.Client, script: str, tools: list[dict[str, Any]] | None = None, **body: Any) -> dict[str, Any]:
    """POST /execute and return the job view (asserts 200)."""
    response = api.post("/execute", json={"script": script, "tools": tools or [], **body})
    assert response.status_code == 200, response.text
    view: dict[str, Any] = response.json()
    return view


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under ``tests/integration/`` carries the ``integration`` marker (``-m "not integration"`` runs
    the rest, which needs no engine)."""
    integration = ROOT / "tests" / "integration"
    for item in items:
        if integration in item.path.parents and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def postgres() -> None:
    """PostgreSQL for the store tests (``tests.pgstore``); skips (fails under CI=true) without one."""
    from tests import pgstore

    problem = pgstore.problem()
    if problem:
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture
def postgres_url(postgres: None) -> Iterator[str]:
    """The URL of a fresh, empty PostgreSQL database for one test (dropped after it)."""
    from tests import pgstore

    with pgstore.fresh_database() as url:
        yield url


STORE_KINDS = ("sqlite", "postgresql")
"""The job stores every store test runs against (``store_kind`` fixture)."""


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Each job store kind in turn: a test taking it (or ``make_store``) runs once per kind."""
    return str(request.param)


@pytest.fixture
def make_store(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Any]:
    """A factory of (unopened) job stores of ``store_kind``, all on the same database or file for this test."""
    from service.store.pg import PostgresJobStore
    from service.store.sqlite import SQLiteJobStore

    if store_kind == "sqlite":
        return lambda: SQLiteJobStore(tmp_path / "jobs.sqlite3")
    url = request.getfixturevalue("postgres_url")
    return lambda: PostgresJobStore(url, timeout_s=5.0)


@pytest.fixture
async def store(make_store: Callable[[], Any]) -> AsyncIterator[Any]:
    """An opened job store of each kind in turn (``store_kind``: SQLite, PostgreSQL), closed after the test."""
    opened = make_store()
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def script_uids(engine: docker.DockerClient, image: str = IMAGE) -> range:
    """The uids a script in a sandbox of ``image`` may run as: its ``io.ptc-sandbox.uids`` range (one per sandbox,
    ``DockerBackend._create_with_uid``), or 10001 alone for an image without one."""
    from service.sandbox.labels import uid_range

    return uid_range(engine.images.get(image).labels or {}) or range(10001, 10002)
