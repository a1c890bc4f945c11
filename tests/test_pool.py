"""The warm pool: default-profile jobs start in a sandbox started ahead of time, used once, refilled."""

from __future__ import annotations

import signal
from pathlib import Path

import docker
import httpx
import pytest

from tests.conftest import Service, execute, labelled_containers, start_service, wait_until


def pooled(engine: docker.DockerClient, instance: str) -> list[object]:
    return [c for c in labelled_containers(engine, instance, include_pool=True) if "io.ptc-sandbox.job" not in c.labels]


def test_default_jobs_run_warm_and_others_cold(
    api: httpx.Client, engine: docker.DockerClient, service: Service
) -> None:
    wait_until(lambda: len(pooled(engine, service.instance_id)) == 4, 30)
    first = execute(api, "import tools\nprint(tools.t()['tool'])", [{"name": "t", "endpoint": {"kind": "echo"}}])
    second = execute(api, "print(2)")
    assert (first["sandbox_start"], first["stdout"]) == ("warm", "t\n")
    assert (second["sandbox_start"], second["stdout"]) == ("warm", "2\n")
    assert first["sandbox_id"] != second["sandbox_id"]  # never handed out twice
    for view in (first, second):
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(view["sandbox_id"])  # destroyed with its job
    cold = execute(api, "print(3)", limits={"memory_mb": 128})
    assert (cold["sandbox_start"], cold["stdout"]) == ("cold", "3\n")
    env = execute(api, "import os\nprint(os.environ['X'])", env={"X": "y"})
    assert (env["sandbox_start"], env["stdout"]) == ("cold", "y\n")
    wait_until(lambda: len(pooled(engine, service.instance_id)) == 4, 30)  # refilled to its size


def test_timeout_counts_from_the_job_not_the_pooled_start(
    api: httpx.Client, engine: docker.DockerClient, service: Service
) -> None:
    wait_until(lambda: len(pooled(engine, service.instance_id)) >= 1, 30)
    view = execute(api, "import time\ntime.sleep(1.5)\nprint('ok')", timeout_s=2)
    assert view["status"] == "succeeded" and view["sandbox_start"] == "warm"


def test_pool_sandboxes_left_by_a_crash_are_swept(engine: docker.DockerClient, scratch: Path) -> None:
    first = start_service("pytest-pool-crash", scratch / "pool-crash", PTC_WARM_POOL_SIZE="2")
    wait_until(lambda: len(pooled(engine, "pytest-pool-crash")) == 2, 30)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_service("pytest-pool-crash", scratch / "pool-crash", PTC_WARM_POOL_SIZE="0")
    try:
        assert labelled_containers(engine, "pytest-pool-crash", include_pool=True) == []
    finally:
        second.stop()
