"""A live matplotlib chart of the running %%distributed cell's rank-0 metrics, for the course notebooks.

    live = LiveCurve(["loss"])   # in a kernel cell: shows an empty chart and starts watching
    # ... a %%distributed cell that calls nbdist.report(loss=...) ...
    live.stop()                  # draws the last state and stops the watcher

It runs in the notebook kernel (not on the ranks): a background thread reads
`nbdist.last_metrics()` -- the history the progress widget is built from -- once a
second and redraws a PNG into an ipywidgets.Image, so the chart moves while the
training cell runs. Only nbdist's public API is used.
"""
from __future__ import annotations

import io
import threading

import ipywidgets
import nbdist
from IPython.display import display
from matplotlib.figure import Figure


def _key(rows: list[dict]) -> tuple:
    """Identifies a history without comparing its values (NaN != NaN)."""
    return (len(rows), rows[-1].get("step"), rows[-1].get("time")) if rows else (0,)


class LiveCurve:
    """Redraws rank 0's reported metrics (against step, or time) while a cell trains."""

    def __init__(self, metrics: list[str], x: str = "step", interval_s: float = 1.0,
                 size: tuple[float, float] = (8, 3)):
        self.metrics, self.x, self.interval_s, self.size = list(metrics), x, interval_s, size
        self.image = ipywidgets.Image(format="png")
        self._before = _key(self._rows())  # the previous cell's history, not the one to draw
        self._stop = threading.Event()
        self._drawn = -1
        self.frames = 0  # charts drawn from the running cell's history (the final one included)
        display(self.image)
        self._draw([])
        self._thread = threading.Thread(target=self._watch, name="LiveCurve", daemon=True)
        self._thread.start()

    def _rows(self) -> list[dict]:
        table = nbdist.last_metrics()
        return table.to_dict("records") if hasattr(table, "to_dict") else list(table)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                rows = self._rows()
                if _key(rows) != self._before and len(rows) != self._drawn:
                    self._draw(rows)
                    self.frames += 1
            except Exception as exc:  # a chart must never disturb training
                self.image.description = f"live chart stopped: {exc!r}"
                return

    def _draw(self, rows: list[dict]) -> None:
        fig = Figure(figsize=self.size, dpi=80)
        axes = fig.subplots(1, len(self.metrics), squeeze=False)[0]
        for ax, name in zip(axes, self.metrics):
            pts = [(row[self.x], row[name]) for row in rows
                   if row.get(name) is not None and row.get(name) == row.get(name)]  # skip NaN
            if pts:
                ax.plot(*zip(*pts))
            ax.set_xlabel(self.x)
            ax.set_title(name)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        self.image.value = buf.getvalue()
        self._drawn = len(rows)

    def stop(self) -> int:
        """Stop watching, draw the final state; return how many charts were drawn from the run."""
        self._stop.set()
        self._thread.join(timeout=5)
        rows = self._rows()
        fresh = _key(rows) != self._before
        self._draw(rows if fresh else [])
        self.frames += fresh
        return self.frames
