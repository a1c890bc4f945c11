"""Charts: the matplotlib figures a script leaves open (or shows) saved as PNG files into the outputs folder.

Standard library only; matplotlib is never imported here. ``save_figures`` does something only when
``matplotlib.pyplot`` is already in ``sys.modules`` (the script imported it, or the image preloads it: then a
script that made no figure costs one lookup). It runs in the script's own process, as the sandbox user (10001),
at two moments:

- ``plt.show()`` under the image's backend ``module://ptc_runtime.mpl_backend`` (``MPLBACKEND`` in an image with
  matplotlib): a no-op that keeps the figures open and saves them now, so that a script that closes a figure after
  showing it still hands it back; no warning, nothing blocks;
- the script's end (``ptc_runtime.__main__.exit_fast``: a normal end, ``sys.exit`` or an uncaught exception),
  before the ``atexit`` handlers (pyplot's closes every figure). Not after SIGKILL, the job's timeout, the OOM
  killer or ``os._exit``: the process is gone before it could.

Each open figure (``Gcf``, pyplot's list) is written as ``OUTPUTS/figure-<n>.png``, n its place in the order pyplot
created the script's figures (1 = the first; a figure closed before any save leaves its number unused). A figure
already saved and not changed since (``Figure.stale`` false) is not written again. The files count against the
sandbox's ``/tmp`` (tmpfs) like any file: a save that fails (``/tmp`` full: ``No space left on device``) is said on
stderr and leaves no partial file. Bounds: at most ``MAX_FIGURES`` figures of at most ``MAX_PIXELS`` pixels each
(at the dpi they are saved at: ``savefig.dpi``), within ``DEADLINE_S`` in all (a timer interrupts a longer save;
the job's own timeout bounds the rest); what is skipped is said on stderr, never silently.

The folder is opened without following a symlink (``O_NOFOLLOW``) and each file is created in it relative to that
descriptor, again without following one, and only if it is a regular file (``O_NONBLOCK``: a FIFO planted under the
file's name fails at once instead of blocking): a script that replaced ``outputs`` or a figure's name with a symlink
or a FIFO gets a message, not a write elsewhere. This is tidiness, not a boundary: the saving runs with the script's
own rights and can only write what the script itself could.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
from typing import Any, Dict, List, Optional, Tuple

OUTPUTS = "/tmp/outputs"
"""The outputs folder (``outputs/`` under the script's working directory), collected when the script ends."""
MAX_FIGURES = 20
"""Figures saved per script at most; the others are named on stderr."""
MAX_PIXELS = 25_000_000
"""Largest figure saved (width x height in pixels at its dpi): 5,000 x 5,000."""
DEADLINE_S = 10.0
"""Time all the saving of one call may take (seconds)."""

_saved: Dict[int, Any] = {}  # id(figure) -> the figure (kept alive: ids are not reused) for figures written


class _Deadline(Exception):
    """Raised by the timer when saving takes longer than ``DEADLINE_S``."""


def _note(text: str) -> None:
    try:
        sys.stderr.write("ptc_runtime: %s\n" % text)
    except Exception:
        pass


def _open_figures(pyplot: Any) -> List[Tuple[int, Any]]:
    """(n, figure) of every figure pyplot holds open, in creation order."""
    managers = list(pyplot._pylab_helpers.Gcf.get_all_fig_managers())
    numbered = []
    for position, manager in enumerate(managers):
        order = getattr(manager, "ptc_order", None)  # set by ptc_runtime.mpl_backend; absent under another backend
        key = order if isinstance(order, int) else 1_000_000 + position
        numbered.append((key, manager.canvas.figure))
    numbered.sort(key=lambda item: item[0])
    if all(key < 1_000_000 for key, _ in numbered):
        return numbered
    return [(index + 1, figure) for index, (_, figure) in enumerate(numbered)]  # another backend: 1..k by position


def _open_file(folder: int, name: str) -> Optional[int]:
    """A descriptor for writing ``name`` in the folder ``folder``, or None (said on stderr) when that name is not a
    regular file or new (a symlink, a FIFO, a directory)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o644, dir_fd=folder)
    except OSError as exc:
        _note("%s not saved: %s" % (name, exc.strerror))
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _note("%s not saved: not a regular file" % name)
        return None
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return fd


def _open_outputs() -> Optional[int]:
    """The outputs folder opened (made when missing), not through a symlink; None (said on stderr) otherwise."""
    try:
        os.mkdir(OUTPUTS, 0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        _note("figures not saved: cannot make %s: %s" % (OUTPUTS, exc.strerror))
        return None
    try:
        return os.open(OUTPUTS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        _note("figures not saved: %s is not a folder: %s" % (OUTPUTS, exc.strerror))
        return None


def _remove(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def _save_dpi(fig: Any) -> float:
    """The dpi ``fig`` is saved at: ``rcParams["savefig.dpi"]`` when the script set a number there (else the figure's
    own), so that ``MAX_PIXELS`` bounds what is drawn (a 4 x 3 inch figure with ``savefig.dpi`` 10,000 is 1.2
    billion pixels: gigabytes of Agg buffer at the script's end), and ``savefig`` is given it explicitly."""
    wanted: Any = None
    try:
        wanted = sys.modules["matplotlib"].rcParams["savefig.dpi"]
    except Exception:
        pass
    if isinstance(wanted, (int, float)) and not isinstance(wanted, bool) and wanted > 0:
        return float(wanted)
    return float(fig.dpi)


def _saved_size(fig: Any, dpi: float) -> Tuple[float, float]:
    """(width, height) in pixels of ``fig`` saved at ``dpi``: with ``rcParams["savefig.bbox"] = "tight"`` the box
    of what it draws (plus ``savefig.pad_inches``), which one text far outside the axes makes as large as Agg allows
    (measured: 1 GiB OOM-killed the script that had ended well), else the figure's size."""
    width, height = fig.get_size_inches() * dpi
    params = getattr(sys.modules.get("matplotlib"), "rcParams", None)
    if params is None or params.get("savefig.bbox") != "tight":
        return width, height
    tight = fig.get_tightbbox(fig.canvas.get_renderer())
    pad = params.get("savefig.pad_inches")
    pad = pad if isinstance(pad, (int, float)) and not isinstance(pad, bool) else 0.1
    return (tight.width + 2 * pad) * dpi, (tight.height + 2 * pad) * dpi


def _alarm(signum: int, frame: Any) -> None:
    raise _Deadline()


def save_figures() -> List[str]:
    """Save the open pyplot figures (see the module's description); returns the file names written.

    Never raises (a figure that fails to save is said on stderr); does nothing when ``matplotlib.pyplot`` was not
    imported."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    try:
        figures = _open_figures(pyplot)
    except Exception as exc:
        _note("figures not saved: %s" % type(exc).__name__)
        return []
    pending = [(n, fig) for n, fig in figures if id(fig) not in _saved or getattr(fig, "stale", True)]
    if not pending:
        return []
    if len(pending) > MAX_FIGURES:
        _note("%d figures open: only the first %d saved" % (len(pending), MAX_FIGURES))
        pending = pending[:MAX_FIGURES]
    folder = _open_outputs()
    if folder is None:
        return []
    written: List[str] = []
    try:
        previous = signal.signal(signal.SIGALRM, _alarm)
    except ValueError:  # not the main thread: no timer, the job's timeout still bounds it
        previous = None
    try:
        if previous is not None:
            signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
        for n, fig in pending:
            name = "figure-%d.png" % n
            try:
                dpi = _save_dpi(fig)
                width, height = _saved_size(fig, dpi)
                if width * height > MAX_PIXELS:
                    _note("%s not saved: %d x %d pixels (at most %d)" % (name, width, height, MAX_PIXELS))
                    continue
                fd = _open_file(folder, name)
                if fd is None:
                    continue
                try:
                    with os.fdopen(fd, "wb") as f:
                        fig.savefig(f, format="png", dpi=dpi)
                except BaseException:
                    _remove(folder, name)  # never a truncated PNG (a full /tmp, the deadline)
                    raise
                _saved[id(fig)] = fig
                written.append(name)
            except _Deadline:
                _note("figures not saved past %s: saving took over %.0f s" % (name, DEADLINE_S))
                break
            except Exception as exc:
                _note("%s not saved: %s: %s" % (name, type(exc).__name__, exc))
    except _Deadline:  # the timer fired between two figures' handlers
        _note("figures not saved: saving took over %.0f s" % DEADLINE_S)
    finally:
        if previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        os.close(folder)
    return written
