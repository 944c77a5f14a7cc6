"""One failure model for the notebook's cell loop and `nbdist run`: which rank caused a failure,
which errors merely followed from it, and the report the user reads (cause first).

No IPython and no ipyparallel here: the cell loop and the batch launcher collect each
rank's error and hand them to this module; ranks use it to decide whether to abort peers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes."""
    return _ANSI.sub("", text)


def rank_ranges(ranks: list[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


@dataclass
class RankError:
    """One rank's error in a failed cell or run."""
    rank: int
    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)
    follow_on: bool = False


@dataclass
class FailureReport:
    """The whole story of a failed cell: the cause first, then what followed."""
    headline: str
    primary: RankError | None = None
    others: list[RankError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self, color: bool = True) -> list[str]:
        red, bold, dim, reset = ("\x1b[1;31m", "\x1b[1m", "\x1b[2m", "\x1b[0m") if color else ("",) * 4
        out = [f"{red}nbdist: {self.headline}{reset}"]
        if self.primary is not None:
            out.append(f"{bold}--- traceback of rank {self.primary.rank} ---{reset}")
            tb = self.primary.traceback or [f"{self.primary.ename}: {self.primary.evalue}"]
            out.extend(tb if color else [strip_ansi(line) for line in tb])
        if self.others:
            out.append(f"{bold}--- {'the other ranks' if self.primary is not None else 'the ranks'} ---{reset}")
            groups: dict[tuple[str, str], list[int]] = {}
            for err in self.others:
                first = err.evalue.splitlines()[0] if err.evalue else ""
                groups.setdefault((err.ename, first[:300]), []).append(err.rank)
            for (ename, evalue), ranks in groups.items():
                label = "rank" if len(ranks) == 1 else "ranks"
                out.append(f"{label} {rank_ranges(ranks)}: {ename}: {evalue}" if evalue else
                           f"{label} {rank_ranges(ranks)}: {ename}")
        for note in self.notes:
            out.append(f"{dim}{note}{reset}" if color else note)
        return out

    def text(self) -> str:
        return "\n".join(self.lines(color=False))
