"""deploy/: the Grafana dashboard asks only for metrics the service exports, and a real Prometheus
(Debian's ``prometheus``, installed by ``deploy/local.sh``) scrapes the service with the scrape config from deploy/.

Without a ``prometheus`` binary the Prometheus test skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, Service, execute, free_port, wait_until
from tests.unit.test_monitoring import IDENTIFIER, KEYWORDS, LABEL_LISTS, promql_metric_names  # noqa: F401

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "ptc-sandbox.json"


SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


DEPLOY_TARGET = '"127.0.0.1:8080"'


TOOLS = [{"name": "lookup", "parameters": {"properties": {"q": {"type": "string"}}}, "endpoint": {"kind": "echo"}}]


ONE_OK_ONE_REJECTED = """\
import tools
tools.lookup(q='a')
try:
    tools.lookup(q=1)
except tools.ToolError:
    pass
"""


AUTH_BLOCK = "    # authorization:\n    #   type: Bearer\n    #   credentials_file: /etc/prometheus/ptc-sandbox.token"


def exported_names(exposition: str) -> set[str]:
    """Every series name a scrape offers (histograms: ``_bucket``, ``_count``, ``_sum``), with or without samples."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        elif line and not line.startswith("#"):
            names.add(line.split("{")[0].split()[0])
    return names


def panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found: list[dict[str, Any]] = dashboard["panels"]
    return found


def test_every_dashboard_query_names_only_metrics_the_service_exports(api: httpx.Client) -> None:
    execute(api, ONE_OK_ONE_REJECTED, TOOLS)
    exported = exported_names(api.get("/metrics").text)
    asked: set[str] = set()
    for panel in panels():
        for target in panel["targets"]:
            names = promql_metric_names(target["expr"])
            assert names, f"{panel['title']}: {target['expr']} selects no metric"
            assert names <= exported, f"{panel['title']}: not exported: {names - exported}"
            asked |= names
    required = {  # the panels: p50/p95 execution time, executions/s, tool calls/s and errors, queue, pool
        "ptc_execution_duration_seconds_bucket",
        "ptc_executions_total",
        "ptc_tool_calls_total",
        "ptc_jobs",
        "ptc_sandbox_pool_size",
    }
    assert required <= asked


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        message = "no prometheus binary (deploy/local.sh setup installs Debian's prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture
def prometheus(prometheus_binary: str, service: Service, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus scraping ``service`` every second with deploy/'s config (target rewritten); its URL."""
    config = SCRAPE_CONFIG.read_text()
    for text in (DEPLOY_TARGET, "scrape_interval: 15s", "scrape_timeout: 5s"):
        assert text in config, f"{SCRAPE_CONFIG} no longer has {text}: update this test"
    target = service.url.removeprefix("http://")
    token_file = tmp_path / "token"
    token_file.write_text(service.token)
    assert AUTH_BLOCK in config, f"{SCRAPE_CONFIG} no longer has {AUTH_BLOCK!r}: update this test"
    config = (
        config.replace(
            AUTH_BLOCK, AUTH_BLOCK.replace("# ", "").replace("/etc/prometheus/ptc-sandbox.token", str(token_file))
        )
        .replace(DEPLOY_TARGET, f'"{target}"')
        .replace("scrape_interval: 15s", "scrape_interval: 1s")
        .replace("scrape_timeout: 5s", "scrape_timeout: 1s")
    )
    (tmp_path / "prometheus.yml").write_text(config)
    checked = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    process = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{url}/-/ready"), 30)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector (asserts Prometheus accepted the query)."""
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_prometheus_scrapes_the_service_and_every_dashboard_panel_has_data(prometheus: str, api: httpx.Client) -> None:
    execute(api, ONE_OK_ONE_REJECTED, TOOLS)
    wait_until(lambda: query(prometheus, 'up{job="ptc-sandbox"}'), 30)
    (up,) = query(prometheus, 'up{job="ptc-sandbox"}')
    assert up["value"][1] == "1", up
    series = query(prometheus, 'ptc_executions_total{job="ptc-sandbox",status="succeeded"}')
    assert series and float(series[0]["value"][1]) >= 1
    names = httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"]
    assert {"ptc_executions_total", "ptc_tool_calls_total", "ptc_jobs", "ptc_sandbox_pool_size"} <= set(names)

    def empty_panels() -> list[str]:
        """Titles of panels none of whose queries has data yet (rates need two scrapes)."""
        return [
            panel["title"]
            for panel in panels()
            if not any(query(prometheus, t["expr"].replace("$__rate_interval", "1m")) for t in panel["targets"])
        ]

    deadline = time.monotonic() + 30
    while (empty := empty_panels()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not empty, f"dashboard panels without data: {empty}"
