"""The data image (sandbox_image/build.sh --data): numpy, pandas and matplotlib from every placement, preloaded
modules, charts saved as PNG files into the outputs folder, and the minimal image left as it was.

The image under test is ``PTC_DATA_IMAGE`` (default: the tag ``deploy/local.sh setup`` builds); the minimal one is
``PTC_SANDBOX_IMAGE`` (tests/conftest.py). A service of its own runs with the data image as its sandbox image.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest

from tests.conftest import IMAGE, execute, in_ci, pool_ready, start_service, stop_clean, wait_until

DATA_IMAGE = os.environ.get("PTC_DATA_IMAGE", "ptc-sandbox-data:latest")
PRELOAD = "numpy,pandas,matplotlib,matplotlib.pyplot"
MEMORY_MB = 1024  # pandas and matplotlib need more than the default 256 MiB


def png_size(data: bytes) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk (AssertionError if it is no PNG)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:24]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def figures(api: httpx.Client, view: dict[str, object]) -> dict[str, tuple[int, int]]:
    """The job's output files (its view's ``files``), each downloaded: path -> PNG size; checks bytes and sha256."""
    found = {}
    for entry in view["files"]:  # type: ignore[attr-defined]
        data = api.get(f"/jobs/{view['job_id']}/files/{entry['path']}").raise_for_status().content
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"]), entry
        assert entry["content_type"] == "image/png", entry
        found[entry["path"]] = png_size(data)
    return found


@pytest.fixture(scope="module")
def data_api(engine: docker.DockerClient, scratch: Path) -> Iterator[httpx.Client]:
    """A service whose sandbox image is the data image (warm pool of 1), with 1 GiB sandboxes."""
    try:
        engine.images.get(DATA_IMAGE)
    except docker.errors.ImageNotFound:
        if in_ci():
            pytest.fail(f"no data image {DATA_IMAGE} (deploy/local.sh setup builds it)")
        pytest.skip(f"no data image {DATA_IMAGE} (sandbox_image/build.sh --data)")
    svc = start_service(
        f"pytest-data-{secrets.token_hex(4)}",
        scratch / "data",
        PTC_SANDBOX_IMAGE=DATA_IMAGE,
        PTC_DEFAULT_MEMORY_MB=str(MEMORY_MB),
        PTC_WARM_POOL_SIZE="1",
    )
    try:
        with svc.client(timeout=120) as api:
            yield api
    finally:
        stop_clean(engine, svc)


@pytest.fixture
def data_session(data_api: httpx.Client) -> Iterator[str]:
    response = data_api.post("/sessions", json={"tools": []})
    assert response.status_code == 201, response.text
    sid: str = response.json()["session_id"]
    yield sid
    data_api.delete(f"/sessions/{sid}")


IMPORTS = "import pandas, numpy, matplotlib\nprint(pandas.DataFrame({'a': numpy.arange(4)})['a'].sum())"


def test_data_libraries_import_cold_warm_and_in_a_session(data_api: httpx.Client, data_session: str) -> None:
    cold = execute(data_api, IMPORTS, limits={"memory_mb": MEMORY_MB + 1})  # not the pool's profile: cold
    wait_until(lambda: pool_ready(data_api, "default") >= 1, timeout_s=60)
    warm = execute(data_api, IMPORTS)
    in_session = execute(data_api, IMPORTS, session_id=data_session)
    for view, mode in ((cold, "cold"), (warm, "warm"), (in_session, "session")):
        assert (view["status"], view["stdout"], view["sandbox_start"]) == ("succeeded", "6\n", mode), view


# A Python subprocess importing pyplot (it reads the config folder and font cache the preload made), then everything
# under /tmp (the working directory and HOME: matplotlib's MPLCONFIGDIR is /tmp/.matplotlib) the script cannot write.
MPL_CHILD = """
import os, subprocess, sys
done = subprocess.run([sys.executable, '-c', 'import matplotlib.pyplot'], capture_output=True, text=True)
bad = []
for folder, folders, files in os.walk('/tmp'):
    for path in [folder] + [os.path.join(folder, name) for name in files]:
        if not os.path.islink(path) and not os.access(path, os.W_OK):
            bad.append(path)
print(done.returncode, sorted(bad))
print(done.stderr, file=sys.stderr)
"""


def test_what_the_preload_made_is_the_scripts_to_write(data_api: httpx.Client, data_session: str) -> None:
    """The resident interpreter preloads matplotlib as the script user: its config folder and font cache are the
    scripts', so a Python subprocess importing pyplot neither complains nor rebuilds the font cache (cold, warm
    and in a session); nothing under /tmp is left unwritable."""
    cold = execute(data_api, MPL_CHILD, limits={"memory_mb": MEMORY_MB + 1})
    wait_until(lambda: pool_ready(data_api, "default") >= 1, timeout_s=60)
    warm = execute(data_api, MPL_CHILD)
    in_session = execute(data_api, MPL_CHILD, session_id=data_session)
    for view in (cold, warm, in_session):
        assert (view["status"], view["stdout"]) == ("succeeded", "0 []\n"), view
        assert "not a writable directory" not in view["stderr"] and "font cache" not in view["stderr"], view
    # Every later script of the session too: matplotlib kept the image's folder (it checks it with the real uid,
    # so a preload that changed only the effective uid made it fall back to a temporary folder that the first
    # script's exit removed, and each later script's exit printed a traceback).
    where = "import os\nprint(os.environ.get('MPLCONFIGDIR'))"
    for _ in range(2):
        view = execute(data_api, where, session_id=data_session)
        assert (view["status"], view["stdout"], view["stderr"]) == ("succeeded", "/tmp/.matplotlib\n", ""), view


def test_preloaded_import_is_free_in_a_session(data_api: httpx.Client, data_session: str) -> None:
    script = (
        "import sys, time\nfresh = 'pandas' not in sys.modules\nt = time.perf_counter()\nimport pandas\n"
        "print(fresh, round((time.perf_counter() - t) * 1000, 3))"
    )
    view = execute(data_api, script, session_id=data_session)
    fresh, ms = view["stdout"].split()
    print(f"import pandas in a session of {DATA_IMAGE}: {ms} ms")
    assert fresh == "False"  # imported before the fork
    assert float(ms) < 50  # a dictionary lookup (~0.01 ms); loose: timing is noisy (bench/preload.py measures)


def test_a_script_changes_only_its_own_copy_of_a_preloaded_module(data_api: httpx.Client, data_session: str) -> None:
    first = execute(
        data_api,
        "import pandas, numpy\npandas.set_option('display.max_rows', 3)\nnumpy.leaked = 1\n"
        "numpy.seterr(all='raise')\nprint(pandas.get_option('display.max_rows'))",
        session_id=data_session,
    )
    second = execute(
        data_api,
        "import pandas, numpy\nprint(pandas.get_option('display.max_rows'), hasattr(numpy, 'leaked'),"
        " numpy.geterr()['divide'], float((numpy.ones((300, 300)) @ numpy.ones((300, 300)))[0, 0]))",
        session_id=data_session,
    )
    assert first["stdout"] == "3\n"
    assert second["stdout"] == "60 False warn 300.0\n", second


def test_an_open_figure_is_saved_as_a_png_when_the_script_ends(data_api: httpx.Client, data_session: str) -> None:
    chart = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)\nax.plot([1, 2, 3], [2, 1, 3])\n"
        "plt.figure(figsize=(2, 1), dpi=50)\nplt.show()\nprint('done')\n"
    )
    view = execute(data_api, chart, session_id=data_session)
    assert (view["status"], view["stdout"], view["stderr"]) == ("succeeded", "done\n", ""), view
    assert figures(data_api, view) == {"outputs/figure-1.png": (400, 300), "outputs/figure-2.png": (100, 50)}
    cold = execute(data_api, chart)  # a one-shot job of the data image: the same files
    assert figures(data_api, cold) == {"outputs/figure-1.png": (400, 300), "outputs/figure-2.png": (100, 50)}


def test_figures_are_saved_when_the_script_fails_and_after_show_then_close(
    data_api: httpx.Client, data_session: str
) -> None:
    script = (
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nplt.close('all')\n"  # figure-1 at show
        "plt.figure(figsize=(3, 2), dpi=100)\nraise ValueError('boom')\n"  # figure-2 at the end, despite the error
    )
    view = execute(data_api, script, session_id=data_session)
    assert view["status"] == "failed" and "ValueError: boom" in view["stderr"], view
    sizes = figures(data_api, view)
    assert sorted(sizes) == ["outputs/figure-1.png", "outputs/figure-2.png"], view
    assert sizes["outputs/figure-2.png"] == (300, 200)


def test_a_symlinked_outputs_folder_is_not_followed(data_api: httpx.Client, data_session: str) -> None:
    script = (
        "import os, shutil\nshutil.rmtree('/tmp/outputs', ignore_errors=True)\nos.makedirs('/tmp/elsewhere')\n"
        "os.symlink('/tmp/elsewhere', '/tmp/outputs')\nimport matplotlib.pyplot as plt\nplt.plot([1])\n"
    )
    view = execute(data_api, script, session_id=data_session)
    assert view["status"] == "succeeded" and "figures not saved" in view["stderr"], view
    after = execute(data_api, "import os\nprint(os.listdir('/tmp/elsewhere'))", session_id=data_session)
    assert after["stdout"] == "[]\n"


def test_a_full_tmp_is_said_and_leaves_no_partial_png(data_api: httpx.Client) -> None:
    """Figures count against the sandbox's /tmp (tmpfs) like any file: when it is full the save fails clearly."""
    response = data_api.post("/sessions", json={"tools": [], "limits": {"tmp_mb": 2}})
    assert response.status_code == 201, response.text
    sid = response.json()["session_id"]
    try:
        script = (
            "import matplotlib.pyplot as plt\nplt.plot(range(1000))\ntry:\n"
            "    with open('/tmp/fill', 'wb') as f:\n        f.write(b'x' * (4 << 20))\n"
            "except OSError as exc:\n    print(exc.strerror)\n"
        )
        view = execute(data_api, script, session_id=sid)
        assert view["stdout"] == "No space left on device\n", view
        assert "figure-1.png not saved: OSError: [Errno 28] No space left on device" in view["stderr"], view
        assert view["files"] == [], view  # no partial PNG was left to collect
    finally:
        data_api.delete(f"/sessions/{sid}")


def test_a_huge_savefig_dpi_is_refused_at_the_pixel_cap(data_api: httpx.Client, data_session: str) -> None:
    """``savefig.dpi`` 10,000 on a 4 x 3 inch figure: once checked at the figure's own 100 dpi and drawn at
    40,000 x 30,000 pixels, the script that had ended well was OOM-killed at 1 GiB (measured, runc) with an empty
    figure-1.png listed. Now the cap counts at the dpi the figure is saved at."""
    script = (
        "import matplotlib.pyplot as plt\nplt.rcParams['savefig.dpi'] = 10000\n"
        "plt.figure(figsize=(4, 3))\nplt.plot([1, 2, 3])\nprint('end')\n"
    )
    view = execute(data_api, script, session_id=data_session)
    assert (view["status"], view["stdout"], view["files"]) == ("succeeded", "end\n", []), view
    assert "figure-1.png not saved: 40000 x 30000 pixels" in view["stderr"], view


def test_a_far_text_under_a_tight_bbox_is_refused_at_the_pixel_cap(data_api: httpx.Client, data_session: str) -> None:
    """``savefig.bbox`` "tight" and one text far outside the axes: once, drawn as large as Agg allows and the
    script that had ended well was OOM-killed at 1 GiB. A tight figure of ordinary size is still saved."""
    script = (
        "import matplotlib.pyplot as plt\nplt.rcParams['savefig.bbox'] = 'tight'\nplt.plot([0, 1])\n"
        "plt.xlim(0, 1)\nplt.ylim(0, 1)\nplt.text(100, 100, 'far')\nprint('end')\n"
    )
    view = execute(data_api, script, session_id=data_session)
    assert (view["status"], view["stdout"], view["files"]) == ("succeeded", "end\n", []), view
    assert "figure-1.png not saved: " in view["stderr"] and "(at most 25000000)" in view["stderr"], view
    near = execute(data_api, script.replace("100, 100", "0.5, 0.5"), session_id=data_session)
    assert [f["path"] for f in near["files"]] == ["outputs/figure-1.png"], near


def test_a_script_without_matplotlib_leaves_no_outputs(data_api: httpx.Client) -> None:
    view = execute(data_api, "import os\nprint(os.listdir('/tmp/outputs'))")
    assert (view["stdout"], view["files"]) == ("[]\n", []), view  # the folder is there (empty): no figure saved


def test_the_images_carry_their_preload_lists(engine: docker.DockerClient) -> None:
    data = engine.images.get(DATA_IMAGE).attrs["Config"]
    minimal = engine.images.get(IMAGE).attrs["Config"]
    assert data["Labels"]["io.ptc-sandbox.preload"] == PRELOAD
    assert f"PTC_PRELOAD={PRELOAD}" in data["Env"]
    assert "io.ptc-sandbox.preload" not in (minimal["Labels"] or {})
    assert not [e for e in minimal["Env"] if e.startswith(("PTC_PRELOAD=", "MPL"))]
    probe = "import importlib.util, json, os; print(json.dumps([importlib.util.find_spec(m) is None for m in "
    probe += "('numpy', 'pandas', 'matplotlib')]))"
    out = engine.containers.run(IMAGE, ["-c", probe], entrypoint="python3", network_mode="none", remove=True)
    assert json.loads(out) == [True, True, True]


def test_a_preload_that_fails_is_skipped(engine: docker.DockerClient, scratch: Path) -> None:
    """An image whose PTC_PRELOAD names a module that is not there still serves, with the others preloaded (the
    failure goes to the resident interpreter's stderr: the sandbox's log, which the service does not keep)."""
    tag = f"{DATA_IMAGE.rsplit(':', 1)[0]}:badpreload-{secrets.token_hex(3)}"
    dockerfile = f"FROM {DATA_IMAGE}\nENV PTC_PRELOAD=no_such_module_x,numpy\n".encode()
    engine.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, network_mode="none", rm=True)
    svc = start_service(
        f"pytest-data-{secrets.token_hex(4)}",
        scratch / "data-bad",
        PTC_SANDBOX_IMAGE=tag,
        PTC_DEFAULT_MEMORY_MB=str(MEMORY_MB),
        PTC_WARM_POOL_SIZE="0",
    )
    try:
        with svc.client(timeout=120) as api:
            session = api.post("/sessions", json={"tools": []})
            assert session.status_code == 201, session.text
            sid = session.json()["session_id"]
            view = execute(
                api, "import sys\nprint('numpy' in sys.modules, 'no_such_module_x' in sys.modules)", session_id=sid
            )
            assert view["stdout"] == "True False\n", view
            api.delete(f"/sessions/{sid}")
    finally:
        svc.stop()
        engine.images.remove(tag, force=True)


PANDAS_SCRIPT = """
import pandas as pd
import matplotlib.pyplot as plt
frame = pd.read_csv('data/measurements.csv')
print(repr(float(frame['value'].mean())))
frame[['value']].describe().to_csv('outputs/summary.csv')
fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
frame['value'].plot.hist(ax=ax, bins=40)
fig.savefig('outputs/chart.png')
"""


def test_a_csv_in_pandas_and_a_chart_out(data_api: httpx.Client) -> None:
    """The issue's example on the data image: a 10,000-row CSV in, pandas' mean out, a table and a chart as files
    (the chart saved by the script, and the figure it left open saved by the runtime)."""
    rng = random.Random(15)
    values = [round(rng.uniform(-50, 150), 3) for _ in range(10_000)]
    csv_text = "id,value\n" + "".join(f"{n},{value}\n" for n, value in enumerate(values))
    body = {"script": PANDAS_SCRIPT, "files": [{"path": "data/measurements.csv", "content": csv_text}], "wait_s": 120}
    response = data_api.post("/execute", json=body)
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["status"] == "succeeded", (view["error"], view["stderr"])
    assert float(view["stdout"]) == pytest.approx(sum(values) / len(values), rel=1e-9)
    listed = {entry["path"]: entry for entry in view["files"]}
    assert set(listed) == {"outputs/summary.csv", "outputs/chart.png", "outputs/figure-1.png"}, view["files"]
    table = data_api.get(f"/jobs/{view['job_id']}/files/outputs/summary.csv").raise_for_status().content
    assert (len(table), hashlib.sha256(table).hexdigest()) == (
        listed["outputs/summary.csv"]["bytes"],
        listed["outputs/summary.csv"]["sha256"],
    )
    assert table.decode().splitlines()[1] == "count,10000.0"  # pandas' describe(), as the script wrote it
    sizes = figures(data_api, {**view, "files": [listed["outputs/chart.png"], listed["outputs/figure-1.png"]]})
    assert sizes == {"outputs/chart.png": (600, 400), "outputs/figure-1.png": (600, 400)}
