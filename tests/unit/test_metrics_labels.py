"""Metrics per replica keep their labels bounded (docs/scaling.md, Operability; issue 17, point 5): after jobs,
unknown ids, a replica's expiry and a listener's reconnection, no series of ``GET /metrics`` has a label holding
an instance id, a job id or an address, and every label name is one of a fixed few."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.api import create_app
from service.sandbox.fake import FakeBackend
from service.settings import Settings

BOUNDED_LABELS = frozenset(
    {"status", "mode", "tool", "stream", "outcome", "state", "method", "route", "profile", "reason", "kind", "le"}
)
"""Every label name a series may have: each with a fixed or capped set of values (``le``: histogram buckets)."""

REPLICA_SERIES = (
    "ptc_replicas",
    "ptc_lease_renewals_total",
    "ptc_lease_remaining_seconds",
    "ptc_replica_expiries_total",
    "ptc_lease_expired_jobs_total",
    "ptc_lease_expired_sessions_total",
    "ptc_store_listener_reconnects_total",
)


@pytest.fixture
def short() -> Iterator[Path]:
    """A scratch folder with a short path (the sandboxes' unix sockets live under the work dirs)."""
    path = Path(tempfile.mkdtemp(prefix="ptco", dir="/tmp"))
    (path / "w1").mkdir()
    (path / "w2").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_no_label_holds_an_instance_id_a_job_id_or_an_address(short: Path) -> None:
    instance = "replica-under-test-7"
    settings = Settings(
        auth="disabled",
        work_dir=short / "w",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=0,
        instance_id=instance,
        internal_url="http://192.0.2.7:8081",
    )
    app = create_app(settings, FakeBackend())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            ids = []
            for n in range(3):
                view = (await client.post("/execute", json={"script": f"print({n})", "wait_s": 10})).json()
                ids.append(view["job_id"])
                assert (await client.get(f"/jobs/{view['job_id']}")).status_code == 200
            assert (await client.get("/jobs/job_notthere0000000000000000")).status_code == 404
            assert (await client.get("/no/such/route/192.0.2.9")).status_code == 404
            await app.state.replicas.renew()
            metrics = app.state.metrics
            metrics.replica_expired(jobs_lost=3, sessions_broken=1)
            metrics.listener_reconnected()
            text = (await client.get("/metrics")).text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    names = {sample.name for sample in samples}
    assert set(REPLICA_SERIES) <= names, set(REPLICA_SERIES) - names
    routes = {*app.openapi()["paths"], "/mcp", "/openapi.json", "/docs", "/redoc", "unmatched"}
    forbidden = [instance, "192.0.2.", "127.0.0.1", "http://", "fake", "notthere", *ids]
    for sample in samples:
        assert set(sample.labels) <= BOUNDED_LABELS, sample
        for name, value in sample.labels.items():
            assert not any(bad in value for bad in forbidden), sample
            if name == "route":
                assert value in routes, sample
    by_name = {sample.name: sample.value for sample in samples if not sample.labels}
    assert by_name["ptc_replica_expiries_total"] == 1
    assert by_name["ptc_lease_expired_jobs_total"] == 3
    assert by_name["ptc_lease_expired_sessions_total"] == 1
    assert by_name["ptc_store_listener_reconnects_total"] == 1
