"""Docker backend: one container per sandbox, hardened (``_create``: no network, read-only root, no capability
but the resident interpreter's three, seccomp, memory/CPU/pids limits, a small ``/tmp``; docs/threat-model.md).

The only module that imports the Docker SDK. Every blocking SDK call runs in
this backend's thread pool, and its errors are translated here: the engine
refused (``SandboxError``) or cannot be reached (``EngineUnavailable``). The
container's own stdout and stderr (the resident interpreter's, never a
script's: a script's output travels on the control socket) are read by one
thread per sandbox from an attach stream opened before the container starts,
and handed to the start's ``OutputSink``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
from docker.types import LogConfig, Mount, Ulimit
from docker.utils.socket import frames_iter
from ptc_runtime import protocol
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from service.errors import EngineUnavailable, SandboxError
from service.sandbox.backend import RUN_DIR, ExitStatus, OutputSink, SandboxBackend, SandboxHandle, SandboxSpec
from service.sandbox.labels import FEATURE_PRIVSEP, LABEL_UID, features, uid_range
from service.sandbox.seccomp import profile_json

log = logging.getLogger(__name__)
_RANDOM = random.SystemRandom()
T = TypeVar("T")

MIB = 1024 * 1024
SANDBOX_USER = "10001:10001"
PRIVSEP_USER = "0:0"
PRIVSEP_CAPS = ["SETUID", "SETGID", "KILL"]  # the resident interpreter's; every script drops them (10001, none)
GVISOR = "runsc"
# gVisor (this runsc, ptrace platform) holds host tasks for its own threads: measured, 8 per idle process of the
# sandbox and about 25 per process at the peak of a fork bomb on an idle host (32 processes: 795 host tasks; 64:
# 1,691), up to 37 with the host's CPUs busy (32 processes: 1,187; 25 bombs beside three busy loops). At 8 per pid
# (1,088 for the default 128) a bomb on a loaded host filled the cgroup and gVisor died (exit 2, Go's fatal error).
GVISOR_PROCESS_SHARE = 4  # the sandbox user's processes and threads inside gVisor: pids // this
GVISOR_HOST_TASKS_PER_PID = 24  # the host's pids cgroup: pids * this + base (96 per process inside: 2.6x the peak)
GVISOR_HOST_TASKS_BASE = 64
OUTPUT_DRAIN_S = 5.0
SWEEP_SETTLE_ROUNDS = 40  # x 0.25 s
REMOVE_ATTEMPTS = 5  # a failed removal is tried again (the engine can leave an exiting container "dead"): ~3 s in all
REMOVE_RETRY_S = 0.2
_STREAMS = {1: "stdout", 2: "stderr"}
UID_ATTEMPTS = 8  # uids tried for one sandbox before its start fails (see _create_with_uid)
OOM_EVENT = "oom"  # the engine's event for an OOM kill in a container's memory cgroup
EVENTS_LOOKBACK_S = 3600.0  # where the engine's log is read from when a container's creation time is unreadable
FALLBACK_API_VERSION = "1.41"  # Docker 20.10's API; every later engine still serves it
GVISOR_SECCOMP_FLAGS = frozenset({"--oci-seccomp", "--oci-seccomp=true", "-oci-seccomp", "-oci-seccomp=true"})
"""runsc flags that make gVisor apply the container's seccomp profile to the sandboxed processes."""


def runtime_problem(name: str, runtimes: Mapping[str, Any]) -> str | None:
    """Why the engine's runtime ``name`` cannot run sandboxes, or None when it can.

    ``runtimes`` is ``docker info``'s ``Runtimes`` ({name: {"path": ..., "runtimeArgs": [...]}}). A gVisor
    runtime (its path ends in ``runsc``) must carry ``--oci-seccomp``: without it runsc ignores the seccomp
    profile (``service/sandbox/seccomp.py``), and a script could use io_uring and create user namespaces.
    """
    entry = runtimes.get(name)
    if entry is None:
        return (
            f"the Docker engine has no runtime {name!r}; registered: {', '.join(sorted(runtimes)) or 'none'} "
            "(deploy/local.sh setup registers runsc)"
        )
    path = str((entry or {}).get("path") or "")
    args = set((entry or {}).get("runtimeArgs") or ())
    if path.rsplit("/", 1)[-1] == "runsc" and not args & GVISOR_SECCOMP_FLAGS:
        return (
            f"the Docker engine's runtime {name!r} is gVisor without --oci-seccomp, so the sandboxes' seccomp "
            "profile would not apply (deploy/local.sh setup registers runsc with it)"
        )
    return None


def _free_uid(uids: range, taken: set[str]) -> int | None:
    """A uid of ``uids`` not in ``taken`` (uids as label strings), at random; None when there is none."""
    if len(taken) < len(uids) // 2:
        while True:  # most are free: a few draws
            uid = _RANDOM.choice(uids)
            if str(uid) not in taken:
                return uid
    free = [uid for uid in uids if str(uid) not in taken]
    return _RANDOM.choice(free) if free else None


def _removal_may_succeed_later(exc: BaseException) -> bool:
    """Whether a failed removal is worth trying again: the engine answered with an error (a 409 for a container
    that exited under a forced removal, or a 500), not a client mistake (other 4xx) and not an engine that is
    unreachable (that is ``EngineUnavailable``'s business)."""
    return isinstance(exc, docker.errors.APIError) and (exc.status_code == 409 or (exc.status_code or 500) >= 500)


class DockerBackend(SandboxBackend):
    """Sandboxes as Docker containers.

    Args:
        base_url: engine URL; None = ``DOCKER_HOST`` or the local socket.
        max_workers: threads for blocking SDK calls.
        runtime: the OCI runtime the service's sandboxes use (``runsc`` for gVisor); ``ready`` checks that the
            engine has it registered. None = the engine's default, always there.
    """

    def __init__(self, base_url: str | None = None, max_workers: int = 16, runtime: str | None = None) -> None:
        try:
            self._client = self._connect(base_url, max_workers, None)
        except docker.errors.DockerException as exc:
            # The engine is down now; serve anyway (readyz says why) and talk to it when it is back.
            log.warning("Docker engine not reachable at start (%s); will retry on each request", exc)
            self._client = self._connect(base_url, max_workers, FALLBACK_API_VERSION)
        self._api = self._client.api
        self._runtime = runtime
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ptc-docker")
        self._readers: dict[str, threading.Thread] = {}
        self._traits: dict[str, tuple[bool, range | None]] = {}  # image -> _image_traits
        self._runtimes_ok: set[str | None] = {None}  # runtimes checked by runtime_problem; None: the engine's default

    @staticmethod
    def _connect(base_url: str | None, max_workers: int, version: str | None) -> docker.DockerClient:
        """A client for ``base_url``, or as ``DOCKER_HOST``/``DOCKER_TLS_VERIFY``/``DOCKER_CERT_PATH`` say."""
        if base_url:
            return docker.DockerClient(base_url=base_url, version=version, max_pool_size=max_workers)
        return docker.from_env(version=version, max_pool_size=max_workers)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
            if isinstance(exc, docker.errors.APIError):
                raise SandboxError(f"the Docker engine refused: {exc.explanation or exc}") from exc
            raise EngineUnavailable(f"the Docker engine is not reachable: {type(exc).__name__}") from exc

    def _image_traits(self, image: str) -> tuple[bool, range | None]:
        """(privsep, uids) of ``image``: whether its runtime drops to the scripts' user when started as root (its
        label lists ``privsep``), and the uids it offers its sandboxes (``labels.uid_range``, None: 10001 for all);
        cached per image for the life of the backend (a rebuilt image needs a restart anyway, see the pool)."""
        if image not in self._traits:
            attrs = self._api.inspect_image(image)  # type: ignore[no-untyped-call]
            labels = (attrs.get("Config") or {}).get("Labels") or {}
            self._traits[image] = (FEATURE_PRIVSEP in features(labels), uid_range(labels))
        return self._traits[image]

    def _live_uids(self) -> set[str]:
        """The uids (``LABEL_UID``) of every sandbox the engine holds, running or not, of any service instance."""
        containers = self._api.containers(all=True, filters={"label": LABEL_UID})
        return {str((c.get("Labels") or {}).get(LABEL_UID)) for c in containers}

    def _create_with_uid(self, spec: SandboxSpec) -> str:
        """Create the sandbox's container with a uid of its own for its scripts, when its image offers a range.

        One uid per live sandbox of the engine, so that no two sandboxes share the kernel's per-user limits
        (inotify instances, pipe buffers, ...): a uid of the image's range that no container of the engine carries
        (``LABEL_UID``, whichever service instance or replica made it) is picked at random and the container is
        created with it; then the containers carrying that uid are listed again, and when another one is among
        them this one is removed and another uid tried (``UID_ATTEMPTS`` in all). Each creates before it looks, so
        of two that picked one uid at once the later to look always sees the other: two never both keep it (both
        may give it up). The uid is given back when the container is removed (its label goes with it).

        Raises:
            SandboxError: every uid of the range is taken, or each attempt met another sandbox.
        """
        _, uids = self._image_traits(spec.image)
        if uids is None:
            return self._create(spec, None)
        taken = self._live_uids()
        for _ in range(UID_ATTEMPTS):
            uid = _free_uid(uids, taken)
            if uid is None:
                break
            container_id = self._create(spec, uid)
            holders = self._api.containers(all=True, quiet=True, filters={"label": f"{LABEL_UID}={uid}"})
            if all(holder["Id"] == container_id for holder in holders):
                return container_id
            self._api.remove_container(container_id, force=True)
            taken.add(str(uid))
        raise SandboxError(
            f"no uid of the image's range {uids.start}-{uids.stop - 1} is free for another sandbox ({len(taken)} taken)"
        )

    def _create(self, spec: SandboxSpec, uid: int | None) -> str:
        """Create (not start) the sandbox's container.

        An image labelled ``privsep`` starts as root holding only ``PRIVSEP_CAPS``: the resident interpreter keeps
        them, each script runs as 10001 with none (``ptc_runtime/confine.py``), so no script can signal, ptrace
        or read the interpreter under runc or gVisor. Other images run as 10001 with no capability at all.
        Under gVisor the host's pids cgroup also counts gVisor's own threads, and when it is full gVisor itself
        cannot make a thread and the whole sandbox dies. So the script's processes and threads are bounded inside
        gVisor's kernel (``RLIMIT_NPROC`` of the sandbox user: ``pids // GVISOR_PROCESS_SHARE``, fork then fails
        with EAGAIN as under runc), and the host's cgroup gets ``pids * GVISOR_HOST_TASKS_PER_PID +
        GVISOR_HOST_TASKS_BASE``, above what that many processes of a fork bomb make gVisor hold.
        """
        privsep, _ = self._image_traits(spec.image)
        ulimits = [
            Ulimit(name="nofile", soft=spec.open_files, hard=spec.open_files),
            Ulimit(name="fsize", soft=spec.file_size_mb * MIB, hard=spec.file_size_mb * MIB),
        ]
        host_pids = spec.pids
        if spec.runtime == GVISOR:
            inside = max(4, spec.pids // GVISOR_PROCESS_SHARE)
            ulimits.append(Ulimit(name="nproc", soft=inside, hard=inside))
            host_pids = spec.pids * GVISOR_HOST_TASKS_PER_PID + GVISOR_HOST_TASKS_BASE
        host_config = self._api.create_host_config(
            network_mode="none",
            read_only=True,
            tmpfs={"/tmp": f"size={spec.tmp_mb}m,mode=1777,nosuid,nodev"},
            cap_drop=["ALL"],
            cap_add=PRIVSEP_CAPS if privsep else None,
            security_opt=["no-new-privileges", f"seccomp={profile_json()}"],
            mem_limit=spec.memory_mb * MIB,
            memswap_limit=spec.memory_mb * MIB,
            nano_cpus=int(spec.cpus * 1e9),
            pids_limit=host_pids,
            ulimits=ulimits,
            mounts=[Mount(target=RUN_DIR, source=str(spec.job_dir), type="bind", read_only=True)],
            init=False,  # the runtime's server is pid 1 itself (ptc_runtime/session.py): no other process to trust
            ipc_mode="private",
            shm_size=f"{min(spec.tmp_mb, 64)}m",  # /dev/shm is tmpfs too: no larger than /tmp
            log_config=LogConfig(type="none"),
            runtime=spec.runtime,
        )
        environment, labels = dict(spec.env), dict(spec.labels)
        if spec.hash_seed is not None:  # the resident interpreter's, which every script it forks inherits
            environment["PYTHONHASHSEED"] = str(spec.hash_seed)
        if uid is not None:
            environment[protocol.SCRIPT_UID_ENV] = str(uid)
            labels[LABEL_UID] = str(uid)
        container = self._api.create_container(
            spec.image,
            user=PRIVSEP_USER if privsep else (SANDBOX_USER if uid is None else f"{uid}:{uid}"),
            working_dir="/tmp",
            environment=environment,
            labels=labels,
            host_config=host_config,
            network_disabled=True,
            stdin_open=False,
            tty=False,
        )
        return str(container["Id"])

    def _attach(self, container_id: str, sink: OutputSink) -> threading.Thread:
        sock = self._api.attach_socket(container_id, params={"stdout": 1, "stderr": 1, "stream": 1})
        for s in (sock, getattr(sock, "_sock", None)):  # the SDK's 60 s read timeout would end a quiet script's stream
            if s is not None and hasattr(s, "settimeout"):
                s.settimeout(None)

        def read() -> None:
            try:
                for stream, chunk in frames_iter(sock, False):  # type: ignore[no-untyped-call]
                    name = _STREAMS.get(stream)
                    if name is not None and chunk:
                        sink(name, chunk)  # type: ignore[arg-type]
            except Exception:  # the stream ends with the container; anything else is worth a trace
                log.debug("output stream of %s ended with an error", container_id[:12], exc_info=True)
            finally:  # the SDK's wrapper and the socket under it: closing the wrapper alone leaves the socket open
                for s in (sock, getattr(sock, "_sock", None)):
                    with contextlib.suppress(Exception):
                        if s is not None:
                            s.close()

        return threading.Thread(target=read, name=f"ptc-output-{container_id[:12]}", daemon=True)

    def _check_runtime(self, name: str | None) -> None:
        """Raise SandboxError when the engine's runtime ``name`` cannot run hardened sandboxes (``runtime_problem``)."""
        if name in self._runtimes_ok:
            return
        assert name is not None
        runtimes = self._api.info().get("Runtimes") or {}
        if name not in runtimes:
            return  # the engine refuses it itself ("Unknown runtime")
        problem = runtime_problem(name, runtimes)
        if problem:
            raise SandboxError(problem)
        self._runtimes_ok.add(name)  # a refusal is not remembered: the operator may register the runtime meanwhile

    def _start_blocking(self, spec: SandboxSpec, sink: OutputSink) -> str:
        self._check_runtime(spec.runtime)
        container_id = self._create_with_uid(spec)
        try:
            reader = self._attach(container_id, sink)
            self._api.start(container_id)
        except BaseException:
            with contextlib.suppress(Exception):
                self._api.remove_container(container_id, force=True)
            raise
        reader.start()
        self._readers[container_id] = reader
        return container_id

    async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
        try:
            container_id = await self._run(self._start_blocking, spec, sink)
        except SandboxError:
            if spec.labels:  # a create that failed late may still have left a container
                with contextlib.suppress(SandboxError):
                    await self.remove_labelled(spec.labels)
            raise
        return SandboxHandle(id=container_id, spec=spec)

    def _wait_blocking(self, container_id: str) -> ExitStatus:
        result = self._api.wait(container_id, timeout=None)
        reader = self._readers.pop(container_id, None)
        if reader is not None:
            reader.join(OUTPUT_DRAIN_S)
        state = self._api.inspect_container(container_id)["State"]
        return ExitStatus(
            exit_code=int(result.get("StatusCode", state.get("ExitCode", -1))), oom_killed=bool(state.get("OOMKilled"))
        )

    async def wait(self, handle: SandboxHandle) -> ExitStatus:
        return await self._run(self._wait_blocking, handle.id)

    def _exited_blocking(self, container_id: str) -> ExitStatus | None:
        state = self._api.inspect_container(container_id)["State"]
        if state.get("Running") or state.get("Status") in ("created", "restarting"):
            return None
        return ExitStatus(exit_code=int(state.get("ExitCode", -1)), oom_killed=bool(state.get("OOMKilled")))

    async def exited(self, handle: SandboxHandle) -> ExitStatus | None:
        return await self._run(self._exited_blocking, handle.id)

    def _oom_reported_blocking(self, container_id: str, wait_s: float) -> bool:
        """The container's ``State.OOMKilled``, else its ``oom`` event in the engine's log since it was created,
        waited for until ``wait_s`` from now (the stream ends at ``until``; the first event found ends the wait).

        Both come from the engine's OOM notification of the container's memory cgroup, which nothing in the
        sandbox can write. The flag alone is not enough: it is set only when the notification reaches the engine
        before the container's exit, and under gVisor (whose OOM kill ends the whole sandbox) the ``oom`` event was
        measured 8 to 35 ms after ``die`` in about one OOM kill in 8 (issue 24), the flag then staying false.
        """
        try:
            attrs = self._api.inspect_container(container_id)
        except docker.errors.NotFound:
            return False
        if (attrs.get("State") or {}).get("OOMKilled"):
            return True
        try:
            created = datetime.fromisoformat(str(attrs.get("Created"))).timestamp()
        except ValueError:
            created = time.time() - EVENTS_LOOKBACK_S
        stream = self._api.events(
            since=int(created) - 1,  # whole seconds (the SDK's types): a second early, a second late at most
            until=int(time.time() + wait_s) + 1,
            filters={"container": container_id, "event": OOM_EVENT},
            decode=True,
        )
        try:
            for event in stream:
                if isinstance(event, dict) and (event.get("Action") or event.get("status")) == OOM_EVENT:
                    return True
            return False
        finally:
            stream.close()

    async def oom_reported(self, handle: SandboxHandle, wait_s: float) -> bool:
        return await self._run(self._oom_reported_blocking, handle.id, wait_s)

    @staticmethod
    def _unless_gone(action: Callable[[str], object], container_id: str) -> None:
        """Run ``action(container_id)``; a container that is gone (404) or already ending (409) is not an error."""
        try:
            action(container_id)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: not running any more, or removal already in progress
                raise

    async def kill(self, handle: SandboxHandle) -> None:
        await self._run(self._unless_gone, self._api.kill, handle.id)

    def _remove_blocking(self, container_id: str) -> None:
        """Remove the container (forced); gone already is not an error, nor is a removal already under way.

        A forced removal that meets the container as it exits can fail (``Could not kill running container ...,
        cannot remove - Container ... is not running``) and leave it ``dead``; a later removal succeeds. So a
        failed removal is tried again, ``REMOVE_ATTEMPTS`` times in all, ``REMOVE_RETRY_S`` apart and more
        (tenacity); then its ``docker.errors.APIError`` is raised.
        """
        self._readers.pop(container_id, None)
        for attempt in Retrying(
            retry=retry_if_exception(_removal_may_succeed_later),
            stop=stop_after_attempt(REMOVE_ATTEMPTS),
            wait=wait_exponential(multiplier=REMOVE_RETRY_S, max=2.0),
            reraise=True,
        ):
            with attempt:
                try:
                    self._api.remove_container(container_id, force=True)
                except docker.errors.NotFound:
                    pass
                except docker.errors.APIError as exc:
                    if not (exc.status_code == 409 and "already in progress" in str(exc)):
                        raise

    async def remove(self, handle: SandboxHandle) -> None:
        await self._run(self._remove_blocking, handle.id)

    def _remove_labelled_blocking(self, labels: Mapping[str, str]) -> int:
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        containers = self._api.containers(all=True, quiet=True, filters=filters)
        for container in containers:
            self._remove_blocking(container["Id"])
        for _ in range(SWEEP_SETTLE_ROUNDS):  # a removal already under way (409) finishes in the engine: wait for it
            if not self._api.containers(all=True, quiet=True, filters=filters):
                break
            time.sleep(0.25)
        return len(containers)

    async def remove_labelled(self, labels: Mapping[str, str]) -> int:
        return await self._run(self._remove_labelled_blocking, labels)

    def _image_labels_blocking(self, image: str) -> dict[str, str]:
        try:
            attrs = self._api.inspect_image(image)  # type: ignore[no-untyped-call]
        except docker.errors.NotFound:  # the image is missing: no labels (an engine that fails is not that)
            return {}
        return dict((attrs.get("Config") or {}).get("Labels") or {})

    async def image_labels(self, image: str) -> dict[str, str]:
        return await self._run(self._image_labels_blocking, image)

    def _labelled_blocking(self, labels: Mapping[str, str]) -> list[str]:
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        return [str(c["Id"]) for c in self._api.containers(all=True, quiet=True, filters=filters)]

    async def labelled(self, labels: Mapping[str, str]) -> list[str]:
        return await self._run(self._labelled_blocking, labels)

    async def ready(self, image: str) -> tuple[bool, str]:
        try:
            await self._run(self._api.ping)
        except SandboxError as exc:
            return False, str(exc)
        if self._runtime:
            try:
                runtimes = (await self._run(self._api.info)).get("Runtimes") or {}
            except SandboxError as exc:
                return False, str(exc)
            problem = runtime_problem(self._runtime, runtimes)
            if problem:
                return False, f"{problem} (PTC_RUNTIME)"
        try:
            await self._run(self._api.inspect_image, image)
        except EngineUnavailable as exc:
            return False, str(exc)
        except SandboxError:
            return False, f"sandbox image {image!r} is not present (build it with sandbox_image/build.sh)"
        return True, "ok"

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
