"""Images per request (``PTC_IMAGES``, ``PTC_IMAGE_DEFAULTS``, ``image`` on /execute and POST /sessions), engine-free:
the settings' parsing, the limits a request of an image gets, its sandbox's profile, and the whole service on the
fake backend (422 for an unknown name before any sandbox, the image's defaults, a pool per image, sessions keep
their image, /readyz names a missing image)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from service.api import create_app
from service.errors import RequestLimitError, UnknownImage
from service.jobs.live import resolve_limits
from service.limits import check_execute, check_session
from service.sandbox.backend import OutputSink, SandboxHandle, SandboxSpec
from service.sandbox.fake import RUNTIME_LABELS, FakeBackend
from service.sandbox.images import Images, ImageUnusable, image_name
from service.sandbox.labels import LABEL_POOL
from service.sandbox.pool import profile_key
from service.sandbox.spec import sandbox_spec
from service.schemas.common import Limits
from service.schemas.job_models import ExecuteRequest
from service.schemas.session_models import SessionRequest
from service.settings import KeyLimits, Settings

ON_SERVICE_LOOP = pytest.mark.asyncio(loop_scope="session")  # the service's lifespan (a fixture) runs on that loop
ALT = "ptc-sandbox-runtime:sel-alt"
IMAGES = f"alt={ALT}"
ALT_DEFAULTS = {"alt": {"memory_mb": 512, "timeout_s": 120, "tmp_mb": 32}}


def settings(tmp_path: Path, **extra: Any) -> Settings:
    return Settings(work_dir=tmp_path, **extra)


# -- settings --------------------------------------------------------------------------------------------------


def test_without_ptc_images_the_one_image_is_default(tmp_path: Path) -> None:
    config = settings(tmp_path, sandbox_image="mine:1")
    assert config.images == {"default": "mine:1"}
    assert image_name(config, None) == "default"


def test_ptc_images_parses_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PTC_IMAGES", " data = ptc-sandbox-data:latest , alt=registry.local:5000/x/y:2 ,")
    monkeypatch.setenv("PTC_IMAGE_DEFAULTS", '{"data": {"memory_mb": 1024, "timeout_s": 120}}')
    config = Settings(work_dir=tmp_path)
    assert config.images == {
        "default": "ptc-sandbox-runtime:latest",
        "data": "ptc-sandbox-data:latest",
        "alt": "registry.local:5000/x/y:2",
    }
    assert config.image_defaults_of("data")["memory_mb"] == 1024
    assert config.image_defaults_of("data")["timeout_s"] == 120
    assert config.image_defaults_of("data")["cpus"] == config.default_cpus  # what it does not set: the server's
    assert config.image_defaults_of("alt")["memory_mb"] == config.default_memory_mb


def test_ptc_images_may_name_the_default_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PTC_IMAGES", "default=base:2,data=d:1")
    config = Settings(work_dir=tmp_path)
    assert config.sandbox_image == "base:2" and config.images["default"] == "base:2"
    monkeypatch.setenv("PTC_SANDBOX_IMAGE", "other:3")
    with pytest.raises(ValidationError, match="differ"):
        Settings(work_dir=tmp_path)
    monkeypatch.setenv("PTC_SANDBOX_IMAGE", "base:2")  # the same image twice is no conflict
    assert Settings(work_dir=tmp_path).sandbox_image == "base:2"


@pytest.mark.parametrize(
    ("images", "match"),
    [
        ("data", "not name=image"),
        ("data=", "not name=image"),
        ("data=a b", "not name=image"),
        ("Data=x:1", "not an image name"),
        ("../x=x:1", "not an image name"),
        ("a=x:1,a=y:1", "named twice"),
    ],
)
def test_a_malformed_ptc_images_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, images: str, match: str
) -> None:
    monkeypatch.setenv("PTC_IMAGES", images)
    with pytest.raises(ValidationError, match=match):
        Settings(work_dir=tmp_path)


def test_image_defaults_must_name_an_image_and_stay_within_the_maxima(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="does not"):
        settings(tmp_path, images=IMAGES, image_defaults={"data": {"memory_mb": 512}})
    with pytest.raises(ValidationError, match=r"memory_mb .* is above PTC_MAX_MEMORY_MB"):
        settings(tmp_path, images=IMAGES, image_defaults={"alt": {"memory_mb": 8192}}, max_memory_mb=4096)
    with pytest.raises(ValidationError, match="Extra inputs"):
        settings(tmp_path, images=IMAGES, image_defaults={"alt": {"memory": 512}})
    ok = settings(tmp_path, images=IMAGES, image_defaults={"default": {"memory_mb": 300}})
    assert ok.image_defaults_of("default")["memory_mb"] == 300


# -- limits of a request of an image ------------------------------------------------------------------------------


def test_a_request_gets_its_images_defaults_and_its_own_values_win(tmp_path: Path) -> None:
    config = settings(tmp_path, images=IMAGES, image_defaults=ALT_DEFAULTS)
    alt = resolve_limits(ExecuteRequest(script="", image="alt"), config)
    assert (alt.memory_mb, alt.timeout_s, alt.tmp_mb, alt.cpus) == (512, 120, 32, config.default_cpus)
    default = resolve_limits(ExecuteRequest(script=""), config)
    assert (default.memory_mb, default.timeout_s) == (config.default_memory_mb, config.default_timeout_s)
    own = resolve_limits(ExecuteRequest(script="", image="alt", timeout_s=5, limits=Limits(memory_mb=64)), config)
    assert (own.memory_mb, own.timeout_s, own.tmp_mb) == (64, 5, 32)
    with pytest.raises(RequestLimitError):  # the server maximum still caps
        resolve_limits(ExecuteRequest(script="", image="alt", limits=Limits(memory_mb=5000)), config)


def test_a_keys_maxima_lower_an_images_defaults(tmp_path: Path) -> None:
    config = settings(tmp_path, images=IMAGES, image_defaults=ALT_DEFAULTS, key_limits={"small": {"memory_mb": 300}})
    body = ExecuteRequest(script="", image="alt")
    check_execute(body, config, "small")
    assert body.limits.memory_mb == 300  # the image's 512 lowered to the key's maximum
    plain = ExecuteRequest(script="")
    check_execute(plain, config, "small")
    assert plain.limits.memory_mb is None  # the server's 256 fits: left to the default (and its warm pool)
    assert resolve_limits(ExecuteRequest(script="", image="alt"), config, KeyLimits(memory_mb=300)).memory_mb == 300
    with pytest.raises(RequestLimitError):
        check_execute(ExecuteRequest(script="", image="alt", limits=Limits(memory_mb=400)), config, "small")


def test_an_unknown_image_is_refused_naming_the_offered_names_only(tmp_path: Path) -> None:
    config = settings(tmp_path, images=IMAGES)
    for check in (
        lambda: check_execute(ExecuteRequest(script="", image="nope"), config, None),
        lambda: check_session(SessionRequest(image=ALT), config, None),  # a reference is no name
        lambda: resolve_limits(ExecuteRequest(script="", image="nope"), config),
    ):
        with pytest.raises(UnknownImage) as caught:
            check()
        assert caught.value.allowed == ["alt", "default"] and caught.value.loc == ("body", "image")
        assert "ptc-sandbox-runtime:latest" not in str(caught.value)  # only the caller's own words and the names


def test_each_image_is_its_own_sandbox_profile(tmp_path: Path) -> None:
    config = settings(tmp_path, images=IMAGES)
    limits = resolve_limits(ExecuteRequest(script=""), config)
    default = sandbox_spec(config, limits, {}, tmp_path, {})
    alt = sandbox_spec(config, limits, {}, tmp_path, {}, "alt")
    assert (default.image, alt.image) == (config.sandbox_image, ALT)
    assert profile_key(default) != profile_key(alt)


# -- the images as the engine knows them ----------------------------------------------------------------------


async def test_images_require_a_present_image_with_the_session_feature() -> None:
    backend = FakeBackend(images={"a:1": RUNTIME_LABELS, "old:1": {"x": "y"}})
    images = Images(backend, {"default": "a:1", "old": "old:1", "gone": "gone:1"})
    await images.require("default")
    for name, why in (("old", "cannot run scripts"), ("gone", "not present")):
        with pytest.raises(ImageUnusable, match=why) as caught:
            await images.require(name)
        assert ":1" not in str(caught.value)  # named by its name, not its reference
    assert sorted(await images.missing()) == ["gone", "old"]
    assert backend.images is not None
    backend.images["gone:1"] = dict(RUNTIME_LABELS)  # built later: usable without a restart
    assert sorted(await images.missing()) == ["old"]


# -- the service on the fake backend ----------------------------------------------------------------------------


class Recording(FakeBackend):
    """A fake backend that keeps the spec of every sandbox it started."""

    def __init__(self, images: Mapping[str, Mapping[str, str]] | None = None) -> None:
        super().__init__(images)
        self.specs: dict[str, SandboxSpec] = {}

    async def start(self, spec: SandboxSpec, sink: OutputSink) -> SandboxHandle:
        handle = await super().start(spec, sink)
        self.specs[handle.id[:12]] = spec
        return handle

    def job_starts(self) -> int:
        """Sandboxes started for jobs and sessions (not for a warm pool)."""
        return sum(1 for spec in self.specs.values() if LABEL_POOL not in spec.labels)


@pytest.fixture
async def api(request: pytest.FixtureRequest) -> AsyncIterator[tuple[httpx.AsyncClient, Recording]]:
    images: dict[str, Mapping[str, str]] | None = getattr(request, "param", None)
    work_dir = Path(tempfile.mkdtemp(prefix="ptcs", dir="/tmp"))
    config = Settings(
        work_dir=work_dir,
        auth="disabled",
        sandbox_folders_tmpfs_mb=0,
        warm_pool_size=1,
        instance_id="fake-" + work_dir.name,
        images=IMAGES + ",gone=ptc-sandbox-runtime:sel-gone",
        image_defaults=ALT_DEFAULTS,
    )
    backend = Recording(images if images is not None else {config.sandbox_image: RUNTIME_LABELS, ALT: RUNTIME_LABELS})
    app = create_app(config, backend)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=60) as client:
                yield client, backend
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


@ON_SERVICE_LOOP
async def test_an_unknown_image_is_a_422_before_any_sandbox_starts(api: tuple[httpx.AsyncClient, Recording]) -> None:
    client, backend = api
    started = backend.job_starts()
    for path, body in (("/execute", {"script": "print(1)", "image": "nope"}), ("/sessions", {"image": "nope"})):
        answer = await client.post(path, json=body)
        assert answer.status_code == 422, answer.text
        problem = answer.json()
        assert problem["type"].endswith("/unknown-image")
        assert problem["allowed_images"] == ["alt", "default", "gone"]
        assert problem["errors"][0]["loc"] == ["body", "image"]
        assert ALT not in answer.text and "sel-gone" not in answer.text
    assert backend.job_starts() == started


@ON_SERVICE_LOOP
async def test_a_job_of_an_image_runs_in_it_with_its_defaults(
    api: tuple[httpx.AsyncClient, Recording], caplog: pytest.LogCaptureFixture
) -> None:
    client, backend = api
    caplog.set_level("INFO", logger="service.events")
    answer = await client.post("/execute", json={"script": "print(1)", "image": "alt"})
    view = answer.json()
    assert (answer.status_code, view["status"], view["image"]) == (200, "succeeded", "alt"), view
    spec = backend.specs[view["sandbox_id"]]
    assert (spec.image, spec.memory_mb, spec.tmp_mb) == (ALT, 512, 32)
    own = (await client.post("/execute", json={"script": "", "image": "alt", "limits": {"memory_mb": 64}})).json()
    assert backend.specs[own["sandbox_id"]].memory_mb == 64  # the request's own value wins
    plain = (await client.post("/execute", json={"script": "print(1)"})).json()
    assert plain["image"] == "default" and backend.specs[plain["sandbox_id"]].image == "ptc-sandbox-runtime:latest"
    assert (await client.get(f"/jobs/{view['job_id']}")).json()["image"] == "alt"  # kept in the saved view
    ended = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("job ") and "exit_code" in r.getMessage()
    ]
    assert any(view["job_id"] in line and 'image="alt"' in line for line in ended), ended


@ON_SERVICE_LOOP
async def test_each_image_gets_its_own_warm_pool_on_first_use(api: tuple[httpx.AsyncClient, Recording]) -> None:
    client, backend = api

    async def pooled(image: str) -> int:
        ready = [s for s in backend.sandboxes.values() if LABEL_POOL in s.spec.labels and s.spec.image == image]
        return sum(1 for s in ready if s.interpreter is not None)

    async def until_pooled(image: str) -> None:
        for _ in range(500):
            if await pooled(image):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no pooled sandbox of {image}")

    await until_pooled("ptc-sandbox-runtime:latest")
    assert await pooled(ALT) == 0  # no pool before its first use
    first = (await client.post("/execute", json={"script": "print(1)", "image": "alt"})).json()
    assert first["sandbox_start"] == "cold"
    await until_pooled(ALT)  # created by the first use
    second = (await client.post("/execute", json={"script": "print(2)", "image": "alt"})).json()
    assert (second["sandbox_start"], second["image"], second["stdout"]) == ("warm", "alt", "2\n")
    assert backend.specs[second["sandbox_id"]].image == ALT and backend.specs[second["sandbox_id"]].memory_mb == 512
    assert backend.specs[second["sandbox_id"]].labels[LABEL_POOL].startswith("alt-")  # the pool's name: the image's
    default = (await client.post("/execute", json={"script": "print(3)"})).json()
    assert default["sandbox_start"] == "warm" and backend.specs[default["sandbox_id"]].image != ALT


@ON_SERVICE_LOOP
async def test_a_session_keeps_its_image(api: tuple[httpx.AsyncClient, Recording]) -> None:
    client, backend = api
    created = await client.post("/sessions", json={"image": "alt"})
    assert created.status_code == 201, created.text
    session = created.json()
    assert session["image"] == "alt" and session["limits"]["memory_mb"] == 512
    assert backend.specs[session["sandbox_id"]].image == ALT
    assert (await client.get(f"/sessions/{session['session_id']}")).json()["image"] == "alt"
    for body in ({}, {"image": "alt"}):
        view = (
            await client.post("/execute", json={"script": "print(1)", "session_id": session["session_id"], **body})
        ).json()
        assert (view["status"], view["image"], view["sandbox_start"]) == ("succeeded", "alt", "session"), view
        assert view["sandbox_id"] == session["sandbox_id"]
        assert view["error"] is None
    other = await client.post("/execute", json={"script": "1", "session_id": session["session_id"], "image": "default"})
    assert other.status_code == 422 and other.json()["errors"][0]["loc"] == ["body", "image"], other.text
    plain = (await client.post("/sessions", json={})).json()
    assert plain["image"] == "default"


@ON_SERVICE_LOOP
async def test_an_offered_image_that_is_missing_is_a_503_naming_it(api: tuple[httpx.AsyncClient, Recording]) -> None:
    client, backend = api
    started = backend.job_starts()
    for path, body in (("/execute", {"script": "print(1)", "image": "gone"}), ("/sessions", {"image": "gone"})):
        answer = await client.post(path, json=body)
        assert answer.status_code == 503, answer.text
        assert answer.json()["type"].endswith("/sandbox-failure") and "'gone'" in answer.json()["detail"]
        assert "sel-gone" not in answer.text
    assert backend.job_starts() == started
    ready = await client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["missing_images"] == ["gone"], ready.text
    assert "sel-gone" not in ready.text


@ON_SERVICE_LOOP
@pytest.mark.parametrize(
    "api",
    [
        {
            "ptc-sandbox-runtime:latest": RUNTIME_LABELS,
            ALT: RUNTIME_LABELS,
            "ptc-sandbox-runtime:sel-gone": RUNTIME_LABELS,
        }
    ],
    indirect=True,
)
async def test_readyz_lists_the_names_when_every_image_is_present(api: tuple[httpx.AsyncClient, Recording]) -> None:
    client, _ = api
    ready = await client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["images"] == ["alt", "default", "gone"]
