"""``ptc_runtime.charts`` and ``ptc_runtime.session.preload`` without an engine or matplotlib: a stand-in
``matplotlib.pyplot`` (its ``Gcf`` list of figure managers, figures whose ``savefig`` writes a few bytes) shows which
figures are saved under which names, that a symlink or a FIFO planted by the script is not followed or waited on,
and that the caps hold; the real library and image are tested in tests/integration/test_data_image.py."""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sandbox_image"))  # the runtime, as in the image

from ptc_runtime import charts
from ptc_runtime.session import preload


class FakeFigure:
    def __init__(self, width_in: float = 4.0, height_in: float = 3.0, dpi: float = 100.0, delay_s: float = 0) -> None:
        self.size = (width_in, height_in)
        self.dpi = dpi
        self.stale = True
        self.delay_s = delay_s
        self.saves = 0

    def get_size_inches(self) -> Any:
        class Size(tuple[float, float]):
            def __mul__(self, k: Any) -> Any:  # as numpy's array times the dpi
                return (self[0] * k, self[1] * k)

        return Size(self.size)

    def savefig(self, f: IO[bytes], format: str, dpi: float | None = None) -> None:
        assert format == "png"
        self.saved_dpi = dpi
        time.sleep(self.delay_s)
        f.write(b"PNG %d" % id(self))
        self.stale = False
        self.saves += 1


class FakeManager:
    def __init__(self, figure: FakeFigure, order: int | None) -> None:
        self.canvas = types.SimpleNamespace(figure=figure)
        if order is not None:
            self.ptc_order = order


@pytest.fixture
def managers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeManager]]:
    """pyplot's open figure managers (a list the test fills), outputs under tmp_path, nothing saved yet."""
    held: list[FakeManager] = []
    pyplot = types.ModuleType("matplotlib.pyplot")
    gcf = types.SimpleNamespace(get_all_fig_managers=lambda: list(held))
    pyplot._pylab_helpers = types.SimpleNamespace(Gcf=gcf)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    monkeypatch.setattr(charts, "OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.setattr(charts, "_saved", {})
    yield held


def test_nothing_happens_without_pyplot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "matplotlib.pyplot", raising=False)
    monkeypatch.setattr(charts, "OUTPUTS", str(tmp_path / "outputs"))
    assert charts.save_figures() == []
    assert not (tmp_path / "outputs").exists()
    assert "matplotlib" not in sys.modules  # never imported by the runtime


def test_figures_are_named_by_creation_order_and_saved_again_only_when_changed(
    managers: list[FakeManager], tmp_path: Path
) -> None:
    first, second = FakeFigure(), FakeFigure()
    managers += [FakeManager(second, 3), FakeManager(first, 1)]  # pyplot's list order is not creation order
    assert charts.save_figures() == ["figure-1.png", "figure-3.png"]
    assert (tmp_path / "outputs" / "figure-1.png").read_bytes() == b"PNG %d" % id(first)
    assert charts.save_figures() == []  # nothing changed since
    first.stale = True
    assert charts.save_figures() == ["figure-1.png"]
    assert (first.saves, second.saves) == (2, 1)


def test_under_another_backend_figures_are_numbered_by_position(managers: list[FakeManager]) -> None:
    managers += [FakeManager(FakeFigure(), None), FakeManager(FakeFigure(), None)]
    assert charts.save_figures() == ["figure-1.png", "figure-2.png"]


def test_a_symlinked_outputs_folder_is_not_followed(
    managers: list[FakeManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "outputs").symlink_to(elsewhere)
    managers.append(FakeManager(FakeFigure(), 1))
    assert charts.save_figures() == []
    assert list(elsewhere.iterdir()) == []
    assert "figures not saved" in capsys.readouterr().err


def test_a_symlink_or_fifo_under_a_figure_name_is_neither_followed_nor_waited_on(
    managers: list[FakeManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    (outputs / "figure-1.png").symlink_to(target)
    os.mkfifo(outputs / "figure-2.png")  # opened for writing without a reader: would block without O_NONBLOCK
    (outputs / "figure-3.png").mkdir()
    managers += [FakeManager(FakeFigure(), n) for n in (1, 2, 3, 4)]
    assert charts.save_figures() == ["figure-4.png"]
    assert target.read_bytes() == b"kept"
    err = capsys.readouterr().err
    assert all(f"figure-{n}.png not saved" in err for n in (1, 2, 3)), err


def test_a_figure_file_left_by_an_earlier_script_is_overwritten(managers: list[FakeManager], tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "figure-1.png").write_bytes(b"x" * 10_000)
    figure = FakeFigure()
    managers.append(FakeManager(figure, 1))
    charts.save_figures()
    assert (outputs / "figure-1.png").read_bytes() == b"PNG %d" % id(figure)


def test_caps_on_count_pixels_and_time(
    managers: list[FakeManager], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    managers += [FakeManager(FakeFigure(), n) for n in range(1, charts.MAX_FIGURES + 3)]
    managers.append(FakeManager(FakeFigure(100, 100, 100), 100))  # 10,000 x 10,000 pixels
    saved = charts.save_figures()
    assert saved == [f"figure-{n}.png" for n in range(1, charts.MAX_FIGURES + 1)]
    assert f"only the first {charts.MAX_FIGURES} saved" in capsys.readouterr().err
    managers.clear()
    managers += [FakeManager(FakeFigure(100, 100, 100), 1), FakeManager(FakeFigure(), 2)]
    charts.save_figures()
    assert "figure-1.png not saved: 10000 x 10000 pixels" in capsys.readouterr().err
    managers.clear()
    monkeypatch.setattr(charts, "DEADLINE_S", 0.2)
    managers += [FakeManager(FakeFigure(delay_s=5), 1), FakeManager(FakeFigure(), 2)]
    started = time.monotonic()
    assert charts.save_figures() == []
    assert time.monotonic() - started < 4  # bounded by the deadline, not the 5 s save
    assert "saving took over" in capsys.readouterr().err


def test_preload_imports_what_it_can_and_says_what_failed(capsys: pytest.CaptureFixture[str]) -> None:
    assert preload(" json , no_such_module_ptc ,,colorsys") == ["json", "colorsys"]
    assert "preload of no_such_module_ptc failed: ModuleNotFoundError" in capsys.readouterr().err
    assert preload("") == []


class FailingFigure(FakeFigure):
    def savefig(self, f: IO[bytes], format: str, dpi: float | None = None) -> None:
        f.write(b"\x89PNG partial")
        f.flush()
        raise OSError(28, "No space left on device")


def test_a_failed_save_is_said_and_leaves_no_partial_file(
    managers: list[FakeManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    managers += [FakeManager(FailingFigure(), 1), FakeManager(FakeFigure(), 2)]
    assert charts.save_figures() == ["figure-2.png"]
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["figure-2.png"]
    assert "figure-1.png not saved: OSError: [Errno 28] No space left on device" in capsys.readouterr().err


def test_the_pixel_cap_counts_at_the_dpi_figures_are_saved_at(
    managers: list[FakeManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rcParams["savefig.dpi"]`` set by the script decides the saved size: a small figure at 10,000 dpi would
    be 40,000 x 30,000 pixels (4.8 GB of Agg buffer at the script's end), yet passed the check made at the
    figure's own dpi."""
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.rcParams = {"savefig.dpi": 10_000}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    huge, fine = FakeFigure(4, 3, 100), FakeFigure(0.2, 0.2, 100)
    managers += [FakeManager(huge, 1), FakeManager(fine, 2)]
    assert charts.save_figures() == ["figure-2.png"]
    assert huge.saves == 0 and fine.saved_dpi == 10_000
    assert "figure-1.png not saved: 40000 x 30000 pixels" in capsys.readouterr().err
    matplotlib.rcParams = {"savefig.dpi": "figure"}  # type: ignore[attr-defined]
    fine.stale = True
    assert charts.save_figures() == ["figure-1.png", "figure-2.png"]
    assert huge.saved_dpi == 100


def test_the_pixel_cap_counts_the_tight_box_when_figures_are_saved_tight(
    managers: list[FakeManager], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``savefig.bbox`` "tight" saves the box of what a figure draws: one text far outside the axes made a 4 x 3
    inch figure as large as Agg allows (measured: the script that had ended well was OOM-killed at 1 GiB)."""
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.rcParams = {"savefig.bbox": "tight", "savefig.pad_inches": 0.1}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    far, near = FakeFigure(4, 3, 100), FakeFigure(4, 3, 100)
    for figure, inches in ((far, 600.0), (near, 3.8)):
        box = types.SimpleNamespace(width=inches, height=inches)
        figure.canvas = types.SimpleNamespace(get_renderer=lambda: None)  # type: ignore[attr-defined]
        figure.get_tightbbox = lambda renderer, box=box: box  # type: ignore[attr-defined]
    managers += [FakeManager(far, 1), FakeManager(near, 2)]
    assert charts.save_figures() == ["figure-2.png"]
    assert far.saves == 0
    assert "figure-1.png not saved: 60020 x 60020 pixels" in capsys.readouterr().err
