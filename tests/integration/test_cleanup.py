"""No sandbox outlives its job: start-up sweep after a crash (kill -9), and every container labelled."""

from __future__ import annotations

import contextlib
import secrets
import signal
import threading
import time
from pathlib import Path

import docker
import httpx
import pytest

from service.sandbox.labels import LABEL_INSTANCE, instance_labels
from tests.conftest import IMAGE, labelled_containers, start_service, wait_until


def test_sweep_at_start_removes_what_a_killed_instance_left(engine: docker.DockerClient, scratch: Path) -> None:
    instance = f"pytest-crash-{secrets.token_hex(4)}"
    first = start_service(instance, scratch / "crash", PTC_WARM_POOL_SIZE="0")
    errors: list[BaseException] = []

    def long_job() -> None:
        try:
            with first.client() as api:
                body = {"script": "import time\ntime.sleep(60)", "timeout_s": 60, "durable": False}  # not resumed
                api.post("/execute", json=body)
        except httpx.HTTPError as exc:  # the service dies under it
            errors.append(exc)

    worker = threading.Thread(target=long_job)
    worker.start()
    wait_until(lambda: labelled_containers(engine, instance), 20)
    [left] = labelled_containers(engine, instance)
    assert left.labels["io.ptc-sandbox.job"].startswith("job_")
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    worker.join(10)
    assert errors, "the request should have failed with the service"
    assert labelled_containers(engine, instance), "kill -9 leaves the sandbox behind"

    second = start_service(instance, scratch / "crash", PTC_WARM_POOL_SIZE="0")
    try:
        assert labelled_containers(engine, instance) == []
        assert "left behind by an earlier run" in second.log()
    finally:
        second.stop()


def test_sweep_leaves_other_instances_alone(engine: docker.DockerClient, scratch: Path) -> None:
    other = engine.containers.create(IMAGE, labels={LABEL_INSTANCE: "someone-else"}, network_mode="none")
    try:
        svc = start_service(f"pytest-{secrets.token_hex(4)}", scratch / "other")
        svc.stop()
        other.reload()
        assert other.status == "created"
    finally:
        other.remove(force=True)


def test_graceful_stop_removes_running_sandboxes(engine: docker.DockerClient, scratch: Path) -> None:
    instance = f"pytest-stop-{secrets.token_hex(4)}"
    svc = start_service(instance, scratch / "stop", PTC_WARM_POOL_SIZE="0")
    worker = threading.Thread(
        target=lambda: httpx.post(
            f"{svc.url}/execute", json={"script": "import time\ntime.sleep(60)"}, headers=svc.headers, timeout=90
        )
    )
    worker.start()
    wait_until(lambda: labelled_containers(engine, instance), 20)
    assert labelled_containers(engine, instance)
    svc.stop()
    worker.join(30)
    assert labelled_containers(engine, instance) == []


def test_default_instance_ids_differ_by_work_dir(engine: docker.DockerClient, scratch: Path) -> None:
    """Two instances left at their default instance id never sweep each other's sandboxes."""
    first = start_service("", scratch / "default-a", PTC_INSTANCE_ID="")
    try:
        worker = threading.Thread(
            target=lambda: httpx.post(
                f"{first.url}/execute",
                json={"script": "import time\ntime.sleep(4)\nprint('ok')"},
                headers=first.headers,
                timeout=30,
            )
        )
        worker.start()
        time.sleep(1.5)
        second = start_service("", scratch / "default-b", PTC_INSTANCE_ID="")
        second.stop()
        worker.join(30)
        with first.client() as api:
            [job] = api.get("/jobs").json()["jobs"]
            assert (job["status"], job["exit_code"]) == ("succeeded", 0)
    finally:
        first.stop()


def test_graceful_stop_sweeps_a_sandbox_nothing_tracks(engine: docker.DockerClient, scratch: Path) -> None:
    """A container with the instance's label that no job, session or pool holds (a removal cut short) is removed at
    shutdown, after everything has removed its own, and the log says so."""
    instance = f"pytest-stray-{secrets.token_hex(4)}"
    svc = start_service(instance, scratch / "stray", PTC_WARM_POOL_SIZE="0")
    stray = engine.containers.create(IMAGE, labels=instance_labels(instance), network_mode="none")
    try:
        svc.stop()
        assert labelled_containers(engine, instance, include_pool=True) == []
        assert "removed 1 sandbox(es) still there at shutdown" in svc.log()
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            stray.remove(force=True)


def test_a_second_instance_cannot_share_a_work_dir(scratch: Path) -> None:
    first = start_service(f"pytest-{secrets.token_hex(4)}", scratch / "shared")
    try:
        with pytest.raises(RuntimeError, match="another ptc-sandbox instance is using"):
            start_service(f"pytest-{secrets.token_hex(4)}", scratch / "shared")
        assert first.process.poll() is None
    finally:
        first.stop()
