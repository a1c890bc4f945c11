"""Images per request on the real engine: an unknown name is a 422 before any sandbox starts; a request choosing
the second image runs in it with that image's memory default (read inside the sandbox, and from the engine); each
image has its own warm pool, made on first use; a session keeps its image.

The second image is the data image (``PTC_DATA_IMAGE``, default ``ptc-sandbox-data:latest``, which
``deploy/local.sh setup`` builds for the tests: numpy, pandas, matplotlib).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from docker.models.containers import Container

from service.sandbox.labels import LABEL_INSTANCE, LABEL_POOL, LABEL_SESSION
from tests.conftest import IMAGE, Service, start_service, stop_clean, wait_until

DATA_MEMORY_MB = 1024  # the data image's memory default here (pandas needs more than the server's 256)
DATA_TIMEOUT_S = 90
READ_MEMORY_LIMIT = """
for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
        print(open(path).read().strip())
        break
    except OSError:
        pass
else:
    print("unreadable")
"""


@pytest.fixture(scope="module")
def data_image(engine: docker.DockerClient) -> str:
    """The image offered as ``data``: the data image the tests' set-up builds."""
    image = os.environ.get("PTC_DATA_IMAGE", "ptc-sandbox-data:latest")
    engine.images.get(image)  # present, or the test fails here naming it
    return image


@pytest.fixture(scope="module")
def images_service(engine: docker.DockerClient, scratch: Path, data_image: str) -> Iterator[Service]:
    svc = start_service(
        f"pytest-images-{secrets.token_hex(4)}",
        scratch / "svc-images",
        PTC_IMAGES=f"data={data_image},gone={IMAGE.rsplit(':', 1)[0]}:sel-never-built",
        PTC_IMAGE_DEFAULTS=f'{{"data": {{"memory_mb": {DATA_MEMORY_MB}, "timeout_s": {DATA_TIMEOUT_S}}}}}',
        PTC_WARM_POOL_SIZE="1",
        probe="/healthz",  # /readyz is 503 here: the gone image is missing (tested below)
    )
    yield svc
    stop_clean(engine, svc)


@pytest.fixture(scope="module")
def api(images_service: Service) -> Iterator[httpx.Client]:
    with images_service.client() as client:
        yield client


def sandboxes(engine: docker.DockerClient, service: Service) -> list[Container]:
    return engine.containers.list(
        all=True, filters={"label": f"{LABEL_INSTANCE}={service.instance_id}"}, ignore_removed=True
    )


def test_an_unknown_image_is_a_422_before_any_sandbox_starts(
    api: httpx.Client, engine: docker.DockerClient, images_service: Service, data_image: str
) -> None:
    before = {c.id for c in sandboxes(engine, images_service) if LABEL_POOL not in c.labels}
    for path, body in (("/execute", {"script": "print(1)", "image": "nope"}), ("/sessions", {"image": "nope"})):
        answer = api.post(path, json=body)
        assert answer.status_code == 422, answer.text
        problem = answer.json()
        assert problem["type"] == "tag:ptc-sandbox.dev,2026:problems/unknown-image"
        assert problem["allowed_images"] == ["data", "default", "gone"]
        assert data_image not in answer.text and IMAGE not in answer.text  # names only
    after = {c.id for c in sandboxes(engine, images_service) if LABEL_POOL not in c.labels}
    assert after == before


def test_the_data_image_runs_with_its_memory_default(api: httpx.Client) -> None:
    view = api.post("/execute", json={"script": READ_MEMORY_LIMIT, "image": "data"}).json()
    assert (view["status"], view["image"]) == ("succeeded", "data"), view
    assert int(view["stdout"]) == DATA_MEMORY_MB * 1024 * 1024
    own = api.post("/execute", json={"script": READ_MEMORY_LIMIT, "image": "data", "limits": {"memory_mb": 200}})
    assert int(own.json()["stdout"]) == 200 * 1024 * 1024  # the request's own value wins
    default = api.post("/execute", json={"script": READ_MEMORY_LIMIT}).json()
    assert default["image"] == "default" and int(default["stdout"]) == 256 * 1024 * 1024


def test_each_image_has_its_own_warm_pool(
    api: httpx.Client, engine: docker.DockerClient, images_service: Service, data_image: str
) -> None:
    def pooled(image: str) -> list[Container]:
        return [
            c
            for c in sandboxes(engine, images_service)
            if LABEL_POOL in c.labels and c.attrs["Config"]["Image"] == image and c.status == "running"
        ]

    wait_until(lambda: pooled(IMAGE), 60)
    first = api.post("/execute", json={"script": "print(1)", "image": "data"})  # creates its pool
    first.raise_for_status()
    used = first.json()["sandbox_id"]  # short id; a sandbox a job took from a pool keeps its pool label while removed

    # the data image's default profile (its memory default); an earlier test's own limits (memory_mb 200) may
    # have given the same image a second profile, with a pool of its own
    seen: list[Container] = []

    def default_profile() -> list[Container]:
        seen[:] = [
            c
            for c in pooled(data_image)
            if not (c.id or "").startswith(used) and c.attrs["HostConfig"]["Memory"] == DATA_MEMORY_MB * 1024 * 1024
        ]
        return seen

    wait_until(default_profile, 60)
    data_pool = seen[0]
    assert data_pool.labels[LABEL_POOL].startswith("data-")  # its profile, in metrics and logs, names the image
    assert f'ptc_sandbox_pool_size{{profile="{data_pool.labels[LABEL_POOL]}"}}' in api.get("/metrics").text

    def warm() -> bool:
        view = api.post("/execute", json={"script": "print(2)", "image": "data"}).json()
        assert (view["status"], view["image"], view["stdout"]) == ("succeeded", "data", "2\n"), view
        return bool(view["sandbox_start"] == "warm")

    wait_until(warm, 60, interval_s=0.5)


def test_a_session_keeps_its_image(
    api: httpx.Client, engine: docker.DockerClient, images_service: Service, data_image: str
) -> None:
    created = api.post("/sessions", json={"image": "data"})
    assert created.status_code == 201, created.text
    session = created.json()
    try:
        assert session["image"] == "data" and session["limits"]["memory_mb"] == DATA_MEMORY_MB
        container = next(c for c in sandboxes(engine, images_service) if LABEL_SESSION in c.labels)
        assert container.attrs["Config"]["Image"] == data_image
        assert container.attrs["HostConfig"]["Memory"] == DATA_MEMORY_MB * 1024 * 1024
        for extra in ({}, {"image": "data"}):
            view = api.post(
                "/execute", json={"script": READ_MEMORY_LIMIT, "session_id": session["session_id"], **extra}
            ).json()
            assert (view["status"], view["image"], view["sandbox_start"]) == ("succeeded", "data", "session"), view
            assert int(view["stdout"]) == DATA_MEMORY_MB * 1024 * 1024
            assert view["sandbox_id"] == session["sandbox_id"]
        other = api.post("/execute", json={"script": "1", "session_id": session["session_id"], "image": "default"})
        assert other.status_code == 422 and other.json()["errors"][0]["loc"] == ["body", "image"], other.text
        assert api.get(f"/sessions/{session['session_id']}").json()["image"] == "data"
    finally:
        api.delete(f"/sessions/{session['session_id']}")


def test_a_missing_image_is_named_by_readyz_and_refused_with_503(api: httpx.Client, images_service: Service) -> None:
    ready = httpx.get(f"{images_service.url}/readyz", timeout=30)
    assert ready.status_code == 503 and ready.json()["missing_images"] == ["gone"], ready.text
    assert "sel-never-built" not in ready.text
    answer = api.post("/execute", json={"script": "print(1)", "image": "gone"})
    assert answer.status_code == 503 and "'gone'" in answer.json()["detail"], answer.text
