"""The warm pool: default-profile jobs start in a sandbox started ahead of time, used once, refilled."""

from __future__ import annotations

import io
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import httpx
import pytest

from tests.conftest import IMAGE, Service, execute, labelled_containers, start_service, wait_until


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


def test_fifty_concurrent_jobs_get_fifty_distinct_sandboxes(api: httpx.Client, engine: docker.DockerClient) -> None:
    with ThreadPoolExecutor(10) as pool:
        views = list(pool.map(lambda i: execute(api, f"print({i})"), range(50)))
    assert [v["stdout"] for v in views] == [f"{i}\n" for i in range(50)]
    ids = [v["sandbox_id"] for v in views]
    assert len(set(ids)) == 50
    assert {v["sandbox_start"] for v in views} <= {"warm", "cold"}
    for sandbox_id in ids:
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(sandbox_id)


def test_pool_stays_off_for_an_image_that_cannot_wait(engine: docker.DockerClient, scratch: Path) -> None:
    dockerfile = f'FROM {IMAGE}\nLABEL io.ptc-sandbox.runtime=""\n'.encode()
    engine.images.build(
        fileobj=io.BytesIO(dockerfile), tag="ptc-sandbox-runtime:pytest-old", network_mode="none", rm=True, forcerm=True
    )
    svc = start_service("pytest-old-image", scratch / "old-image", PTC_SANDBOX_IMAGE="ptc-sandbox-runtime:pytest-old")
    try:
        with svc.client() as api:
            view = execute(api, "print('cold')")
        assert (view["stdout"], view["sandbox_start"]) == ("cold\n", "cold")
        assert "warm pool off" in svc.log()
        assert labelled_containers(engine, "pytest-old-image", include_pool=True) == []
    finally:
        svc.stop()
        engine.images.remove("ptc-sandbox-runtime:pytest-old")


def test_stopping_while_the_pool_refills_leaves_no_sandbox(engine: docker.DockerClient, scratch: Path) -> None:
    for attempt in range(3):  # stop at different points of the refill
        instance = f"pytest-pool-stop-{attempt}"
        svc = start_service(instance, scratch / f"pool-stop-{attempt}", PTC_WARM_POOL_SIZE="4")
        time.sleep(0.1 + 0.15 * attempt)
        svc.stop()
        time.sleep(1)
        assert labelled_containers(engine, instance, include_pool=True) == []
