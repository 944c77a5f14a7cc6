"""Rank 0's one-line progress text: how far, how fast, what the metrics say.

Standard library only: `nbdist run` (rank side, a terminal or a log) and the notebook's
text fallback (no widget frontend) draw the same line from here.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence


def format_duration(seconds: float | None) -> str:
    """0:07, 3:25, 1:02:03 — the way tqdm prints times."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(rate: float | None) -> str:
    """Steps per second, or seconds per step when slower than one a second."""
    if not rate or not math.isfinite(rate) or rate <= 0:
        return "? it/s"
    return f"{rate:.3g} it/s" if rate >= 1 else f"{1 / rate:.3g} s/it"


def format_value(value) -> str:
    """A metric value short enough for one line: 4 significant digits."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def format_step(step: int | None, total: int | None) -> str:
    """'120/200 (60%)' or 'step 120' when the total is unknown."""
    if step is None:
        return "no steps reported"
    if total:
        return f"{step}/{total} ({100.0 * min(step, total) / total:.0f}%)"
    return f"step {step}"


def format_text_line(*, step: int | None, total: int | None, elapsed: float | None,
                     rate: float | None, metrics: Mapping | None = None, desc: str | None = None,
                     state: str | None = None, ranks: Sequence[Mapping] | None = None) -> str:
    """One progress line: '[nbdist] epoch 2: 120/200 (60%) 0:07<0:05 16.2 it/s loss=0.123'."""
    parts = ["[nbdist]"]
    if state and state != "running":
        parts.append(state + ":")
    if desc:
        parts.append(f"{desc}:")
    parts.append(format_step(step, total))
    eta = _eta(step, total, rate) if state in (None, "running") else None
    timing = format_duration(elapsed)
    if eta is not None:
        timing += "<" + format_duration(eta)
    parts.append(timing)
    parts.append(format_rate(rate))
    for name, value in (metrics or {}).items():
        parts.append(f"{name}={format_value(value)}")
    if ranks and len(ranks) > 1:
        parts.append("| ranks " + " ".join(_rank_word(r) for r in ranks))
    return " ".join(parts)


def _rank_word(rank: Mapping) -> str:
    step = "-" if rank.get("step") is None else str(rank["step"])
    state = rank.get("state", "running")
    return f"{rank['rank']}:{step}" + ("" if state == "running" else f"({state})")


def _eta(step, total, rate) -> float | None:
    if not total or step is None or not rate or rate <= 0:
        return None
    return max(total - step, 0) / rate


def eta_seconds(step: int | None, total: int | None, rate: float | None) -> float | None:
    """Seconds left at the current rate, or None when it cannot be known."""
    return _eta(step, total, rate)
