"""The warm pool: default-profile jobs start in a sandbox started ahead of time, used once, refilled."""

from __future__ import annotations

import io
import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx

from service.tenancy import hash_token
from tests.conftest import (
    IMAGE,
    Service,
    container_gone,
    execute,
    labelled_containers,
    pool_ready,
    start_service,
    wait_until,
)


def pooled(engine: docker.DockerClient, instance: str, memory_mb: int | None = None) -> list[Any]:
    """Pooled sandboxes (waiting for a job) of the default profile, or of any profile with ``memory_mb``."""
    found = [c for c in labelled_containers(engine, instance, include_pool=True) if "io.ptc-sandbox.pool" in c.labels]
    if memory_mb is None:
        return [c for c in found if c.labels["io.ptc-sandbox.pool"] == "default"]
    return [c for c in found if c.attrs["HostConfig"]["Memory"] == memory_mb * 1024 * 1024]


def test_jobs_run_warm_from_their_profiles_pool(
    api: httpx.Client, engine: docker.DockerClient, service: Service
) -> None:
    wait_until(lambda: len(pooled(engine, service.instance_id)) == 4, 30)
    wait_until(lambda: pool_ready(api, "default") >= 2, 30)  # listed is not ready: a job then starts cold
    first = execute(api, "import tools\nprint(tools.t()['tool'])", [{"name": "t", "endpoint": {"kind": "echo"}}])
    second = execute(api, "import os\nprint(os.environ['X'])", env={"X": "y"})  # env is the run's, not the profile's
    assert (first["sandbox_start"], first["stdout"]) == ("warm", "t\n")
    assert (second["sandbox_start"], second["stdout"]) == ("warm", "y\n")
    assert first["sandbox_id"] != second["sandbox_id"]  # never handed out twice
    ids = [first["sandbox_id"], second["sandbox_id"]]
    wait_until(lambda: all(container_gone(engine, i) for i in ids), 10)  # destroyed with its job, after the answer
    wait_until(lambda: len(pooled(engine, service.instance_id)) == 4, 30)  # refilled to its size


def test_profiles_past_the_maximum_start_cold(engine: docker.DockerClient, scratch: Path) -> None:
    svc = start_service(
        "pytest-pool-profiles", scratch / "pool-profiles", PTC_WARM_POOL_SIZE="1", PTC_WARM_POOL_MAX_PROFILES="2"
    )
    try:
        with svc.client() as api:
            for memory in (100, 110):  # a new profile: cold, and (room permitting) its pool starts
                assert execute(api, "print(1)", limits={"memory_mb": memory})["sandbox_start"] == "cold"
            wait_until(lambda: len(pooled(engine, "pytest-pool-profiles", 100)) == 1, 30)
            time.sleep(1)
            assert pooled(engine, "pytest-pool-profiles", 110) == []  # default + 100 MiB: the maximum of 2
            wait_until(lambda: pool_ready(api) == 2, 30)  # both pools' sandboxes ready, not only listed
            assert execute(api, "print(1)", limits={"memory_mb": 100})["sandbox_start"] == "warm"
            assert execute(api, "print(1)", limits={"memory_mb": 110})["sandbox_start"] == "cold"
    finally:
        svc.stop()
    assert labelled_containers(engine, "pytest-pool-profiles", include_pool=True) == []


def test_timeout_counts_from_the_job_not_the_pooled_start(
    api: httpx.Client, engine: docker.DockerClient, service: Service
) -> None:
    wait_until(lambda: pool_ready(api, "default") >= 1, 30)
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
    wait_until(lambda: all(container_gone(engine, i) for i in ids), 20)


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
        wait_until(lambda: labelled_containers(engine, "pytest-old-image", include_pool=True) == [], 10)
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


def test_one_keys_throwaway_profiles_leave_another_key_a_warm_data_image(
    engine: docker.DockerClient, scratch: Path, runtime: str
) -> None:
    """One key asks for profiles nobody else wants (throwaway ``memory_mb`` values) until they hold every pool
    beyond the default one; another key's data-image jobs still get a pool of their own and start warm."""
    data_image = os.environ.get("PTC_DATA_IMAGE", "ptc-sandbox-data:latest")
    engine.images.get(data_image)  # present, or the test fails here naming it
    instance = f"pytest-pool-fair-{secrets.token_hex(4)}"
    token = secrets.token_urlsafe(32)
    keys_file = scratch / f"{instance}.keys"
    keys_file.write_text(f"other:{hash_token(token)}\n")
    svc = start_service(
        instance,
        scratch / instance,
        PTC_WARM_POOL_SIZE="1",
        PTC_WARM_POOL_MAX_PROFILES="3",  # the default + 2
        PTC_IMAGES=f"data={data_image}",
        PTC_API_KEYS_FILE=str(keys_file),
        PTC_RUNTIME=runtime,
    )
    try:
        with (
            svc.client() as greedy,
            httpx.Client(base_url=svc.url, timeout=120, headers={"Authorization": f"Bearer {token}"}) as other,
        ):
            for memory in (100, 110, 120):
                assert execute(greedy, "print(1)", limits={"memory_mb": memory})["sandbox_start"] == "cold"
            wait_until(lambda: len(pooled(engine, instance, 100)) == 1 and len(pooled(engine, instance, 110)) == 1, 60)

            def data_job_warm() -> bool:
                view = other.post("/execute", json={"script": "print(2)", "image": "data"}).json()
                assert (view["status"], view["image"], view["stdout"]) == ("succeeded", "data", "2\n"), view
                return bool(view["sandbox_start"] == "warm")

            assert not data_job_warm()  # the first is cold: its profile had no pool
            wait_until(data_job_warm, 90, interval_s=1)
            assert (
                len(pooled(engine, instance, 100)) + len(pooled(engine, instance, 110)) <= 1
            )  # one of greedy's closed
    finally:
        svc.stop()
    wait_until(lambda: labelled_containers(engine, instance, include_pool=True) == [], 30)
