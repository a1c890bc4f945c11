"""DockerBackend against the real engine: hardening, output from the first byte, kill, failures leave nothing.

Tests taking ``runtime`` run under runc and under gVisor (runsc).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import docker
import pytest

from service.errors import SandboxError
from service.sandbox.backend import SandboxSpec, Stream
from service.sandbox.docker import DockerBackend
from tests.conftest import IMAGE

pytestmark = pytest.mark.usefixtures("engine")


def spec_for(job_dir: Path, script: str, image: str = IMAGE, runtime: str | None = None, **labels: str) -> SandboxSpec:
    job_dir.mkdir(parents=True, exist_ok=True)
    job_dir.chmod(0o755)
    (job_dir / "script.py").write_text(script)
    (job_dir / "script.py").chmod(0o644)
    return SandboxSpec(
        image=image,
        job_dir=job_dir,
        memory_mb=128,
        cpus=1,
        pids=64,
        tmp_mb=8,
        file_size_mb=1,
        open_files=256,
        labels={"io.ptc-sandbox.test": secrets.token_hex(4), **labels},
        runtime=runtime,
    )


async def test_output_is_captured_and_limits_are_applied(
    engine: docker.DockerClient, scratch: Path, runtime: str
) -> None:
    backend = DockerBackend()
    chunks: dict[Stream, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    script = (
        "import os, resource, sys\n"
        "print(resource.getrlimit(resource.RLIMIT_FSIZE)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "for f in ('/sys/fs/cgroup/pids/pids.max', '/sys/fs/cgroup/pids.max', None):\n"
        "    if f is None or os.path.exists(f):\n"
        "        print(open(f).read().strip() if f else 'no cgroup files')\n"
        "        break\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    spec = spec_for(scratch / f"backend-out-{runtime}", script, runtime=runtime)
    handle = await backend.start(spec, lambda stream, data: chunks[stream].extend(data))
    try:
        status = await backend.wait(handle)
        assert (status.exit_code, status.oom_killed) == (3, False)
        # gVisor shows the sandbox no cgroup files: the engine applies the limits to the whole sandbox on the host.
        pids = "no cgroup files" if runtime == "runsc" else "64"
        assert chunks["stdout"].decode() == f"{1024 * 1024} 256\n{pids}\n"
        assert chunks["stderr"].decode() == "err\n"
        attrs = engine.api.inspect_container(handle.id)
        host = attrs["HostConfig"]
        assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
        assert host["Memory"] == host["MemorySwap"] == 128 * 1024 * 1024
        # gVisor's own threads count in the host's pids cgroup: it gets room for them (see DockerBackend._create).
        assert host["PidsLimit"] == (64 * 24 + 64 if runtime == "runsc" else 64)
        # The runtime's interpreter stays root with three capabilities; each script drops to the sandbox's own uid
        # (confine.py), given in its environment and label (DockerBackend._create_with_uid).
        assert attrs["Config"]["User"] == "0:0" and sorted(host["CapAdd"]) == ["KILL", "SETGID", "SETUID"]
        assert host["Runtime"] == runtime
    finally:
        await backend.remove(handle)
        await backend.close()
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(handle.id)


async def test_kill_ends_a_running_sandbox(scratch: Path, runtime: str) -> None:
    backend = DockerBackend()
    spec = spec_for(scratch / f"backend-kill-{runtime}", "import time\ntime.sleep(60)", runtime=runtime)
    handle = await backend.start(spec, lambda s, d: None)
    try:
        await backend.kill(handle)
        status = await backend.wait(handle)
        assert status.exit_code == 137
        await backend.kill(handle)  # already dead: no error
    finally:
        await backend.remove(handle)
        await backend.remove(handle)  # already gone: no error
        await backend.close()


async def test_failed_start_leaves_no_container(engine: docker.DockerClient, scratch: Path) -> None:
    backend = DockerBackend()
    spec = spec_for(scratch / "backend-fail", "print(1)", image="ptc-sandbox-no-such-image:0")
    try:
        with pytest.raises(SandboxError):
            await backend.start(spec, lambda s, d: None)
        label = f"io.ptc-sandbox.test={spec.labels['io.ptc-sandbox.test']}"
        assert engine.containers.list(all=True, filters={"label": label}) == []
    finally:
        await backend.close()


async def test_ready_reports_a_missing_image() -> None:
    backend = DockerBackend()
    try:
        assert await backend.ready(IMAGE) == (True, "ok")
        ok, reason = await backend.ready("ptc-sandbox-no-such-image:0")
        assert not ok and "not present" in reason
    finally:
        await backend.close()
