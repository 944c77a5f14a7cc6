"""Notebook side of progress: one live view of a `%%distributed` cell, fed by the engines' metrics.

The %%distributed wait loop calls::

    view = nbdist.notebook.progress_view.attach(async_result, n_ranks=N, widgets=not args.no_widgets)
    view.poll()                          # every ~0.1-0.2 s while the cell runs
    view.finish(state, failed_rank=None) # state: "done" | "failed" | "interrupted" | "timeout"

`async_result.data` holds, per engine, what nbdist.rank.report published through ipyparallel's
datapub (the engine's IOPub): the rank's latest state and rank 0's history points. RunState
turns those into the view model (rank 0 headline, rate, ETA, per-rank steps and states);
WidgetView draws it as one ipywidgets widget, TextView as a progress line. The last run stays
in this module for `nbdist.last_metrics()`.
"""
from __future__ import annotations

import sys
import time
import warnings
from collections import deque
from typing import Any, Mapping, Sequence

from . import progress_render as render
from ..common.config import env_flag
from ..rank.report import text_interval
from ..wire import HISTORY_PREFIX, STATE_KEY

RATE_WINDOW_S = 10.0  # rate and ETA follow the last 10 s of rank 0's steps
FINAL_STATES = ("done", "failed", "interrupted", "timeout")


class RunState:
    """The run as the view shows it, aggregated from every engine's published data."""

    def __init__(self, n_ranks: int, clock=time.monotonic, ranks: Sequence[int] | None = None):
        self.n_ranks = n_ranks
        self._clock = clock
        self.started = clock()
        self.ended: float | None = None
        self.state = "running"
        self.failed_rank: int | None = None
        # One row per engine of the AsyncResult, in its order; "rank" is what the engine
        # publishes (engine i is rank i on a full cluster, not with --targets 1,3).
        labels = list(ranks) if ranks is not None else list(range(n_ranks))
        self.ranks = [{"rank": r, "step": None, "total": None, "state": "running"} for r in labels]
        self.step: int | None = None
        self.total: int | None = None
        self.desc: str | None = None
        self.metrics: dict = {}
        self.history: list[tuple[float, int, dict]] = []  # rank 0's points, in order
        self.series: dict[str, list] = {}  # per metric, its values in history order
        # per engine: the index of its next history key (after an elastic resize another
        # engine is rank 0, and its history keys count from its own first point)
        self._next_points: dict[int, int] = {}
        self.events: list[str] = []  # elastic events: rank lost, resized, resumed (in order)
        self.lost: set[int] = set()  # engines (indices) an elastic run lost: their data is stale
        self._rate_samples: deque = deque()

    # ---- ingest -------------------------------------------------------------------------
    def ingest(self, per_engine: Sequence[Mapping]) -> bool:
        """Fold in the engines' published data (AsyncResult.data); True if anything changed."""
        changed = False
        for index, data in enumerate(per_engine):
            if not data or index in self.lost:
                continue
            state = data.get(STATE_KEY)
            if not state:
                continue
            if index >= len(self.ranks):
                continue
            row = self.ranks[index]
            rank = state.get("rank")
            if isinstance(rank, int):
                row["rank"] = rank
            if row["step"] != state.get("step") or row["total"] != state.get("total"):
                row["step"], row["total"] = state.get("step"), state.get("total")
                changed = True
            if rank == 0:  # only rank 0 publishes metrics: it is the headline
                changed |= self._ingest_headline(state, data, index)
        return changed

    def _ingest_headline(self, state: Mapping, data: Mapping, index: int = 0) -> bool:
        changed = False
        now = state.get("time")
        step = state.get("step")
        if step != self.step:
            if self.step is not None and step is not None and step < self.step:
                self._rate_samples.clear()  # a new progress() loop restarted the count
            self.step = step
            changed = True
            if now is not None and step is not None:
                self._rate_samples.append((now, step))
                while len(self._rate_samples) > 2 and now - self._rate_samples[0][0] > RATE_WINDOW_S:
                    self._rate_samples.popleft()
        self.total = state.get("total")
        self.desc = state.get("desc")
        metrics = state.get("metrics")
        if metrics and metrics != self.metrics:
            self.metrics = dict(metrics)
            changed = True
        # History points live under their own keys (nothing is overwritten between polls).
        while True:
            point = data.get(HISTORY_PREFIX + str(self._next_points.get(index, 0)))
            if point is None:
                break
            self._add_point(point)
            self._next_points[index] = self._next_points.get(index, 0) + 1
            changed = True
        return changed

    def _add_point(self, point) -> None:
        t, step, values = point
        self.history.append((t, step, values))
        for name in values:
            self.series.setdefault(name, [])
        for name, series in self.series.items():
            if name in values:
                series.append(values[name])

    def event(self, text: str, lost_index: int | None = None) -> None:
        """An elastic event (shown under the status line); lost_index: the engine it lost."""
        self.events.append(text)
        if lost_index is not None and lost_index < len(self.ranks):
            self.lost.add(lost_index)
            self.ranks[lost_index]["state"] = "lost"

    def set_engine_status(self, statuses: Sequence[str | None]) -> None:
        """Per-engine completion from the AsyncResult: None (running), 'ok', 'error'."""
        for index, status in enumerate(statuses):
            if index in self.lost:
                continue
            if index < len(self.ranks) and status is not None:
                self.ranks[index]["state"] = "done" if status == "ok" else "failed"

    def finish(self, state: str, failed_rank: int | None = None) -> None:
        """The cell ended: mark the run and every rank still running."""
        self.state = state if state in FINAL_STATES else "failed"
        self.failed_rank = failed_rank
        self.ended = self._clock()
        leftover = {"done": "done", "failed": "stopped", "interrupted": "interrupted",
                    "timeout": "timeout"}[self.state]
        for row in self.ranks:
            if row["state"] == "running":
                row["state"] = leftover
        for row in self.ranks:
            if failed_rank is not None and row["rank"] == failed_rank:
                row["state"] = "failed"

    # ---- derived ------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return (self.ended if self.ended is not None else self._clock()) - self.started

    @property
    def rate(self) -> float | None:
        """Rank 0's steps per second over the last RATE_WINDOW_S seconds."""
        if len(self._rate_samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate_samples[0], self._rate_samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    @property
    def eta(self) -> float | None:
        return render.eta_seconds(self.step, self.total, self.rate)

    def fraction(self) -> float:
        """How full the bar is: 1 at success, step/total while running."""
        if self.state == "done":
            return 1.0
        if self.total and self.step is not None:
            return min(1.0, self.step / self.total)
        return 0.0

    def rows(self) -> list[dict]:
        """Rank 0's metric history as rows: step, time (s since its first point), metrics."""
        t0 = self.history[0][0] if self.history else 0.0
        return [{"step": step, "time": round(t - t0, 6), **values} for t, step, values in self.history]

    def text_line(self) -> str:
        line = render.format_text_line(step=self.step, total=self.total, elapsed=self.elapsed,
                                       rate=self.rate, metrics=self.metrics, desc=self.desc,
                                       state=self.state, ranks=self.ranks)
        return line + (f" [{self.events[-1]}]" if self.events else "")


# ---- frontends ------------------------------------------------------------------------------
def widget_frontend(widgets: bool = True) -> bool:
    """Whether to draw a widget: not with --no-widgets; NBDIST_WIDGETS=0/1 decides if set;
    else yes inside an ipykernel kernel (JupyterLab, Notebook, VS Code, nbclient), whose
    frontends speak the comm protocol; no in terminal IPython or plain Python."""
    if not widgets:
        return False
    forced = env_flag("WIDGETS")
    if forced is not None:
        return forced and _have_ipywidgets()
    return _in_kernel() and _have_ipywidgets()


def _in_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return getattr(shell, "kernel", None) is not None


def _have_ipywidgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class WidgetView:
    """One ipywidgets VBox: bar + status line, rank 0's metrics with sparklines, a rank row."""

    RENDER_INTERVAL_S = 0.25  # at most 4 redraws a second: comm traffic, not the poll, sets cost

    def __init__(self, run: RunState):
        import ipywidgets as widgets
        from IPython.display import display

        self.run = run
        self.bar = widgets.IntProgress(value=0, min=0, max=1, bar_style="info",
                                       layout=widgets.Layout(width="360px"))
        self.bar.add_class("nbdist-bar")
        self.status = widgets.HTML()
        self.metrics = widgets.HTML()
        self.ranks = widgets.HTML()
        self.box = widgets.VBox([widgets.HBox([self.bar, self.status]), self.metrics, self.ranks])
        self.box.add_class("nbdist-progress")
        self._last_render = 0.0
        self.render(force=True)
        self.handle = display(self._bundle(final=False), raw=True, display_id=True)

    def _bundle(self, final: bool) -> dict:
        bundle = dict(self.box._repr_mimebundle_())
        bundle["text/plain"] = self.run.text_line()
        if final:
            # For viewers without widgets (GitHub, nbconvert HTML): the final state as HTML.
            bundle["text/html"] = render.snapshot_html(self.status.value, self.metrics.value,
                                                       self.ranks.value, self.run.fraction(),
                                                       self.run.state)
        return bundle

    def render(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_render < self.RENDER_INTERVAL_S:
            return
        self._last_render = now
        run = self.run
        if run.state == "done":
            top = max(run.total or 0, run.step or 0, 1)
            self.bar.max, self.bar.value = top, top
        else:
            top = run.total if run.total else max(run.step or 0, 1)
            self.bar.max = max(top, 1)
            self.bar.value = min(run.step or 0, self.bar.max) if run.total else 0
        self.bar.bar_style = {"running": "info", "done": "success", "failed": "danger"}.get(
            run.state, "warning")
        self.bar.description = ""
        self.status.value = render.status_html(state=run.state, step=run.step, total=run.total,
                                               elapsed=run.elapsed, rate=run.rate, desc=run.desc,
                                               failed_rank=run.failed_rank)
        if run.events:
            self.status.value += render.events_html(run.events)
        self.metrics.value = render.metrics_html(run.metrics, run.series)
        self.ranks.value = render.ranks_html(run.ranks)

    def close(self) -> None:
        self.render(force=True)
        self.handle.update(self._bundle(final=True), raw=True)


class TextView:
    """Rank 0's progress line: a display updated in place in a kernel, '\\r' on a terminal."""

    def __init__(self, run: RunState, stream=None):
        self.run = run
        self.interval = 1.0
        self._last = 0.0
        self.handle = None
        self.stream: Any = None
        if _in_kernel() and stream is None:
            from IPython.display import display

            self.handle = display({"text/plain": run.text_line()}, raw=True, display_id=True)
        else:  # terminal IPython or plain Python: the same pacing as rank 0's line in a script
            self.stream = stream or sys.stderr
            self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
            self.interval = text_interval(self._tty)

    def render(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        line = self.run.text_line()
        if self.handle is not None:
            self.handle.update({"text/plain": line}, raw=True)
        elif self._tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        self.render(force=True)
        if self.handle is None and self._tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- the object the magic drives ------------------------------------------------------------
_last_run: RunState | None = None


class ProgressView:
    """Polls an AsyncResult's published data into a RunState and draws it; never breaks a cell."""

    def __init__(self, async_result, n_ranks: int, widgets: bool = True, stream=None,
                 ranks: Sequence[int] | None = None):
        global _last_run
        self.async_result = async_result
        self.run = RunState(n_ranks, ranks=ranks)
        _last_run = self.run
        self.finished = False
        self._broken = False
        self._shown = False
        self._use_widgets = widget_frontend(widgets) and stream is None
        self._stream = stream
        self.frontend: Any = None

    def _ensure_frontend(self) -> None:
        # Nothing is drawn until the first report arrives: a cell that reports nothing
        # (a plain print, a variable definition) gets no empty progress bar.
        if self.frontend is None:
            self.frontend = WidgetView(self.run) if self._use_widgets else TextView(self.run, self._stream)

    def poll(self) -> None:
        """Read what the engines published since the last poll and redraw (rate-limited)."""
        if self.finished or self._broken:
            return
        try:
            changed = self.run.ingest(_engine_data(self.async_result))
            self.run.set_engine_status(_engine_statuses(self.async_result))
            if changed and not self._shown:
                self._shown = True
                self._ensure_frontend()
            if self.frontend is not None:
                self.frontend.render()
        except Exception as exc:  # a display problem must never fail the user's training cell
            self._broken = True
            warnings.warn(f"nbdist progress view stopped: {exc!r}", RuntimeWarning, stacklevel=2)

    def event(self, text: str, lost_index: int | None = None) -> None:
        """Show an elastic event now (see RunState.event); never fails the cell."""
        try:
            self.run.event(text, lost_index)
            if self.frontend is not None:
                self.frontend.render(force=True)
        except Exception:
            pass

    def finish(self, state: str, failed_rank: int | None = None) -> None:
        """The cell ended (done, failed, interrupted, timeout): draw the final state once."""
        if self.finished:
            return
        self.finished = True
        try:
            # The engines' last publishes (flushed after the cell) precede their idle status;
            # wait briefly for them, never long: a dead engine sends nothing more.
            wait = getattr(self.async_result, "wait_for_output", None)
            if wait is not None:
                wait(1.0 if state == "done" else 0.3)
            changed = self.run.ingest(_engine_data(self.async_result))
            self.run.set_engine_status(_engine_statuses(self.async_result))
            self.run.finish(state, failed_rank)
            if changed or self._shown:
                self._shown = True
                self._ensure_frontend()
            if self.frontend is not None:
                self.frontend.close()
        except Exception as exc:
            warnings.warn(f"nbdist progress view could not show the final state: {exc!r}",
                          RuntimeWarning, stacklevel=2)


def attach(async_result, n_ranks: int, widgets: bool = True,
           ranks: Sequence[int] | None = None) -> ProgressView:
    """Start a progress view for a running %%distributed cell (call poll() often, finish() once).

    `ranks` names the rank of each engine in the AsyncResult (default 0..n_ranks-1); the
    engines' own published ranks replace these labels as soon as they report.
    """
    return ProgressView(async_result, n_ranks, widgets=widgets, ranks=ranks)


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _engine_data(async_result) -> list:
    """Per-engine published data; ipyparallel merges each engine's publishes into one dict."""
    try:
        return _as_list(async_result.data)
    except AttributeError:
        return []


def _engine_statuses(async_result) -> list:
    """Per-engine 'ok' / 'error' once its reply came, None while it runs."""
    try:
        return [md.get("status") for md in _as_list(async_result.metadata)]
    except AttributeError:
        return []


def last_run() -> RunState | None:
    """The most recent %%distributed cell's RunState (None before the first)."""
    return _last_run


def last_metrics() -> Any:
    """The last run's rank-0 metric history: a pandas DataFrame, or a list of dicts without pandas."""
    rows = _last_run.rows() if _last_run is not None else []
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows)
