"""Pure formatting for the progress view: inline-SVG sparklines and the widget's HTML.

No ipywidgets here: the widget, the text fallback and the saved-notebook snapshot share
one way of saying "how far, how fast, what the loss does". The one-line text form lives
with the rank side (nbdist.rank.textline), which `nbdist run` uses too.

Why inline SVG in HTML for the live chart: an ipywidgets.HTML value is plain widget state, so
it is saved with the notebook (nbclient's store_widget_state, JupyterLab's "save widget
state") and drawn again by any widget renderer with no extra labextension; the same markup is
also used as the text/html snapshot of the cell's final output, which GitHub, nbviewer and
nbconvert show even where widgets are not rendered. A plotting library (matplotlib in an
Output widget, bqplot, plotly) would need PNG re-encoding per update or its own frontend
extension.
"""
from __future__ import annotations

import html
import math
from typing import Iterable, Mapping, Sequence

from ..rank.textline import (  # noqa: F401  (re-exported: the view formats with these too)
    eta_seconds, format_duration, format_rate, format_step, format_text_line, format_value)

STATE_COLOURS = {
    "running": "#1f6fb2",
    "done": "#2e7d32",
    "failed": "#c62828",
    "interrupted": "#ef6c00",
    "timeout": "#ef6c00",
    "stopped": "#757575",
    "waiting": "#757575",
}
SPARK_POINTS = 120  # points drawn per sparkline: enough for a trend, small widget state


def downsample(values: Sequence[float], points: int = SPARK_POINTS) -> list[float]:
    """At most `points` values, evenly spaced, the last value always kept."""
    n = len(values)
    if n <= points:
        return list(values)
    stride = (n - 1) / (points - 1)
    return [values[round(i * stride)] for i in range(points)]


def sparkline_svg(values: Iterable, width: int = 180, height: int = 34,
                  colour: str = "#1f6fb2") -> str:
    """An inline SVG polyline of the finite numbers in `values` (empty string if fewer than 2)."""
    ys = [float(v) for v in values if _is_number(v) and math.isfinite(float(v))]
    ys = downsample(ys)
    if len(ys) < 2:
        return ""
    log_scale = use_log_scale(ys)
    if log_scale:  # a loss falling over many decades would draw a flat line after its first drop
        ys = [math.log10(y) for y in ys]
    low, high = min(ys), max(ys)
    span = (high - low) or 1.0
    pad = 3
    step_x = (width - 2 * pad) / (len(ys) - 1)
    coords = " ".join(
        f"{pad + i * step_x:.1f},{pad + (height - 2 * pad) * (1 - (y - low) / span):.1f}"
        for i, y in enumerate(ys))
    last_x, last_y = coords.rsplit(" ", 1)[-1].split(",")
    return (f'<svg class="nbdist-spark{" nbdist-log" if log_scale else ""}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'
            f'<circle cx="{last_x}" cy="{last_y}" r="2.2" fill="{colour}"/></svg>')


def use_log_scale(values: Sequence[float]) -> bool:
    """Log scale when every value is positive and they span more than two decades."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > 100.0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def events_html(events: Sequence[str], last: int = 3) -> str:
    """The elastic run's latest events (rank lost, resized, resumed) under the status line."""
    lines = "".join(f'<div class="nbdist-event">{html.escape(e)}</div>' for e in events[-last:])
    return f'<div style="font-family:monospace;color:#b35900">{lines}</div>'


def status_html(*, state: str, step: int | None, total: int | None, elapsed: float | None,
                rate: float | None, desc: str | None, failed_rank: int | None = None) -> str:
    """The line beside the bar: state, step/total, elapsed<ETA, rate."""
    colour = STATE_COLOURS.get(state, "#333")
    label = state
    if state == "failed" and failed_rank is not None:
        label = f"failed on rank {failed_rank}"
    eta = eta_seconds(step, total, rate) if state == "running" else None
    timing = format_duration(elapsed) + (f" &lt; {format_duration(eta)}" if eta is not None else "")
    bits = [f'<b class="nbdist-state" data-state="{html.escape(state)}" '
            f'style="color:{colour}">{html.escape(label)}</b>']
    if desc:
        bits.append(html.escape(str(desc)))
    bits.append(f'<span class="nbdist-steps">{html.escape(format_step(step, total))}</span>')
    bits.append(f'<span class="nbdist-time">{timing}</span>')
    bits.append(f'<span class="nbdist-rate">{html.escape(format_rate(rate))}</span>')
    return '<span style="font-family:monospace">' + " &middot; ".join(bits) + "</span>"


def metrics_html(latest: Mapping, history: Mapping[str, Sequence]) -> str:
    """A table: metric name, rank 0's latest value, a sparkline of its history, min–max."""
    if not latest:
        return '<div class="nbdist-metrics" style="color:#757575">no metrics reported yet</div>'
    rows = []
    for name, value in latest.items():
        series = [v for v in history.get(name, ()) if _is_number(v)]
        spark = sparkline_svg(series)
        finite = [float(v) for v in series if math.isfinite(float(v))]
        span = f"{format_value(min(finite))} – {format_value(max(finite))}" if finite else ""
        if finite and use_log_scale(finite):
            span += " (log scale)"
        rows.append(
            f'<tr class="nbdist-metric" data-metric="{html.escape(str(name))}">'
            f'<td style="padding:0 8px 0 0"><b>{html.escape(str(name))}</b></td>'
            f'<td class="nbdist-value" style="padding:0 8px;text-align:right">'
            f'{html.escape(format_value(value))}</td>'
            f'<td style="padding:0 8px">{spark}</td>'
            f'<td style="padding:0 8px;color:#757575">{html.escape(span)}</td></tr>')
    return ('<table class="nbdist-metrics" style="font-family:monospace;border-collapse:collapse">'
            '<tr style="color:#757575"><td>rank 0</td><td style="padding:0 8px">latest</td>'
            '<td style="padding:0 8px">history</td><td style="padding:0 8px">range</td></tr>'
            + "".join(rows) + "</table>")


def ranks_html(ranks: Sequence[Mapping]) -> str:
    """One chip per rank: 'rank 1 · 118 · running', coloured by state; laggards flagged."""
    steps = [r["step"] for r in ranks if r.get("step") is not None]
    lead = max(steps) if steps else None
    chips = []
    for r in ranks:
        state = r.get("state", "running")
        colour = STATE_COLOURS.get(state, "#333")
        step = r.get("step")
        behind = ""
        if state == "running" and lead and step is not None and lead - step >= max(2, lead // 10):
            behind = f" (-{lead - step})"
        chips.append(
            f'<span class="nbdist-rank" data-rank="{r["rank"]}" data-state="{html.escape(state)}" '
            f'style="display:inline-block;margin:1px 4px 1px 0;padding:0 6px;border-radius:8px;'
            f'border:1px solid {colour};color:{colour};font-family:monospace;font-size:90%">'
            f'rank {r["rank"]} &middot; {"-" if step is None else step}{behind} &middot; '
            f'{html.escape(state)}</span>')
    return '<div class="nbdist-ranks">' + "".join(chips) + "</div>"


def snapshot_html(status: str, metrics: str, ranks: str, fraction: float, state: str) -> str:
    """A static copy of the whole widget, stored as the output's text/html for non-widget viewers."""
    colour = STATE_COLOURS.get(state, "#333")
    pct = max(0.0, min(1.0, fraction)) * 100
    bar = (f'<div style="width:360px;height:10px;background:#e0e0e0;border-radius:3px;margin:4px 0">'
           f'<div style="width:{pct:.1f}%;height:10px;background:{colour};border-radius:3px"></div></div>')
    return f'<div class="nbdist-progress">{status}{bar}{metrics}{ranks}</div>'
