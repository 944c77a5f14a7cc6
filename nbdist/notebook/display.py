"""What the user sees from a %%distributed cell: per-rank output, notices and failures.

Everything is emitted as a MIME bundle with both text/html and text/plain, so
JupyterLab renders the HTML and nbconvert / terminal IPython fall back to
plain text. Without a kernel (terminal IPython, `nbdist run`) output is plain
lines tagged by rank.
"""
from __future__ import annotations

import html
import sys
import time

from ..failure import FailureReport, RankError, rank_ranges, strip_ansi  # noqa: F401  (re-exported for the cell loop)

MAX_LINES_PER_RANK = 400  # a chatty rank must not turn the notebook into a wall of text
MAX_LEAD_CHARS = 1_000_000  # the lead rank's text kept in its block (the rest: "earlier lines not shown")
UPDATE_INTERVAL_S = 0.25  # how often the grouped block of the other ranks is redrawn


def in_kernel() -> bool:
    """True inside a Jupyter kernel (a frontend that renders MIME bundles and display updates)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _publish(bundle: dict, display_id=None, update: bool = False):
    from IPython.display import display

    if update and display_id is not None:
        display_id.update(bundle, raw=True)
        return display_id
    return display(bundle, raw=True, display_id=True if display_id else None)


_LEVEL_STYLE = {
    "info": "border-left:4px solid #3b82f6;background:#eff6ff",
    "warning": "border-left:4px solid #f59e0b;background:#fffbeb",
    "error": "border-left:4px solid #dc2626;background:#fef2f2",
}


def notice(text: str, level: str = "info") -> None:
    """A one-line message from nbdist itself (cluster started, reset, restarted ...)."""
    if not in_kernel():
        print(f"nbdist: {text}", file=sys.stderr if level != "info" else sys.stdout, flush=True)
        return
    style = _LEVEL_STYLE.get(level, _LEVEL_STYLE["info"])
    _publish({"text/plain": f"nbdist: {text}",
              "text/html": f'<div class="nbdist-notice nbdist-{level}" style="{style};padding:4px 8px;'
                           f'font-family:monospace;font-size:90%">nbdist: {html.escape(text)}</div>'})


class StartIndicator:
    """A visible 'starting N engines' line, replaced by the outcome when the start ends."""

    def __init__(self, n: int, what: str = "starting"):
        self.n = n
        self.t0 = time.monotonic()
        self.handle = None
        text = f"{what} {n} MPI engine{'s' if n != 1 else ''} (ipyparallel, one rank each) ..."
        if in_kernel():
            self.handle = _publish(self._bundle(text, "info"), display_id=True)
        else:
            print(f"nbdist: {text}", file=sys.stderr, flush=True)

    @staticmethod
    def _bundle(text: str, level: str) -> dict:
        style = _LEVEL_STYLE[level]
        return {"text/plain": f"nbdist: {text}",
                "text/html": f'<div class="nbdist-notice" style="{style};padding:4px 8px;font-family:monospace;'
                             f'font-size:90%">nbdist: {html.escape(text)}</div>'}

    def done(self, text: str | None = None, level: str = "info") -> None:
        elapsed = time.monotonic() - self.t0
        text = text or f"{self.n} rank{'s' if self.n != 1 else ''} ready in {elapsed:.1f} s"
        if self.handle is not None:
            self.handle.update(self._bundle(text, level), raw=True)
        else:
            print(f"nbdist: {text}", file=sys.stderr, flush=True)


class RankOutput:
    """Live per-rank stdout/stderr: the lead rank inline, the others grouped and collapsible.

    mode "all": lead rank inline, others grouped; "0": lead rank only; "none": nothing.
    """

    def __init__(self, ranks: list[int], mode: str = "all", rich: bool | None = None):
        self.ranks = list(ranks)
        self.lead = self.ranks[0] if self.ranks else 0
        self.mode = mode
        self.rich = in_kernel() if rich is None else rich
        self._lines: dict[int, list[tuple[str, str]]] = {r: [] for r in self.ranks}
        self._partial: dict[tuple[int, str], str] = {}
        self._dropped: dict[int, int] = {r: 0 for r in self.ranks}
        self._handle = None
        self._dirty = False
        self._last_update = 0.0
        # In a kernel with other ranks shown, the lead rank's text is a block of its own,
        # displayed before the others' block and updated in place: written as plain stream
        # output it would land after the others' block once that exists, splitting it.
        self._lead_block = self.rich and mode == "all" and len(self.ranks) > 1
        self._lead_text = ""
        self._lead_dropped = 0
        self._lead_handle = None
        self._lead_dirty = False

    # -- input ------------------------------------------------------------------------------

    def add_rank(self, rank: int) -> None:
        """A rank that joined while the cell runs (an elastic run grew): its output is grouped too."""
        if rank not in self._lines:
            self.ranks.append(rank)
            self._lines[rank] = []
            self._dropped[rank] = 0

    def add_stream(self, rank: int, name: str, text: str) -> None:
        """New stdout/stderr text from one rank."""
        if not text or self.mode == "none":
            return
        if rank == self.lead:
            if self._lead_block:
                self._add_lead(text)
                return
            stream = sys.stderr if name == "stderr" else sys.stdout
            stream.write(text)
            stream.flush()
            return
        if self.mode == "0":
            return
        buf = self._partial.get((rank, name), "") + text
        *complete, rest = buf.split("\n")
        self._partial[(rank, name)] = rest
        for line in complete:
            self._add_line(rank, name, line)

    def _add_lead(self, text: str) -> None:
        self._lead_text += text
        if len(self._lead_text) > MAX_LEAD_CHARS:  # keep the tail, as a terminal's scrollback does
            cut = self._lead_text.index("\n", len(self._lead_text) - MAX_LEAD_CHARS) + 1
            self._lead_dropped += self._lead_text.count("\n", 0, cut)
            self._lead_text = self._lead_text[cut:]
        self._lead_dirty = True

    def lead_text(self) -> str:
        """The lead rank's output as a terminal shows it: a carriage return rewrites its line."""
        lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in self._lead_text.split("\n")]
        head = [f"... {self._lead_dropped} earlier lines not shown"] if self._lead_dropped else []
        return "\n".join(head + lines)

    def _add_line(self, rank: int, name: str, line: str) -> None:
        if not self.rich:
            stream = sys.stderr if name == "stderr" else sys.stdout
            stream.write(f"[rank {rank}] {line}\n")
            stream.flush()
            return
        lines = self._lines.setdefault(rank, [])
        lines.append((name, line))
        if len(lines) > MAX_LINES_PER_RANK:
            del lines[0]
            self._dropped[rank] = self._dropped.get(rank, 0) + 1
        self._dirty = True

    def add_display(self, rank: int, content: dict) -> None:
        """Rich display data (plots, HTML): shown for the lead rank only."""
        if rank != self.lead or self.mode == "none" or not content.get("data"):
            return
        from IPython.display import publish_display_data

        publish_display_data(data=content["data"], metadata=content.get("metadata") or {})

    # -- output -----------------------------------------------------------------------------

    def flush(self, force: bool = False) -> None:
        """Redraw the lead rank's block and the other ranks' block if they changed (rate-limited)."""
        if not self._dirty and not self._lead_dirty:
            return
        now = time.monotonic()
        if not force and now - self._last_update < UPDATE_INTERVAL_S:
            return
        self._last_update = now
        if self._lead_block and (self._lead_handle is None or self._lead_dirty):
            # Created first, so it stays above the others' block whoever prints first.
            bundle = {"text/plain": self.lead_text()}
            if self._lead_handle is None:
                self._lead_handle = _publish(bundle, display_id=True)
            else:
                self._lead_handle.update(bundle, raw=True)
            self._lead_dirty = False
        if not self._dirty:
            return
        self._dirty = False
        bundle = self._bundle()
        if self._handle is None:
            self._handle = _publish(bundle, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def finish(self) -> None:
        """Flush partial lines (output without a trailing newline) and the final redraw."""
        for (rank, name), rest in list(self._partial.items()):
            if rest:
                self._add_line(rank, name, rest)
        self._partial.clear()
        self.flush(force=True)

    def _bundle(self) -> dict:
        others = [r for r in self.ranks if r != self.lead and self._lines.get(r)]
        text_lines = []
        parts = []
        for rank in others:
            lines = self._lines[rank]
            dropped = self._dropped.get(rank, 0)
            if dropped:
                text_lines.append(f"[rank {rank}] ... {dropped} earlier lines not shown")
            text_lines.extend(f"[rank {rank}] {line}" for _, line in lines)
            body = "\n".join(
                f'<span style="color:#b91c1c">{html.escape(strip_ansi(line))}</span>' if name == "stderr"
                else html.escape(strip_ansi(line)) for name, line in lines)
            n_err = sum(1 for name, _ in lines if name == "stderr")
            label = f"rank {rank} &middot; {len(lines) + dropped} line{'s' if len(lines) + dropped != 1 else ''}"
            if n_err:
                label += f' &middot; <span style="color:#b91c1c">{n_err} on stderr</span>'
            parts.append(f'<details><summary style="cursor:pointer;font-family:monospace">{label}</summary>'
                         f'<pre style="margin:2px 0 6px 16px;max-height:20em;overflow:auto">{body}</pre></details>')
        head = (f'<div style="font-family:monospace;font-size:85%;color:#555">output of rank'
                f'{"s" if len(others) != 1 else ""} {rank_ranges(others)} (click to expand)</div>')
        return {"text/plain": "\n".join(text_lines),
                "text/html": f'<div class="nbdist-ranks">{head}{"".join(parts)}</div>'}


class DistributedError(Exception):
    """A %%distributed cell failed; renders as the failing rank's traceback first."""

    def __init__(self, report: FailureReport):
        super().__init__(report.headline)
        self.report = report

    def _render_traceback_(self):  # IPython shows this instead of our own (uninteresting) frames
        return self.report.lines(color=True)


class DistributedTimeout(DistributedError):
    """A %%distributed cell ran past --timeout."""


class RankDied(DistributedError):
    """A rank died (segfault, os._exit, SIGKILL) while the cell ran."""


class DistributedInterrupt(KeyboardInterrupt):
    """The notebook was interrupted while a %%distributed cell ran; every rank was interrupted."""

    def __init__(self, report: FailureReport):
        super().__init__(report.headline)
        self.report = report

    def _render_traceback_(self):
        return self.report.lines(color=True)


def status_table(rows: list[dict], header: str) -> dict:
    """%dist_status as a MIME bundle: one row per rank."""
    cols = ["rank", "host", "pid", "gpus", "transports", "runtime", "state"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    text = [header, "  ".join(c.ljust(widths[c]) for c in cols)]
    text += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    cells = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return {"text/plain": "\n".join(text),
            "text/html": f"<div><b>{html.escape(header)}</b><table><tr>{cells}</tr>{body}</table></div>"}


def show(bundle: dict) -> None:
    """Display a MIME bundle in a kernel, print its text elsewhere."""
    if in_kernel():
        _publish(bundle)
    else:
        print(bundle["text/plain"], flush=True)
