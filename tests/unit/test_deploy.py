"""Deployment: gVisor set-up in deploy/local.sh, the Compose file, the Kubernetes manifests, the service image.

- ``deploy/local.sh engine`` is run against a fake ``docker``/``dockerd`` pair (a PATH of stand-ins and a
  temporary daemon.json), so its fresh-machine and reload paths are exercised without touching the engine.
- The Compose file is checked with ``docker compose config`` (or Debian's ``docker-compose``), and its
  service part is built (offline: wheels from deploy/build-service-image.sh) and started for real.
- The Kubernetes manifests are checked against the Kubernetes JSON schemas bundled by
  ``kubernetes-validate`` (strict: unknown fields fail), and against each other (selectors, ports, names).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.egress import EgressDenied, EgressPolicy
from service.replicas.internal import parse_secrets
from service.settings import Settings
from tests.conftest import ROOT, free_port, in_ci, wait_until

KUBERNETES = ROOT / "deploy" / "kubernetes"


KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")  # the oldest and newest minor versions the manifests are checked for


RUNSC_ARGS = ["--network=none", "--host-uds=open", "--oci-seccomp"]


SETTINGS_OF_AUTH = {"PTC_AUTH", "PTC_API_KEYS", "PTC_API_KEYS_FILE", "PTC_METRICS_AUTH", "PTC_EGRESS_ALLOW"}


def need_root_and_runsc() -> None:
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        problem = "deploy/local.sh's engine steps need root and runsc (deploy/local.sh setup installs it)"
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)


FAKE_DOCKER = """#!/bin/sh
# Stand-in for `docker info`: answers while the fake dockerd runs, with the runtimes it last loaded.
[ "$1" = info ] || { echo "fake docker: only info" >&2; exit 1; }
[ -f "$FAKE_STATE/running" ] || exit 1
if [ "$2" = --format ]; then cat "$FAKE_STATE/runtimes"; fi
"""


FAKE_DOCKERD = """
import json, os, signal, sys, time
state, args = os.environ["FAKE_STATE"], sys.argv[1:]
config = args[args.index("--config-file") + 1] if "--config-file" in args else None

def load(*_):
    runtimes = {"runc": {"path": "runc"}}
    if config and os.path.exists(config):
        runtimes.update(json.load(open(config)).get("runtimes", {}))
    with open(state + "/runtimes", "w") as f:
        json.dump(runtimes, f)
    with open(state + "/loads", "a") as f:
        f.write("load\\n")

load()
signal.signal(signal.SIGHUP, load)
with open(os.environ["PTC_DOCKERD_PIDFILE"], "w") as f:
    f.write(str(os.getpid()))
with open(state + "/args", "w") as f:
    json.dump(args, f)
open(state + "/running", "w").close()
end = time.time() + 60
while time.time() < end:
    time.sleep(0.1)
"""


class FakeEngine:
    """A folder of stand-ins for ``docker`` and ``dockerd`` and the environment that makes local.sh use them."""

    def __init__(self, folder: Path) -> None:
        self.state = folder / "state"
        self.bin = folder / "bin"
        self.daemon_json = folder / "etc" / "daemon.json"
        for path in (self.state, self.bin, self.daemon_json.parent):
            path.mkdir(parents=True)
        (self.bin / "docker").write_text(FAKE_DOCKER)
        (self.bin / "dockerd").write_text(f"#!{sys.executable}\n{FAKE_DOCKERD}")
        for name in ("docker", "dockerd"):
            (self.bin / name).chmod(0o755)
        self.env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "FAKE_STATE": str(self.state),
            "PTC_DOCKER_DAEMON_JSON": str(self.daemon_json),
            "PTC_DOCKERD_PIDFILE": str(self.state / "dockerd.pid"),
            "PTC_DOCKERD_LOG": str(folder / "dockerd.log"),
        }
        self.dockerd: subprocess.Popen[bytes] | None = None

    def start_dockerd(self) -> None:
        """Start the fake dockerd the way an operator did before local.sh ran (with the current daemon.json)."""
        self.dockerd = subprocess.Popen(
            ["dockerd", "--config-file", str(self.daemon_json)], env=self.env, start_new_session=True
        )
        wait_until(lambda: (self.state / "running").exists(), 10)

    def local_sh(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(ROOT / "deploy" / "local.sh"), *args], env=self.env, capture_output=True, text=True, timeout=60
        )

    def loads(self) -> int:
        path = self.state / "loads"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def runtimes(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads((self.state / "runtimes").read_text())
        return loaded

    def stop(self) -> None:
        """Stop the fake dockerd (whoever started it) and, when this test started it, reap it."""
        pidfile = self.state / "dockerd.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self.dockerd is not None:
            self.dockerd.terminate()
            self.dockerd.wait(10)


@pytest.fixture
def fake_engine(tmp_path: Path) -> Iterator[FakeEngine]:
    need_root_and_runsc()
    fake = FakeEngine(tmp_path)
    yield fake
    fake.stop()


def runsc_entry() -> dict[str, Any]:
    return {"path": shutil.which("runsc"), "runtimeArgs": RUNSC_ARGS}


def test_fresh_machine_gets_runsc_registered_before_dockerd_starts(fake_engine: FakeEngine) -> None:
    result = fake_engine.local_sh("engine")
    assert result.returncode == 0, result.stderr
    args = json.loads((fake_engine.state / "args").read_text())
    assert args[:3] == ["--bridge=none", "--iptables=false", "--ip-forward=false"]
    assert args[args.index("--config-file") + 1] == str(fake_engine.daemon_json)
    assert json.loads(fake_engine.daemon_json.read_text()) == {"runtimes": {"runsc": runsc_entry()}}
    assert fake_engine.runtimes()["runsc"] == runsc_entry()
    assert fake_engine.loads() == 1  # read at start: no reload needed


def test_running_engine_without_runsc_is_reloaded_not_restarted(fake_engine: FakeEngine) -> None:
    fake_engine.daemon_json.write_text(json.dumps({"log-level": "warn", "runtimes": {"other": {"path": "/x"}}}))
    fake_engine.start_dockerd()
    pid = (fake_engine.state / "dockerd.pid").read_text()
    result = fake_engine.local_sh("engine")
    assert result.returncode == 0, result.stderr
    assert "SIGHUP" in result.stderr
    assert json.loads(fake_engine.daemon_json.read_text()) == {
        "log-level": "warn",
        "runtimes": {"other": {"path": "/x"}, "runsc": runsc_entry()},
    }
    assert fake_engine.loads() == 2  # its start, then one reload
    assert (fake_engine.state / "dockerd.pid").read_text() == pid  # the same process: never restarted
    assert "runsc" in fake_engine.runtimes()


def test_engine_that_has_runsc_is_left_alone(fake_engine: FakeEngine) -> None:
    runsc = {"path": "/opt/runsc", "runtimeArgs": ["--oci-seccomp"]}
    fake_engine.daemon_json.write_text(json.dumps({"runtimes": {"runsc": runsc}}))
    before = fake_engine.daemon_json.read_text()
    fake_engine.start_dockerd()
    result = fake_engine.local_sh("engine")
    assert result.returncode == 0, result.stderr
    assert fake_engine.daemon_json.read_text() == before  # not even rewritten with this machine's flags
    assert fake_engine.loads() == 1


def test_engine_with_runsc_but_not_its_seccomp_flag_is_registered_again(fake_engine: FakeEngine) -> None:
    fake_engine.daemon_json.write_text(json.dumps({"runtimes": {"runsc": {"path": "/opt/runsc"}}}))
    fake_engine.start_dockerd()
    result = fake_engine.local_sh("engine")
    assert result.returncode == 0, result.stderr
    assert json.loads(fake_engine.daemon_json.read_text()) == {"runtimes": {"runsc": runsc_entry()}}
    assert fake_engine.runtimes()["runsc"] == runsc_entry()
    assert fake_engine.loads() == 2  # reloaded, not restarted


def test_register_runsc_merges_once_and_refuses_a_broken_file(tmp_path: Path) -> None:
    need_root_and_runsc()
    config = tmp_path / "daemon.json"
    config.write_text('{"data-root": "/srv/docker"}')
    script = str(ROOT / "deploy" / "local.sh")
    first = subprocess.run([script, "register-runsc", str(config)], capture_output=True, text=True, timeout=60)
    second = subprocess.run([script, "register-runsc", str(config)], capture_output=True, text=True, timeout=60)
    assert (first.stdout, second.stdout) == ("changed\n", "unchanged\n")
    assert json.loads(config.read_text()) == {"data-root": "/srv/docker", "runtimes": {"runsc": runsc_entry()}}
    config.write_text("[1, 2]")
    broken = subprocess.run([script, "register-runsc", str(config)], capture_output=True, text=True, timeout=60)
    assert broken.returncode == 2 and "not a JSON object" in broken.stderr
    assert config.read_text() == "[1, 2]"


def compose_command() -> list[str]:
    """``docker compose`` when the plugin works, else Debian's ``docker-compose``; skips (fails in CI) without."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if in_ci():
        pytest.fail("neither `docker compose` nor docker-compose (deploy/local.sh setup installs it)")
    pytest.skip("neither `docker compose` nor docker-compose")


def compose_config(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), *args, "config"],
        cwd=ROOT,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


def bind_mounts(service: dict[str, Any]) -> list[str]:
    """A service's volumes as ``source:target`` (Compose v1 prints ``src:dst:rw``, v2 a mapping)."""
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            found.append(":".join(volume.split(":")[:2]))
        else:
            found.append(f"{volume['source']}:{volume['target']}")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the caller's ``PTC_*`` settings (so the file's defaults show), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PTC_")}, **extra}


def test_compose_file_is_valid_and_creates_no_network() -> None:
    config = compose_config("--profile", "monitoring")
    services = config["services"]
    # Compose v1 lists every profile's services whichever are active; v2 only the active ones.
    assert set(services) - REPLICAS_PROFILE == {"sandbox-image", "work-dir", "ptc-sandbox", "prometheus", "grafana"}
    assert not config.get("networks")  # no bridge network: hosts like these have none to give
    for name, service in services.items():
        assert service.get("network_mode") in ("host", "none"), name
    assert {n for n, s in services.items() if "monitoring" in s.get("profiles", [])} == {"prometheus", "grafana"}
    svc = services["ptc-sandbox"]
    assert svc["depends_on"] == {
        "sandbox-image": {"condition": "service_completed_successfully"},
        "work-dir": {"condition": "service_completed_successfully"},
    }
    volumes = bind_mounts(svc)
    assert "/var/run/docker.sock:/var/run/docker.sock" in volumes
    assert "/var/lib/ptc-sandbox:/var/lib/ptc-sandbox" in volumes  # the same path inside as on the host
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    assert services["sandbox-image"]["image"] == "ptc-sandbox-runtime:latest"
    environment = svc["environment"]
    assert environment["PTC_HOST"] == "127.0.0.1" and environment["PTC_SANDBOX_IMAGE"] == "ptc-sandbox-runtime:latest"
    known = known_settings()
    assert set(environment) <= known, set(environment) - known
    mounted = " ".join(m for s in ("prometheus", "grafana") for m in bind_mounts(services[s]))
    for path in ("deploy/prometheus/prometheus.yml", "deploy/grafana/provisioning", "deploy/grafana/dashboards"):
        assert str(ROOT / path) in mounted, path


def test_grafana_has_no_default_password(tmp_path: Path) -> None:
    """The monitoring profile's Grafana: the admin password is ``GRAFANA_ADMIN_PASSWORD`` or, unset, one generated
    at the first start and kept (mode 0600) for the next; never ``admin``. Runs the service's entrypoint script
    with a stand-in for Grafana's ``/run.sh`` that prints the password it was given."""
    grafana = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    assert not any("GF_SECURITY_ADMIN_PASSWORD" in entry for entry in grafana["environment"])
    shell, flag, script = grafana["entrypoint"]
    script = script.replace("$$", "$")  # Compose's escape of a literal $
    run = tmp_path / "run.sh"
    run.write_text('#!/bin/sh\necho "$GF_SECURITY_ADMIN_PASSWORD ${GRAFANA_ADMIN_PASSWORD-unset}"\n')
    run.chmod(0o755)
    base = {"PATH": os.environ["PATH"], "GF_PATHS_DATA": str(tmp_path), "GRAFANA_RUN": str(run)}

    def start(**env: str) -> str:
        result = subprocess.run([shell, flag, script], env={**base, **env}, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    generated, unset = start().split()
    assert unset == "unset" and generated != "admin" and len(generated) >= 24
    assert (tmp_path / "admin-password").stat().st_mode & 0o777 == 0o600
    assert start().split()[0] == generated  # kept across restarts (Grafana applies it at its first start only)
    assert start(GRAFANA_ADMIN_PASSWORD="chosen-by-the-operator").split() == ["chosen-by-the-operator", "unset"]


def test_compose_settings_follow_the_environment() -> None:
    env = clean_env(PTC_WORK_DIR="/srv/ptc", PTC_PORT="9000", PTC_RUNTIME="runsc", PTC_SANDBOX_IMAGE="x:1")
    svc = compose_config(env=env)["services"]["ptc-sandbox"]
    assert (svc["environment"]["PTC_PORT"], svc["environment"]["PTC_RUNTIME"]) == ("9000", "runsc")
    volumes = bind_mounts(svc)
    assert "/srv/ptc:/srv/ptc" in volumes


_SECRET_KEY_SELECTOR = {
    "type": "object",
    "required": ["name", "key"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
}


_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}


SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"type": {"type": "string"}, "credentials": _SECRET_KEY_SELECTOR},
                            },
                            "bearerTokenSecret": _SECRET_KEY_SELECTOR,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def manifests(folder: Path = KUBERNETES, pattern: str = "**/*.yaml") -> list[tuple[str, dict[str, Any]]]:
    """(file relative to deploy/kubernetes, document) for every Kubernetes object under ``folder``."""
    found = []
    for path in sorted(folder.glob(pattern)):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") != "Kustomization":
                found.append((str(path.relative_to(KUBERNETES)), document))
    return found


def validate(document: dict[str, Any], version: str) -> None:
    """Raise when ``document`` does not match its schema (kubernetes-validate strict, or the ServiceMonitor's)."""
    if document["kind"] == "ServiceMonitor":
        jsonschema.validate(document, SERVICE_MONITOR_SCHEMA)
    else:
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_match_their_schemas(version: str) -> None:
    found = manifests()
    kinds = {document["kind"] for _, document in found}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "ServiceMonitor", "NetworkPolicy"} <= kinds
    for name, document in found:
        try:
            validate(document, version)
        except (jsonschema.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            raise AssertionError(f"{name}: {document['kind']}: {getattr(exc, 'message', exc)}") from exc


@pytest.mark.parametrize("kind", ["Deployment", "ServiceMonitor"])
def test_schema_check_catches_a_misspelt_field(kind: str) -> None:
    [document] = [d for _, d in manifests() if d["kind"] == kind]
    spelt_wrong = json.loads(json.dumps(document))
    if kind == "Deployment":
        spelt_wrong["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    else:
        spelt_wrong["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(spelt_wrong, KUBERNETES_VERSIONS[-1])


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    [document] = [d for f, d in manifests() if d["kind"] == kind and not f.startswith("planned/")]
    assert name is None or document["metadata"]["name"] == name
    return document


def test_kubernetes_manifests_agree_with_each_other() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    deployment, service, monitor = one("Deployment"), one("Service"), one("ServiceMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    policy = next(d for f, d in manifests() if d["kind"] == "NetworkPolicy" and not f.startswith("planned/"))
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    # What the pod refers to exists.
    secrets_ = {d["metadata"]["name"]: d for _, d in manifests(KUBERNETES, "*.yaml") if d["kind"] == "Secret"}
    config = one("ConfigMap")
    assert [s["configMapRef"]["name"] for s in container["envFrom"]] == [config["metadata"]["name"]]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] in secrets_
    credentials = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials["key"] in secrets_[credentials["name"]]["stringData"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    keys_file = Path(config["data"]["PTC_API_KEYS_FILE"])
    assert keys_file.parent == Path(mounts["api-keys"])
    assert keys_file.name in secrets_[volumes["api-keys"]["secret"]["secretName"]]["stringData"]
    # The work dir has the same path on the node and in the pod (the node's engine resolves the bind mounts).
    assert volumes["work-dir"]["hostPath"]["path"] == mounts["work-dir"] == config["data"]["PTC_WORK_DIR"]
    assert volumes["docker-sock"]["hostPath"]["path"] == mounts["docker-sock"] == "/var/run/docker.sock"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10002
    known = known_settings()
    assert set(config["data"]) <= known, set(config["data"]) - known
    assert config["data"]["PTC_RUNTIME"] == "runsc"


def test_planned_sandbox_pod_keeps_the_docker_backends_hardening() -> None:
    pod = next(d for f, d in manifests() if f == "planned/sandbox-pod.yaml")
    runtime_class = next(d for f, d in manifests() if f == "planned/runtimeclass-gvisor.yaml")
    spec = pod["spec"]
    assert spec["runtimeClassName"] == runtime_class["metadata"]["name"] and runtime_class["handler"] == "runsc"
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsUser"] == 10001
    [container] = spec["containers"]
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]
    assert {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]} == {
        "/run/ptc": True,
        "/tmp": False,
    }


# Settings the replicas' files pass that the settings model does not have yet: PTC_INTERNAL_SECRET comes with
# forwarding (docs/scaling.md, step 3).
REPLICAS_PROFILE = {"work-dir-2", "ptc-sandbox-2", "store", "balancer"}


def known_settings() -> set[str]:
    return {f"PTC_{name.upper()}" for name in Settings.model_fields} | SETTINGS_OF_AUTH


def need_root() -> None:
    if os.geteuid() != 0:
        problem = "deploy/local.sh replicas writes its env file as root"
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)


def replicas_env(folder: Path, **extra: str) -> dict[str, str]:
    """``deploy/local.sh replicas env`` into ``folder``: the env file's values (it also checks the file's mode)."""
    need_root()
    result = subprocess.run(
        [str(ROOT / "deploy" / "local.sh"), "replicas", "env"],
        env=clean_env(PTC_REPLICAS_DIR=str(folder), **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path == folder / "replicas.env"
    assert path.stat().st_mode & 0o777 == 0o600
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_replicas_env_file_is_written_once_with_random_secrets(tmp_path: Path) -> None:
    first = replicas_env(tmp_path / "a")
    assert first["PTC_PORT"] == "8081" and first["PTC_REPLICA2_PORT"] == "8082" and first["PTC_LB_PORT"] == "8080"
    assert first["PTC_INSTANCE_ID"] != first["PTC_REPLICA2_INSTANCE_ID"]
    assert first["PTC_WORK_DIR"] == str(tmp_path / "a" / "r1")
    assert first["PTC_REPLICA2_WORK_DIR"] == str(tmp_path / "a" / "r2")
    password = first["PTC_PG_PASSWORD"]
    assert len(password) >= 32 and len(first["PTC_INTERNAL_SECRET"]) >= 32
    assert len(first["PTC_CALLBACK_SECRET"]) >= 32  # callbacks need one, and either replica may deliver
    assert first["PTC_STORE_URL"] == f"postgresql://ptc:{password}@127.0.0.1:{first['PTC_PG_PORT']}/ptc"
    # Half the host each: both replicas drive the one engine.
    memory_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    assert int(first["PTC_HOST_MEMORY_MB"]) == memory_mb // 2
    assert float(first["PTC_HOST_CPUS"]) == max(0.5, (os.cpu_count() or 1) / 2)
    assert first["PTC_AUTH"] == "disabled" and "PTC_API_KEYS" not in first  # no keys given: loopback only
    assert first["PTC_EGRESS_ALLOW"] == "http://127.0.0.1:8765"  # the README's demo tool server, not the balancer
    known = known_settings() | {"PTC_DOCKER_GID", "PTC_SERVICE_IMAGE", "PTC_LB_PORT", "COMPOSE_PROJECT_NAME"}
    assert {k for k in first if not k.startswith(("PTC_REPLICA2_", "PTC_PG_"))} <= known
    # Written once: a second run keeps it (and its secrets); another folder gets other secrets.
    again = replicas_env(tmp_path / "a", PTC_LB_PORT="9999")
    assert again == first
    other = replicas_env(tmp_path / "b", PTC_API_KEYS="agent:" + "0" * 64, PTC_LB_PORT="9080", PTC_EGRESS_ALLOW="")
    assert other["PTC_EGRESS_ALLOW"] == ""  # set, even to nothing: the operator's choice
    assert other["PTC_PG_PASSWORD"] != password and other["PTC_INTERNAL_SECRET"] != first["PTC_INTERNAL_SECRET"]
    assert other["PTC_CALLBACK_SECRET"] != first["PTC_CALLBACK_SECRET"]
    assert other["PTC_API_KEYS"] == "agent:" + "0" * 64 and "PTC_AUTH" not in other and other["PTC_LB_PORT"] == "9080"


def test_the_readme_example_is_the_one_loopback_destination_of_the_local_set_up() -> None:
    """``deploy/local.sh serve`` and ``replicas`` name, when ``PTC_EGRESS_ALLOW`` is unset, exactly what the README's
    example calls (the demo tool server, address and port): its URL is admitted, and none of the set-up's other
    loopback services (the balancer, the replicas, the store, Prometheus, Grafana) nor another port is."""
    script = (ROOT / "deploy" / "local.sh").read_text()
    (demo,) = [line.split("=", 1)[1] for line in script.splitlines() if line.startswith("demo_tools=")]
    assert "export PTC_EGRESS_ALLOW=$demo_tools" in script  # serve, when the variable is unset
    assert "PTC_EGRESS_ALLOW=${PTC_EGRESS_ALLOW-$demo_tools}" in script  # replicas.env, when it is unset
    example = (ROOT / "README.md").read_text().split("## Example", 1)[1].split("\n## ", 1)[0]
    urls = [part.split('"', 1)[0] for part in example.split('"url": "')[1:]]
    assert urls and demo in example
    policy = EgressPolicy([demo])
    for url in urls:
        policy.target(url)
    for port in (8080, 8081, 8082, 5433, 9090, 3000, 8766):
        with pytest.raises(EgressDenied):
            policy.target(f"http://127.0.0.1:{port}/execute")


def test_the_kubernetes_placeholders_are_no_usable_credentials() -> None:
    """The shipped Secrets hold placeholders no deployment can run on: the internal HMAC key is refused at start
    (too short), and the API keys are hashes no token has (all zeros)."""
    secrets = {
        doc["metadata"]["name"]: doc["stringData"]
        for doc in yaml.safe_load_all((KUBERNETES / "secret.yaml").read_text())
    }
    with pytest.raises(ValueError, match="at least 32 characters"):
        parse_secrets(secrets["ptc-sandbox-internal"]["secret"])
    lines = secrets["ptc-sandbox-api-keys"]["api-keys"].splitlines()
    hashes = [line.split(":", 1)[1] for line in lines if ":" in line and not line.startswith("#")]
    assert hashes and set(hashes) == {"0" * 64}


def test_compose_replicas_profile(tmp_path: Path) -> None:
    values = replicas_env(tmp_path)
    config = compose_config("--profile", "replicas", env=clean_env(**values))
    services = config["services"]
    # Compose v1 lists every profile's services whichever are active; v2 only the active ones.
    assert set(services) - {"prometheus", "grafana"} == {"sandbox-image", "work-dir", "ptc-sandbox"} | REPLICAS_PROFILE
    assert not config.get("networks")  # host network only, no bridge
    for name, service in services.items():
        assert service.get("network_mode") in ("host", "none"), name
    assert {n for n, s in services.items() if "replicas" in s.get("profiles", [])} == REPLICAS_PROFILE
    one, two = services["ptc-sandbox"], services["ptc-sandbox-2"]
    env1, env2 = one["environment"], two["environment"]
    assert set(env1) == set(env2) and set(env1) <= known_settings(), set(env1) ^ set(env2)
    for name in ("PTC_STORE_URL", "PTC_INTERNAL_SECRET", "PTC_HOST_MEMORY_MB", "PTC_TRUSTED_PROXIES"):
        assert name in env1, name  # passed through from the env file (deploy/local.sh exports it)
    assert (env1["PTC_PORT"], env2["PTC_PORT"]) == (values["PTC_PORT"], values["PTC_REPLICA2_PORT"])
    assert (env1["PTC_INSTANCE_ID"], env2["PTC_INSTANCE_ID"]) == (
        values["PTC_INSTANCE_ID"],
        values["PTC_REPLICA2_INSTANCE_ID"],
    )
    work_dirs = (values["PTC_WORK_DIR"], values["PTC_REPLICA2_WORK_DIR"])
    assert (env1["PTC_WORK_DIR"], env2["PTC_WORK_DIR"]) == work_dirs
    assert f"{work_dirs[1]}:{work_dirs[1]}" in bind_mounts(two)
    assert services["work-dir-2"]["environment"]["PTC_WORK_DIR"] == work_dirs[1]
    assert two["depends_on"] == {
        "sandbox-image": {"condition": "service_completed_successfully"},
        "work-dir-2": {"condition": "service_completed_successfully"},
    }
    for service in (two, services["store"], services["balancer"]):
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
        assert service["restart"] == "unless-stopped"
    # The store: the entrypoint from this tree, on the port and data dir of the env file, with a health check.
    store = services["store"]
    assert store["image"] == "ptc-sandbox-postgres:bookworm"
    entrypoint = str(ROOT / "deploy" / "replicas" / "postgres-entrypoint.sh")
    assert f"{entrypoint}:/usr/local/bin/postgres-entrypoint.sh" in bind_mounts(store)
    assert f"{values['PTC_PG_DATA']}:/var/lib/postgresql/data" in bind_mounts(store)
    assert f"port={values['PTC_PG_PORT']}" in store["command"] and "listen_addresses=127.0.0.1" in store["command"]
    assert store["environment"]["POSTGRES_PASSWORD"] == values["PTC_PG_PASSWORD"]
    assert store["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert set(store["cap_add"]) == {"CHOWN", "FOWNER", "SETUID", "SETGID"}
    # The balancer: deploy/replicas/haproxy.cfg in front of both replicas' ports.
    balancer = services["balancer"]
    assert balancer["image"] == "ptc-sandbox-haproxy:bookworm"
    cfg = str(ROOT / "deploy" / "replicas" / "haproxy.cfg")
    assert f"{cfg}:/usr/local/etc/haproxy/haproxy.cfg" in bind_mounts(balancer)
    assert balancer["environment"] == {
        "PTC_LB_BIND": f"127.0.0.1:{values['PTC_LB_PORT']}",
        "PTC_REPLICA_1": f"127.0.0.1:{values['PTC_PORT']}",
        "PTC_REPLICA_2": f"127.0.0.1:{values['PTC_REPLICA2_PORT']}",
    }


def test_balancer_drops_internal_headers_and_checks_readiness(tmp_path: Path) -> None:
    """HAProxy with deploy/replicas/haproxy.cfg in front of two stub replicas: a client's ``Ptc-Internal-*``
    headers never reach a replica (only replicas sign internal calls, to each other), other headers do; a
    replica whose ``/readyz`` is not 200 gets no requests."""
    haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if haproxy is None:
        problem = "no haproxy (deploy/local.sh setup installs Debian's package)"
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)
    seen: list[tuple[int, dict[str, str]]] = []

    def stub(index: int, ready: bool) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/readyz":
                    seen.append((index, {k.lower(): v for k, v in self.headers.items()}))
                self.send_response(200 if ready or self.path != "/readyz" else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    servers = [stub(1, ready=True), stub(2, ready=False)]
    port = free_port()
    env = {
        **os.environ,
        "PTC_LB_BIND": f"127.0.0.1:{port}",
        "PTC_REPLICA_1": f"127.0.0.1:{servers[0].server_address[1]}",
        "PTC_REPLICA_2": f"127.0.0.1:{servers[1].server_address[1]}",
    }
    log = (tmp_path / "haproxy.log").open("wb")
    process = subprocess.Popen(
        [haproxy, "-db", "-f", str(ROOT / "deploy" / "replicas" / "haproxy.cfg")], env=env, stdout=log, stderr=log
    )
    try:
        forged = {"Ptc-Internal-Signature": "v1=" + "0" * 64, "PTC-INTERNAL-CALLER": "other", "X-Kept": "yes"}

        def answered() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/jobs", headers=forged, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answered, 20, 0.2)
        time.sleep(1.5)  # the checks (every 500 ms, fall 2) have taken replica 2 out
        seen.clear()
        for _ in range(6):
            assert httpx.get(f"http://127.0.0.1:{port}/jobs", headers=forged, timeout=5).status_code == 200
        assert [index for index, _ in seen] == [1] * 6
        for _, headers in seen:
            assert headers["x-kept"] == "yes"
            assert not [name for name in headers if name.startswith("ptc-internal-")], headers
    finally:
        process.terminate()
        process.wait(10)
        log.close()
        for server in servers:
            server.shutdown()
            server.server_close()


def test_prometheus_scrapes_each_replica_not_the_balancer() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for job in jobs.values() for group in job["static_configs"] for t in group["targets"]}
    assert {"127.0.0.1:8081", "127.0.0.1:8082"} <= targets
    assert "127.0.0.1:8080" not in {t for t in jobs["ptc-sandbox-replicas"]["static_configs"][0]["targets"]}


def test_kubernetes_replicated_mode() -> None:
    deployment = one("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert env["PTC_INTERNAL_URL"]["value"] == f"http://$(POD_IP):{port}"
    assert list(env).index("POD_IP") < list(env).index("PTC_INTERNAL_URL")  # $(POD_IP) expands only so
    secrets_ = {d["metadata"]["name"]: d for _, d in manifests(KUBERNETES, "*.yaml") if d["kind"] == "Secret"}
    for name in ("PTC_STORE_URL", "PTC_INTERNAL_SECRET"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secrets_[ref["name"]]["stringData"], name
    assert set(env) <= known_settings() | {"POD_IP"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # The migration runs before the service, against the same store.
    init = {c["name"]: c for c in pod["initContainers"]}
    migrate = init["migrate"]
    assert migrate["command"] == ["ptc-sandbox", "migrate"] and migrate["image"] == container["image"]
    [store_ref] = [e for e in migrate["env"] if e["name"] == "PTC_STORE_URL"]
    assert store_ref == env["PTC_STORE_URL"]
    assert migrate["securityContext"]["readOnlyRootFilesystem"] is True
    assert list(init) == ["work-dir", "migrate"]
    # The network policy lets the replicas call each other and reach the store.
    policy = next(d for f, d in manifests() if d["kind"] == "NetworkPolicy" and not f.startswith("planned/"))
    pod_labels = spec["template"]["metadata"]["labels"]
    peers_in = [
        r
        for r in policy["spec"]["ingress"]
        if any("podSelector" in f and "namespaceSelector" not in f for f in r["from"])
    ]
    assert peers_in and peers_in[0]["from"][0]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    egress_ports = {(p["port"], p["protocol"]) for r in policy["spec"]["egress"] for p in r["ports"]}
    assert {(5432, "TCP"), (port, "TCP")} <= egress_ports
    peers_out = [
        r
        for r in policy["spec"]["egress"]
        if any("podSelector" in t for t in r["to"]) and {p["port"] for p in r["ports"]} == {port}
    ]
    assert peers_out and peers_out[0]["to"][0]["podSelector"]["matchLabels"].items() <= pod_labels.items()
