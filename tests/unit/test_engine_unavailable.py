"""Without a reachable engine the service still starts, says it is not ready, and answers 503."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import start_service


def test_no_engine_means_503_not_a_crash(scratch: Path) -> None:
    svc = start_service(
        "pytest-noengine", scratch / "noengine", probe="/healthz", PTC_DOCKER_HOST=f"unix://{scratch}/no-engine.sock"
    )
    try:
        with svc.client() as api:
            ready = api.get("/readyz")
            assert ready.status_code == 503
            assert ready.headers["content-type"] == "application/problem+json"
            assert "not reachable" in ready.json()["detail"]
            response = api.post("/execute", json={"script": "print(1)"})
            assert response.status_code == 503
            assert response.json()["job_id"].startswith("job_")
            assert api.get("/healthz").status_code == 200
    finally:
        svc.stop()
