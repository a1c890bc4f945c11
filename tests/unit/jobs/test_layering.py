"""The job package's layering, read from its source: the model imports nothing of the service; the run path
(runner, placement, admission) imports neither metrics nor logs (they subscribe to lifecycle events)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from service.jobs.events import Events, JobLost

PACKAGE = Path(__file__).resolve().parents[3] / "service" / "jobs"


def imported(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_model_imports_nothing_of_the_service() -> None:
    assert not {name for name in imported("model") if name.startswith("service")}


@pytest.mark.parametrize("module", ["runner", "placement", "admission"])
def test_the_run_path_imports_neither_metrics_nor_logs(module: str) -> None:
    assert not {
        name
        for name in imported(module)
        if name.startswith(("service.observability.metrics", "service.observability.logs"))
    }


def test_every_module_of_the_package_is_small() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert max(sizes.values()) <= 400, sizes


def test_a_failing_subscriber_never_stops_the_others(caplog: pytest.LogCaptureFixture) -> None:
    events, seen = Events(), []

    def broken(event: JobLost) -> None:
        raise RuntimeError("subscriber bug")

    events.subscribe(JobLost, broken)
    events.subscribe(JobLost, lambda event: seen.append(event.job_id))
    events.publish(JobLost("job_1", "running"))
    assert seen == ["job_1"] and "a subscriber of JobLost failed" in caplog.text
