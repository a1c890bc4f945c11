"""matplotlib backend ``module://ptc_runtime.mpl_backend``: Agg, whose ``show`` saves instead of warning.

Images with matplotlib set ``MPLBACKEND`` to it (sandbox_image/Dockerfile.packages). Rendering is Agg's
(``FigureCanvasAgg``); ``plt.show()`` and ``Figure.show()`` keep the figures open, never block and never warn
(Agg's own ``show`` warns that it cannot show), and ``plt.show()`` saves the open figures into the outputs folder
now (``ptc_runtime.charts.save_figures``). Each figure manager records its creation order (``ptc_order``, from 1
in the script's process), which names the files. Only matplotlib imports this module, when it loads the backend.
"""

from __future__ import annotations

import itertools
from typing import Any

from matplotlib.backend_bases import FigureManagerBase  # type: ignore[import-not-found]
from matplotlib.backends.backend_agg import FigureCanvasAgg  # type: ignore[import-not-found]

from ptc_runtime.charts import save_figures

_ORDER = itertools.count(1)


class FigureManager(FigureManagerBase):  # type: ignore[misc]
    """A figure manager that remembers its creation order and shows nothing."""

    def __init__(self, canvas: Any, num: Any) -> None:
        super().__init__(canvas, num)
        self.ptc_order = next(_ORDER)

    def show(self) -> None:
        """Nothing to show on: the figure is saved when the script shows all or ends."""

    @classmethod
    def pyplot_show(cls, *, block: Any = None) -> None:
        """``plt.show()``: save the open figures now, keep them open."""
        save_figures()


class FigureCanvas(FigureCanvasAgg):  # type: ignore[misc]
    """Agg's canvas with the manager above."""

    manager_class = FigureManager


FigureManagerAgg = FigureManager
