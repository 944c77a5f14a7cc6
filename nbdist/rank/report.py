"""Engine-side progress reporting: `nbdist.report(step=, total=, **metrics)` and `nbdist.progress(it)`.

Every rank calls the same code; rank 0's metrics are the headline and every rank's step is sent
too, so a straggler shows. A call costs well under a microsecond-scale dict update when it is
not due to publish: publishing is rate-limited (NBDIST_REPORT_INTERVAL, default 0.1 s, so at
most 10 messages a second per rank), never blocks on the network and is never a collective.

Where the values go depends on where the code runs:
- inside an ipyparallel engine (a `%%distributed` cell): `ipyparallel.datapub.publish_data`, the
  engine's own IOPub channel, which lands in the cell's `AsyncResult.data` on the notebook side
  (read by nbdist.notebook.progress_view);
- anywhere else (`nbdist run`, `mpiexec python train.py`, plain python): rank 0 writes a text
  progress line to stderr (rewritten in place on a terminal, one line every NBDIST_TEXT_INTERVAL
  seconds, default 5, in a log), and the other ranks stay silent.

Values are converted to numbers only when published, so a GPU tensor passed as a metric costs a
device sync at most 10 times a second, not once per step.
"""
from __future__ import annotations

import atexit
import sys
import time
from typing import Any, Iterable, Iterator

from ..common.config import env_seconds
from ..mpi.ranks import env_rank
from ..wire import HISTORY_PREFIX, STATE_KEY  # noqa: F401  (tests and views import them from here too)

HISTORY_CAP = 20000  # points per cell before rank 0 thins its history (doubling the stride)


def text_interval(tty: bool) -> float:
    """Seconds between text progress lines: 0.2 on a terminal (rewritten in place), 5 in a log."""
    return env_seconds("TEXT_INTERVAL", 0.2 if tty else 5.0)


def detect_rank() -> int:
    """This process's rank: nbdist's runtime if initialized, else the MPI launcher's env, else 0."""
    common = sys.modules.get("nbdist.common")
    if common is not None:
        try:
            if common.is_initialized():
                return int(common.rank())
        except Exception:  # a half-imported or shut-down runtime: fall through to the launcher
            pass
    launched = env_rank()
    if launched is not None:
        return launched
    kernel = _engine_kernel()
    if kernel is not None and getattr(kernel, "engine_id", -1) >= 0:
        return int(kernel.engine_id)
    return 0


def _engine_kernel():
    """The ipyparallel engine kernel running this code, or None outside an engine."""
    if "ipyparallel.engine.kernel" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
        from ipyparallel.engine.kernel import IPythonParallelKernel
    except ImportError:
        return None
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    return kernel if isinstance(kernel, IPythonParallelKernel) else None


def to_number(value: Any) -> Any:
    """A plain Python number for a metric value (tensor, numpy scalar), or str() if it is none."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return value
    if isinstance(value, bool):
        return int(value)
    item = getattr(value, "item", None)
    if item is not None:
        try:
            return to_number(item())
        except Exception:  # a non-scalar array: fall back to float() / str()
            pass
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class _DataPubSink:
    """Publishes through the engine's IOPub (ipyparallel datapub); one message per publish."""

    def __init__(self, kernel):
        self._shell = kernel.shell
        self.interval = env_seconds("REPORT_INTERVAL", 0.1)
        self._parent_id = None

    def parent_changed(self) -> bool:
        """True when a new request (cell) is running since the last publish."""
        parent = self._shell.data_pub.parent_header
        msg_id = parent.get("msg_id") if parent else None
        changed = msg_id != self._parent_id
        self._parent_id = msg_id
        return changed

    def emit(self, state: dict, point: tuple | None, index: int, final: bool) -> None:
        data: dict = {STATE_KEY: state}
        if point is not None:
            data[HISTORY_PREFIX + str(index)] = point
        self._shell.data_pub.publish_data(data)


class _TextSink:
    """Rank 0's progress line on stderr: rewritten in place on a terminal, one line per interval in a log."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = text_interval(self.tty)
        self._open_line = False  # a '\r' line is on screen and needs a newline at the end
        self._t0 = None
        self._first_step = None

    def parent_changed(self) -> bool:
        return False

    def emit(self, state: dict, point: tuple | None, index: int, final: bool) -> None:
        from .textline import format_text_line

        now = state["time"]
        if self._t0 is None or state["step"] < (self._first_step or 0):
            self._t0, self._first_step = now, state["step"]
        elapsed = now - self._t0
        done = state["step"] - self._first_step
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        line = format_text_line(step=state["step"], total=state["total"], elapsed=elapsed,
                                rate=rate, metrics=state.get("metrics"), desc=state.get("desc"))
        try:
            if self.tty:
                self.stream.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
                self._open_line = not final
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed at interpreter exit: progress is optional
            pass

    def close(self) -> None:
        if self._open_line:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self._open_line = False


class Reporter:
    """One rank's progress state and rate limiter; `report()` is the hot path."""

    def __init__(self, sink, rank: int, clock=time.monotonic, wallclock=time.time):
        self.sink = sink
        self.rank = rank
        self.headline = rank == 0  # only rank 0 sends metrics; the others send their step
        self.interval = sink.interval if sink is not None else 0.0
        self._clock = clock
        self._wallclock = wallclock
        self.auto_step = True  # report() without step= counts calls, except inside progress()
        self.publishes = 0
        self.reset()

    def reset(self) -> None:
        """Forget the previous cell's progress (called before each engine cell)."""
        self.step = 0
        self.total = None
        self.desc = None
        self.metrics: dict = {}
        self._fresh: dict = {}  # metrics updated since the last publish: the next history point
        self.calls = 0
        self._next = 0.0
        self._pending = False
        self._published_step: int | None = None
        self._history_index = 0
        self._history_stride = 1
        self._publish_count = 0

    def due(self) -> bool:
        """Whether a report now would publish (the rate limit has elapsed)."""
        return self._clock() >= self._next

    def report(self, step=None, total=None, desc=None, flush=False, metrics=None) -> bool:
        """Record a step (and rank 0's metrics); publish if due. Returns whether it published."""
        if step is None:
            if self.auto_step:
                self.step += 1
        else:
            self.step = step
        if total is not None:
            self.total = total
        if desc is not None:
            self.desc = desc
        if metrics and self.headline:
            self.metrics.update(metrics)
            self._fresh.update(metrics)
        self.calls += 1
        now = self._clock()
        # The step that reaches the total goes out at once (the bar ends full without waiting
        # for the post-cell flush); steps past it are rate-limited like any other.
        last_step = self.step == self.total and self.step != self._published_step
        if not flush and now < self._next and not last_step:
            self._pending = True
            return False
        self._next = now + self.interval
        self._publish(final=False)
        return True

    def flush(self, final: bool = True) -> None:
        """Publish what the rate limit held back (end of a cell, end of the program)."""
        if self.sink is None:
            return
        if self._pending or (final and self.calls and isinstance(self.sink, _DataPubSink)):
            self._publish(final=final)
        if final and isinstance(self.sink, _TextSink):
            self.sink.close()

    def _publish(self, final: bool) -> None:
        self._pending = False
        self._published_step = self.step
        if self.sink is None:
            return
        if self.sink.parent_changed():
            # A new cell started without a pre_execute reset (e.g. apply instead of execute):
            # number its history from 0 so the new AsyncResult finds it.
            self._history_index = 0
            self._history_stride = 1
            self._publish_count = 0
        state = {"rank": self.rank, "step": self.step, "total": self.total, "desc": self.desc,
                 "time": self._wallclock(), "final": final}
        point = None
        if self.headline:
            state["metrics"] = {k: to_number(v) for k, v in self.metrics.items()}
            if self._fresh and self._publish_count % self._history_stride == 0:
                point = (state["time"], self.step,
                         {k: state["metrics"][k] for k in self._fresh})
                self._fresh = {}
            state["history"] = self._history_index + (point is not None)
        self._publish_count += 1
        self.sink.emit(state, point, self._history_index, final)
        if point is not None:
            self._history_index += 1
            if self._history_index % HISTORY_CAP == 0:
                self._history_stride *= 2  # a long run: keep its shape, bound its memory
        self.publishes += 1


_reporter: Reporter | None = None


def _make_reporter() -> Reporter:
    kernel = _engine_kernel()
    rank = detect_rank()
    if kernel is not None:
        reporter = Reporter(_DataPubSink(kernel), rank)
        events = getattr(kernel.shell, "events", None)
        if events is not None:
            # Each %%distributed cell is one engine execute: start fresh before it, and send the
            # state the rate limit held back after it, while the cell's parent header is set.
            events.register("pre_execute", reporter.reset)
            events.register("post_execute", reporter.flush)
        return reporter
    reporter = Reporter(_TextSink() if rank == 0 else None, rank)
    atexit.register(reporter.flush)
    return reporter


def get_reporter() -> Reporter:
    """This process's reporter, created on first use (so importing nbdist starts nothing)."""
    global _reporter
    if _reporter is None:
        _reporter = _make_reporter()
    return _reporter


def rank_changed(rank: int) -> None:
    """The runtime (re)started as `rank` (after an elastic resize): rank 0 sends the headline."""
    if _reporter is not None:
        _reporter.rank = rank
        _reporter.headline = rank == 0


def report(step: int | None = None, total: int | None = None, *, desc: str | None = None,
           flush: bool = False, **metrics: Any) -> bool:
    """Report training progress from every rank: step (default: one more), total, rank 0's metrics.

    `desc` labels the run (e.g. "epoch 3"); `flush=True` publishes now, past the rate limit
    (use it for points that must all be kept, like epoch ends). Returns whether it published.
    """
    return get_reporter().report(step, total, desc, flush, metrics)


def flush() -> None:
    """Publish the latest state now (the end of a cell or a program does this for you)."""
    if _reporter is not None:
        _reporter.flush(final=False)


def progress(iterable: Iterable, total: int | None = None, desc: str | None = None) -> Iterator:
    """Like tqdm: yield the items of `iterable`, reporting step i/total after each one."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    reporter = get_reporter()
    saved_auto = reporter.auto_step
    reporter.auto_step = False  # report(loss=...) inside the loop adds metrics, not steps
    step = 0
    try:
        reporter.report(0, total, desc, False, None)
        for item in iterable:
            yield item
            step += 1
            reporter.report(step, total, desc, False, None)
    finally:
        reporter.auto_step = saved_auto
        if reporter.sink is not None:
            reporter.report(step, total, desc, True, None)


class TorchProgress:
    """A PyTorch loop's progress: `tp.step(loss=loss)` per batch, averaged between publishes.

    Tensors are detached and summed on their device; they become numbers (one sync) only when
    a publish is due, at most 10 times a second. Works with plain floats and numpy too.
    """

    def __init__(self, total: int | None = None, desc: str | None = None):
        self.total = total
        self.desc = desc
        self.steps = 0
        self._sums: dict = {}
        self._count = 0

    def step(self, **metrics: Any) -> bool:
        """One training step done; metrics are averaged over the steps since the last publish."""
        reporter = get_reporter()
        self.steps += 1
        if reporter.headline and metrics:
            for name, value in metrics.items():
                detach = getattr(value, "detach", None)
                if detach is not None:
                    value = detach()
                current = self._sums.get(name)
                self._sums[name] = value if current is None else current + value
            self._count += 1
        if reporter.due() or (self.total is not None and self.steps >= self.total):
            return self._send(reporter, flush=False)
        return reporter.report(self.steps, self.total, self.desc, False, None)

    def close(self) -> None:
        """Publish the last averages now (call after the loop)."""
        self._send(get_reporter(), flush=True)

    def _send(self, reporter: Reporter, flush: bool) -> bool:
        means = {k: v / self._count for k, v in self._sums.items()} if self._count else None
        self._sums, self._count = {}, 0
        return reporter.report(self.steps, self.total, self.desc, flush, means)

    def __enter__(self) -> "TorchProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KerasProgress:
    """Keras callback behaviour: mix into keras.callbacks.Callback (see keras_progress_callback).

    Reports every batch (rate-limited) with Keras' running logs and every epoch end with
    flush=True, so each epoch's validation metrics are kept in the history.
    """

    def on_train_begin(self, logs=None):
        params = getattr(self, "params", None) or {}
        self._nbdist_epochs = params.get("epochs") or 1
        self._nbdist_steps = params.get("steps")
        self._nbdist_epoch = 0
        self._nbdist_seen = 0

    def _nbdist_total(self):
        return self._nbdist_steps * self._nbdist_epochs if self._nbdist_steps else None

    def on_epoch_begin(self, epoch, logs=None):
        self._nbdist_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._nbdist_seen += 1
        report(step=self._nbdist_seen, total=self._nbdist_total(),
               desc=f"epoch {self._nbdist_epoch + 1}/{self._nbdist_epochs}", **(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
        report(step=self._nbdist_seen, total=self._nbdist_total(),
               desc=f"epoch {epoch + 1}/{self._nbdist_epochs}", flush=True,
               epoch=epoch + 1, **(logs or {}))


def keras_progress_callback(**kwargs: Any):
    """A Keras `ProgressCallback` instance (tf.keras when TensorFlow is loaded, else keras)."""
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        base = tf.keras.callbacks.Callback
    else:
        import keras

        base = keras.callbacks.Callback
    cls = type("ProgressCallback", (KerasProgress, base), {"__doc__": KerasProgress.__doc__})
    return cls(**kwargs)
