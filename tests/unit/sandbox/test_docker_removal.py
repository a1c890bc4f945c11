"""A forced removal that meets its container as it exits fails once and leaves it ``dead`` (the engine's log:
``Could not kill running container ..., cannot remove - Container ... is not running``); a later removal succeeds.
The backend tries again, so the container does not stay behind (CI found one after the service had stopped)."""

from __future__ import annotations

import docker.errors
import pytest
import requests

from service.sandbox import docker as docker_module
from service.sandbox.docker import DockerBackend

DEAD = "Could not kill running container c1, cannot remove - Container c1 is not running"


def api_error(status: int, explanation: str) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError("removal failed", response=response, explanation=explanation)


class Engine:
    """The engine's ``remove_container``: raises each of ``failures`` in turn, then removes."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    def remove_container(self, container_id: str, force: bool) -> None:
        assert force
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)


def backend_on(engine: Engine) -> DockerBackend:
    backend = DockerBackend.__new__(DockerBackend)  # no engine connection: only the removal is under test
    backend._api = engine  # type: ignore[assignment]
    backend._readers = {}
    return backend


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker_module, "REMOVE_RETRY_S", 0.001)


@pytest.mark.parametrize("status", [409, 500])
def test_a_removal_that_fails_as_the_container_exits_is_tried_again(status: int) -> None:
    engine = Engine(api_error(status, DEAD), api_error(status, DEAD))
    backend_on(engine)._remove_blocking("c1")
    assert engine.calls == 3


def test_a_removal_already_under_way_or_a_container_gone_is_not_tried_again() -> None:
    for failure in (api_error(409, "removal of container c1 is already in progress"), docker.errors.NotFound("gone")):
        engine = Engine(failure)
        backend_on(engine)._remove_blocking("c1")
        assert engine.calls == 1


def test_a_removal_that_keeps_failing_raises_after_the_last_attempt() -> None:
    engine = Engine(*[api_error(500, DEAD)] * 10)
    with pytest.raises(docker.errors.APIError):
        backend_on(engine)._remove_blocking("c1")
    assert engine.calls == docker_module.REMOVE_ATTEMPTS


def test_a_request_the_engine_refuses_is_not_tried_again() -> None:
    engine = Engine(api_error(400, "bad parameter"))
    with pytest.raises(docker.errors.APIError):
        backend_on(engine)._remove_blocking("c1")
    assert engine.calls == 1
