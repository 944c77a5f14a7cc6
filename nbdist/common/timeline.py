"""Horovod's timeline: a Chrome-trace JSON of what each op spent its time on.

Started by `NBDIST_TIMELINE=path` (or `HOROVOD_TIMELINE`) at init, or by
`start_timeline(path, mark_cycles=False)` / `stop_timeline()`. Every rank writes its own
file: rank 0 the given path, rank r `<path>.rank<r>` (or the path with `{rank}` filled
in, when it holds that field). `merge()` joins the files into one trace.

Each op is a track (a trace "process", named `<kind>.<name>` as in Horovod) with this
rank as its thread; its phases are begin/end pairs:

  NEGOTIATE_<KIND>              submitted until every rank agreed to run it
  QUEUE                         agreed, waiting for the units before it on this rank
  <KIND>                        running, and inside it:
    MEMCPY_IN_FUSION_BUFFER     copy into the engine's fusion buffer (fused allreduces)
    <TRANSPORT>_<KIND>          the transport's collective (SHM_ALLREDUCE, MPI_ALLGATHER ...)
    MEMCPY_OUT_FUSION_BUFFER    copy back out of it

The shm transport packs a fused unit's tensors itself (straight into its segment when
they fit), inside its SHM_ALLREDUCE phase; the engine's fusion buffer, and its two
MEMCPY phases, serve the other transports and the units scaled in Python (a prescale,
integer Average, 16-bit floats).

With mark_cycles, each pass of the background thread that did work adds a CYCLE_START
instant event. chrome://tracing and https://ui.perfetto.dev load the files.

The engine calls the hooks below; each is a no-op costing one global read when no
timeline is active.
"""
from __future__ import annotations

import json
import os
import threading
import time
import zlib

_active: "Timeline | None" = None
_lock = threading.Lock()


def rank_path(path: str, rank: int) -> str:
    """The file rank `rank` writes for a timeline requested at `path`."""
    if "{rank}" in path:
        return path.format(rank=rank)
    return path if rank == 0 else f"{path}.rank{rank}"


class Timeline:
    """One rank's open trace file; thread-safe (the user thread and the engine write)."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False):
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._file = open(path, "w")
        self._pids: dict[str, int] = {}  # track name -> trace pid
        self._open: dict[str, list[str]] = {}  # op name -> phases begun, not ended
        self._t0 = time.monotonic_ns()
        self._first = True
        self._dirty = False
        self._closed = threading.Event()
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": 0, "tid": rank,
                    "args": {"name": "nbdist"}})
        self._emit({"name": "timeline_start", "ph": "i", "s": "g", "pid": 0, "tid": rank,
                    "ts": 0, "args": {"start_time_since_epoch_in_micros": time.time_ns() // 1000,
                                      "rank": rank}})
        self._flush(force=True)
        threading.Thread(target=self._flusher, name="nbdist-timeline", daemon=True).start()

    # -- writing ------------------------------------------------------------------------
    def _now(self) -> float:
        return (time.monotonic_ns() - self._t0) / 1000.0

    def _emit(self, event: dict) -> None:
        self._file.write(("" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
        self._first = False

    def _flush(self, force: bool = False) -> None:
        # Events are buffered; a flusher thread writes them out within 50 ms, so a
        # running job's file is readable (Horovod's test reads it mid-run) without a
        # write system call per event on the engine thread.
        if force:
            self._file.flush()
            self._dirty = False
        else:
            self._dirty = True

    def _flusher(self) -> None:
        while not self._closed.wait(0.05):
            with self._lock:
                if self._dirty and not self._file.closed:
                    self._file.flush()
                    self._dirty = False

    def _pid(self, track: str) -> int:
        pid = self._pids.get(track)
        if pid is None:
            # the same number on every rank, so merged files put an op's ranks together
            pid = self._pids[track] = 1 + zlib.crc32(track.encode()) % 0x7FFFFFFE
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "tid": self.rank,
                        "args": {"name": track}})
        return pid

    def begin(self, track: str, phase: str, args: dict | None = None) -> None:
        """Start `phase` on `track` (the op's display name)."""
        with self._lock:
            if self._file.closed:
                return
            event = {"name": phase, "ph": "B", "ts": self._now(), "pid": self._pid(track),
                     "tid": self.rank}
            if args:
                event["args"] = args
            self._emit(event)
            self._open.setdefault(track, []).append(phase)
            self._flush()

    def end(self, track: str, phase: str | None = None) -> None:
        """End the innermost open phase on `track` (or up to and including `phase`)."""
        with self._lock:
            if self._file.closed:
                return
            stack = self._open.get(track)
            if not stack:
                return
            while stack:
                top = stack.pop()
                self._emit({"ph": "E", "ts": self._now(), "pid": self._pids[track],
                            "tid": self.rank})
                if phase is None or top == phase:
                    break
            if not stack:
                del self._open[track]
            self._flush()

    def end_all(self, track: str) -> None:
        """Close every phase still open on `track` (the op finished or failed)."""
        with self._lock:
            stack = self._open.pop(track, None)
            if self._file.closed or not stack:
                return
            for _ in stack:
                self._emit({"ph": "E", "ts": self._now(), "pid": self._pids[track],
                            "tid": self.rank})
            self._flush()

    def cycle(self) -> None:
        if not self.mark_cycles:
            return
        with self._lock:
            if self._file.closed:
                return
            self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "ts": self._now(),
                        "pid": 0, "tid": self.rank})
            self._flush()

    def close(self) -> None:
        """End open phases and close the JSON array, so the file is valid JSON."""
        with self._lock:
            if self._file.closed:
                return
            for track, stack in self._open.items():
                for _ in stack:
                    self._emit({"ph": "E", "ts": self._now(), "pid": self._pids[track],
                                "tid": self.rank})
            self._open.clear()
            self._file.write("\n]\n")
            self._file.close()
            self._closed.set()


# -- the API and the hooks -------------------------------------------------------------------
def start(path: str, rank: int, mark_cycles: bool = False) -> str:
    """Start writing this rank's timeline (stopping a running one first); returns its file."""
    global _active
    if not path or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"start_timeline needs a file path, got {path!r}")
    target = rank_path(os.fspath(path), rank)
    with _lock:
        if _active is not None:
            _active.close()
        _active = Timeline(target, rank, mark_cycles)
    return target


def stop() -> None:
    """Stop the timeline (the file is complete, valid JSON); harmless if none runs."""
    global _active
    with _lock:
        timeline, _active = _active, None
    if timeline is not None:
        timeline.close()


def active() -> Timeline | None:
    """The running timeline, or None."""
    return _active


def display_name(kind: str, name: str) -> str:
    """An op's track name, as Horovod shows it: '<kind>.<name>'."""
    return f"{kind}.{name}"


def op_submitted(kind: str, name: str) -> None:
    timeline = _active
    if timeline is not None:
        timeline.begin(display_name(kind, name), f"NEGOTIATE_{kind.upper()}")


def op_agreed(kind: str, name: str) -> None:
    """Every rank agreed: negotiation is over; the op waits its turn on this rank."""
    timeline = _active
    if timeline is not None:
        track = display_name(kind, name)
        timeline.end(track, f"NEGOTIATE_{kind.upper()}")
        timeline.begin(track, "QUEUE")


def op_started(kind: str, name: str) -> None:
    timeline = _active
    if timeline is not None:
        track = display_name(kind, name)
        timeline.end(track, "QUEUE")
        timeline.begin(track, kind.upper())


def phase_begin(kind: str, names, phase: str) -> None:
    """`phase` begins for every op in `names` (a fused unit shares its phases)."""
    timeline = _active
    if timeline is not None:
        for name in names:
            timeline.begin(display_name(kind, name), phase)


def phase_end(kind: str, names, phase: str) -> None:
    timeline = _active
    if timeline is not None:
        for name in names:
            timeline.end(display_name(kind, name), phase)


def op_finished(kind: str, name: str) -> None:
    timeline = _active
    if timeline is not None:
        timeline.end_all(display_name(kind, name))


def cycle() -> None:
    timeline = _active
    if timeline is not None:
        timeline.cycle()


def merge(path: str, size: int, out: str | None = None) -> list:
    """The events of every rank's file for a timeline started at `path`, as one list
    (written to `out` as one Chrome trace when given). Unfinished files are read too."""
    events: list = []
    for rank in range(size):
        with open(rank_path(path, rank)) as f:
            text = f.read().strip()
        if not text.endswith("]"):
            text = text.rstrip(",") + "]"
        events.extend(json.loads(text))
    if out is not None:
        with open(out, "w") as f:
            json.dump(events, f)
    return events


def rank_files(path: str) -> list[str]:
    """The files every rank wrote for a timeline started at `path`, in rank order."""
    files: list[str] = []
    while os.path.exists(rank_path(path, len(files))):
        files.append(rank_path(path, len(files)))
    return files


def phase_spans(events: list) -> list[tuple[int, str, float, float]]:
    """(rank, phase, start µs, end µs) of every closed phase in a list of events."""
    open_phases: dict = {}
    spans = []
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_phases.setdefault(key, []).append((e["name"], e["ts"]))
        elif e.get("ph") == "E" and open_phases.get(key):
            name, start = open_phases[key].pop()
            spans.append((e["tid"], name, start, e["ts"]))
    return spans


def plot(path: str, ax=None):
    """Draw a timeline started at `path` as one row per rank, a colour per phase (the
    outermost per-op phases NEGOTIATE/QUEUE, then the transport and copy phases on
    top); returns the matplotlib Figure. Each rank's clock starts at its own
    start_timeline, so compare durations across ranks, not exact instants."""
    import matplotlib.pyplot as plt

    files = rank_files(path)
    if not files:
        raise FileNotFoundError(f"no timeline files for {path!r} (rank 0 writes that path, "
                                "rank r <path>.rank<r>)")
    spans = phase_spans(merge(path, len(files)))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(files)))
    colours: dict = {}
    palette = plt.get_cmap("tab10")
    for rank, phase, start, end in spans:
        group = "NEGOTIATE" if phase.startswith("NEGOTIATE") else phase
        colour = colours.setdefault(group, palette(len(colours) % 10))
        # an op's own phase (ALLREDUCE ...) spans its inner phases: draw it thin, below
        thin = group in ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER")
        height = 0.2 if thin else 0.6
        ax.broken_barh([(start / 1000.0, max(end - start, 1.0) / 1000.0)],
                       (rank - height / 2, height), facecolors=colour)
    ax.set_yticks(range(len(files)), [f"rank {r}" for r in range(len(files))])
    ax.set_xlabel("ms since start_timeline")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.figure.tight_layout()
    return ax.figure
