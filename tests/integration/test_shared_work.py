"""One key's costly requests do not stall the service or delay another key (issue 11 review, faults 2 and 3).

- Bodies: a 7 MiB ``metadata`` of empty arrays is refused (422, over 64 KiB), but parsing and validating it
  took seconds on the event loop: ``/healthz`` took 2.45 s for one, 91 s at worst under 16 of them.
- Manifests: compiles shared the default executor (6 threads here) with every job's file work, so eight
  large manifests of one key delayed another key's ``print(1)`` from 0.9 s to 39 s.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.body_attack import attack_body
from service.tenancy import hash_token
from tests.conftest import Service, start_service
from tests.probe import healthz_while

pytestmark = pytest.mark.integration

MALLORY_TOKEN = secrets.token_urlsafe(32)
MANIFEST_BUDGET_S = 2.0


@pytest.fixture(scope="module")
def shared(scratch: Path) -> Iterator[Service]:
    """A service with a second key, ``mallory``, and a compile budget of ``MANIFEST_BUDGET_S``."""
    keys = scratch / f"shared-keys-{secrets.token_hex(4)}"
    keys.write_text(f"mallory:{hash_token(MALLORY_TOKEN)}\n")
    service = start_service(
        f"pytest-shared-{secrets.token_hex(4)}",
        scratch / f"shared-{secrets.token_hex(4)}",
        PTC_API_KEYS_FILE=str(keys),
        PTC_MANIFEST_BUDGET_S=str(MANIFEST_BUDGET_S),
    )
    yield service
    service.stop()


def _mallory(service: Service) -> httpx.Client:
    return httpx.Client(base_url=service.url, timeout=300, headers={"Authorization": f"Bearer {MALLORY_TOKEN}"})


def test_healthz_answers_while_large_bodies_are_refused(shared: Service) -> None:
    body = attack_body()
    headers = {"content-type": "application/json"}

    def attack() -> list[int]:
        with _mallory(shared) as mallory, ThreadPoolExecutor(6) as pool:
            return list(
                pool.map(lambda _: mallory.post("/execute", content=body, headers=headers).status_code, range(6))
            )

    codes, samples = healthz_while(shared.url, attack, timeout_s=300)
    assert codes == [422] * 6
    # Generous (a shared 2-core host): before, each body held the loop for seconds, one after the other.
    assert samples and max(samples) < 5.0, samples


def _expensive_manifest(n: int) -> list[dict[str, Any]]:
    """1,000 tools of 25 parameters, all different (so none is checked once for all): ~30 s of CPU, unbudgeted."""
    return [
        {
            "name": f"t{i}",
            "parameters": {
                "type": "object",
                "properties": {
                    f"p{j}": {
                        "anyOf": [{"type": "string", "pattern": f"^{n}-{i}-{j}(a|b)*c$"}, {"enum": list(range(20))}]
                    }
                    for j in range(25)
                },
            },
            "endpoint": {"kind": "echo"},
        }
        for i in range(1000)
    ]


def test_another_keys_execute_is_not_delayed_by_expensive_manifests(shared: Service) -> None:
    manifests = [_expensive_manifest(n) for n in range(8)]
    with _mallory(shared) as mallory, shared.client(timeout=120) as api, ThreadPoolExecutor(8) as pool:
        compiles = [pool.submit(mallory.post, "/stubs", json={"tools": tools}) for tools in manifests]
        time.sleep(2)  # the manifests are being compiled
        started = time.perf_counter()
        answer = api.post("/execute", json={"script": "print(1)", "wait_s": 60})
        took = time.perf_counter() - started
        answers = [c.result() for c in compiles]
    assert answer.status_code == 200 and answer.json()["stdout"] == "1\n", answer.text
    # Generous: print(1) takes 1 to 3 s here; before, it was still running after wait_s (60 s): 202, not 200.
    assert took < 20.0, took
    refused = [a for a in answers if a.status_code == 422]
    assert all("CPU time" in a.json()["detail"] for a in refused)
    assert {a.status_code for a in answers} <= {200, 422}
