"""``ptc-sandbox sweep --instance ID`` on the real engine (docs/operations.md, Replicas): a retired replica's
labelled containers are removed; a live one's are refused and stay, and so does every other instance's."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from service.sandbox.labels import instance_labels
from service.settings import Settings
from service.store import Incarnation, Registration
from service.store.sqlite import SQLiteJobStore
from tests.conftest import IMAGE, ROOT, container_gone


def labelled(engine: docker.DockerClient, instance: str) -> str:
    """A running container carrying the sandbox labels of ``instance`` (as a replica's sandbox would)."""
    container = engine.containers.run(
        IMAGE,
        ["-c", "import time; time.sleep(300)"],
        entrypoint="python3",
        network_mode="none",
        detach=True,
        labels=instance_labels(instance),
    )
    return str(container.id)


async def registry(work_dir: Path, live: str, gone: str) -> None:
    store = SQLiteJobStore(Settings(work_dir=work_dir).job_store_path())
    await store.open()
    try:
        epoch = await store.replicas.register(Registration(gone, "http://127.0.0.1:2", "b" * 64, "0.test", 300.0))
        assert await store.replicas.set_state(Incarnation(gone, epoch), "left")  # retired
        await store.replicas.register(
            Registration(live, "http://127.0.0.1:1", "a" * 64, "0.test", 300.0)
        )  # then this one
    finally:
        await store.close()


def sweep(work_dir: Path, instance: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTC_")}  # DOCKER_HOST kept; the SQLite store
    env.update(PTC_WORK_DIR=str(work_dir), PTC_LOG_LEVEL="warning")
    return subprocess.run(
        [sys.executable, "-m", "service", "sweep", "--instance", instance],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_sweep_removes_a_left_instance_and_refuses_a_live_one(engine: docker.DockerClient, tmp_path: Path) -> None:
    suffix = secrets.token_hex(4)
    live, gone, other = f"sweep-live-{suffix}", f"sweep-gone-{suffix}", f"sweep-other-{suffix}"
    work_dir = tmp_path / "w"
    work_dir.mkdir()
    asyncio.run(registry(work_dir, live, gone))
    ids = {name: labelled(engine, name) for name in (live, gone, other)}
    try:
        refused = sweep(work_dir, live)
        assert refused.returncode == 1 and "live in the registry" in refused.stderr, refused
        unknown = sweep(work_dir, other)
        assert unknown.returncode == 1 and "--unregistered" in unknown.stderr, unknown
        assert not any(container_gone(engine, cid) for cid in ids.values())
        done = sweep(work_dir, gone)
        assert done.returncode == 0, done
        assert f"removed 1 sandbox(es) of instance {gone}" in done.stdout
        assert container_gone(engine, ids[gone])
        assert engine.containers.get(ids[live]).status == "running"
        assert engine.containers.get(ids[other]).status == "running"
    finally:
        for cid in ids.values():
            try:
                engine.containers.get(cid).remove(force=True)
            except docker.errors.NotFound:
                pass


@pytest.mark.parametrize("argv", [["sweep"], ["sweep", "--instance"]])
def test_sweep_needs_an_instance(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "service", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--instance" in done.stderr
