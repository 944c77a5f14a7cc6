"""nbdist.rank.report (rank side) and nbdist.notebook.progress_view's aggregation, rate limiting and text fallback.

The unit tests drive a real Reporter into a sink that merges publishes into one dict per engine
exactly as ipyparallel's client does (`md['data'].update(data)`), so RunState sees what it sees
in a notebook. The last tests use the real thing: a text line from `mpiexec -n 2 python` and
datapub from a real 2-engine MPI ipyparallel cluster.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

from nbdist.notebook import progress_render, progress_view
from nbdist.rank import report as metrics
from nbdist.rank.report import Reporter
from nbdist.wire import HISTORY_PREFIX, STATE_KEY
from nbdist.notebook.progress_view import RunState

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class MergingSink:
    """Like an engine's datapub as the client sees it: each publish is merged into one dict."""

    interval = 0.1

    def __init__(self):
        self.data: dict = {}
        self.messages = 0

    def parent_changed(self):
        return False

    def emit(self, state, point, index, final):
        message = {STATE_KEY: state}
        if point is not None:
            message[HISTORY_PREFIX + str(index)] = point
        self.data.update(message)
        self.messages += 1


def make(rank=0):
    clock = FakeClock()
    sink = MergingSink()
    return Reporter(sink, rank, clock=clock, wallclock=clock), sink, clock


# ---- rate limiting -------------------------------------------------------------------------
def test_rate_limit_publishes_at_most_once_per_interval():
    reporter, sink, clock = make()
    for i in range(1000):
        reporter.report(None, None, None, False, {"loss": 1.0 / (i + 1)})
    assert sink.messages == 1  # the first call publishes, the next 999 are inside 0.1 s
    assert reporter.step == 1000  # but every call counted as a step
    clock.now += 0.1
    assert reporter.report(None, None, None, False, {"loss": 0.5}) is True
    assert sink.messages == 2
    assert sink.data[STATE_KEY]["step"] == 1001
    for _ in range(50):  # 0.5 s of 10 ms steps: about 5 publishes
        clock.now += 0.01
        reporter.report(None, None, None, False, {"loss": 0.1})
    assert 4 <= sink.messages - 2 <= 6


def test_rate_limit_ten_per_second_with_fast_steps():
    reporter, sink, clock = make()
    for _ in range(10_000):  # 10 s of 1 ms steps
        clock.now += 0.001
        reporter.report(None, None, None, False, {"loss": 0.1})
    assert 95 <= sink.messages <= 101


def test_last_step_and_flush_are_never_held_back():
    reporter, sink, clock = make()
    reporter.report(1, 3, None, False, {"loss": 3.0})
    reporter.report(2, 3, None, False, {"loss": 2.0})
    assert sink.data[STATE_KEY]["step"] == 1  # rate-limited
    reporter.report(3, 3, None, False, {"loss": 1.0})  # step == total: published at once
    assert sink.data[STATE_KEY]["step"] == 3
    assert sink.data[STATE_KEY]["metrics"] == {"loss": 1.0}
    reporter.report(None, None, None, False, {"loss": 0.5})
    assert sink.data[STATE_KEY]["metrics"]["loss"] == 1.0
    reporter.flush()  # end of the cell: the held-back state goes out, marked final
    assert sink.data[STATE_KEY]["metrics"]["loss"] == 0.5
    assert sink.data[STATE_KEY]["final"] is True


def test_other_ranks_send_their_step_but_no_metrics():
    reporter, sink, clock = make(rank=3)
    reporter.report(7, 10, None, False, {"loss": 0.25})
    state = sink.data[STATE_KEY]
    assert state["rank"] == 3 and state["step"] == 7 and state["total"] == 10
    assert "metrics" not in state
    assert not any(k.startswith(HISTORY_PREFIX) for k in sink.data)


def test_metrics_merge_and_history_keeps_only_fresh_values():
    reporter, sink, clock = make()
    reporter.report(1, None, None, False, {"loss": 2.0})
    clock.now += 1
    reporter.report(2, None, None, False, {"val_loss": 3.0})
    assert sink.data[STATE_KEY]["metrics"] == {"loss": 2.0, "val_loss": 3.0}
    assert sink.data[HISTORY_PREFIX + "0"][2] == {"loss": 2.0}
    assert sink.data[HISTORY_PREFIX + "1"][2] == {"val_loss": 3.0}


def test_values_become_numbers_only_when_published():
    np = pytest.importorskip("numpy")

    class Lazy:
        conversions = 0

        def item(self):
            Lazy.conversions += 1
            return 0.5

    reporter, sink, clock = make()
    for _ in range(100):
        reporter.report(None, None, None, False, {"loss": Lazy(), "acc": np.float32(0.75)})
    assert Lazy.conversions == 1  # one publish, one conversion (a GPU sync, for a tensor)
    assert sink.data[STATE_KEY]["metrics"] == {"loss": 0.5, "acc": 0.75}
    assert type(sink.data[STATE_KEY]["metrics"]["acc"]) is float


def test_to_number_handles_tensors_arrays_and_strings():
    np = pytest.importorskip("numpy")
    assert metrics.to_number(np.int64(3)) == 3 and type(metrics.to_number(np.int64(3))) is int
    assert metrics.to_number(True) == 1
    assert metrics.to_number("adam") == "adam"
    assert isinstance(metrics.to_number(np.ones(3)), str)  # not a scalar: shown, not plotted


def test_history_thins_itself_on_long_runs(monkeypatch):
    monkeypatch.setattr(metrics, "HISTORY_CAP", 10)
    reporter, sink, clock = make()
    for i in range(40):
        clock.now += 1
        reporter.report(i, None, None, False, {"loss": float(i)})
    points = sorted(int(k[len(HISTORY_PREFIX):]) for k in sink.data if k.startswith(HISTORY_PREFIX))
    assert points == list(range(len(points)))  # still contiguous, so the client reads them all
    assert 10 < len(points) < 40


def test_reset_starts_a_new_cell():
    reporter, sink, clock = make()
    reporter.report(5, 10, "epoch 1", False, {"loss": 1.0})
    reporter.reset()
    reporter.report(None, None, None, False, {"acc": 0.5})
    state = sink.data[STATE_KEY]
    assert state["step"] == 1 and state["total"] is None and state["desc"] is None
    assert state["metrics"] == {"acc": 0.5}


# ---- progress(), TorchProgress, Keras -------------------------------------------------------
@pytest.fixture
def fresh_reporter(monkeypatch):
    reporter, sink, clock = make()
    monkeypatch.setattr(metrics, "_reporter", reporter)
    return reporter, sink, clock


def test_progress_reports_each_item_and_ends_with_the_total(fresh_reporter):
    reporter, sink, clock = fresh_reporter
    seen = []
    for x in metrics.progress(range(25), desc="epoch 1"):
        clock.now += 0.03
        metrics.report(loss=float(x))  # a metric inside the loop: not an extra step
        seen.append(x)
    assert seen == list(range(25))
    state = sink.data[STATE_KEY]
    assert (state["step"], state["total"], state["desc"]) == (25, 25, "epoch 1")
    assert state["metrics"]["loss"] == 24.0
    assert 6 <= sink.messages <= 12  # 0.75 s of loop: ~8 publishes, not 50
    assert reporter.auto_step is True  # restored after the loop


def test_progress_of_a_generator_has_no_total(fresh_reporter):
    reporter, sink, clock = fresh_reporter
    assert list(metrics.progress(x for x in "abc")) == ["a", "b", "c"]
    assert sink.data[STATE_KEY]["step"] == 3 and sink.data[STATE_KEY]["total"] is None


def test_torch_progress_averages_between_publishes(fresh_reporter):
    torch = pytest.importorskip("torch")
    reporter, sink, clock = fresh_reporter
    tp = metrics.TorchProgress(total=100, desc="train")
    w = torch.ones(1, requires_grad=True)
    for i in range(100):
        clock.now += 0.01
        loss = (w * float(i)).sum()  # a graph-attached tensor, as in a real loop
        tp.step(loss=loss)
    state = sink.data[STATE_KEY]
    assert state["step"] == 100 and state["total"] == 100
    # The last publish at step 100 averages the steps since the previous one (~90..99).
    assert 85 < state["metrics"]["loss"] < 99.5
    assert isinstance(state["metrics"]["loss"], float)


def test_keras_progress_logic_reports_batches_and_epochs(fresh_reporter):
    reporter, sink, clock = fresh_reporter
    cb = metrics.KerasProgress()
    cb.params = {"epochs": 2, "steps": 5}
    cb.on_train_begin()
    for epoch in range(2):
        cb.on_epoch_begin(epoch)
        for batch in range(5):
            clock.now += 0.001
            cb.on_train_batch_end(batch, {"loss": 1.0 / (batch + 1)})
        cb.on_epoch_end(epoch, {"loss": 0.2, "val_loss": 0.3 - epoch * 0.1})
    state = sink.data[STATE_KEY]
    assert (state["step"], state["total"], state["desc"]) == (10, 10, "epoch 2/2")
    assert state["metrics"]["val_loss"] == pytest.approx(0.2)
    epochs = [p[2] for k, p in sink.data.items() if k.startswith(HISTORY_PREFIX) and "epoch" in p[2]]
    assert [p["epoch"] for p in epochs] == [1, 2]  # every epoch end is kept (flush=True)


# ---- aggregation on the notebook side ------------------------------------------------------
def test_runstate_headline_rate_eta_and_stragglers():
    r0, s0, clock = make(rank=0)
    r1 = Reporter(MergingSink(), 1, clock=clock, wallclock=clock)
    run = RunState(2, clock=clock)
    for i in range(1, 51):
        clock.now += 0.05  # rank 0 at 20 steps/s, rank 1 at half its pace
        r0.report(i, 100, "epoch 1", False, {"loss": 1.0 / i})
        if i % 2 == 0:
            r1.report(i // 2, 100, None, False, None)
        if i % 3 == 0:  # the notebook polls less often than the engines publish
            run.ingest([s0.data, r1.sink.data])
    r0.flush()  # what the engine does after the cell
    run.ingest([s0.data, r1.sink.data])
    assert run.step == 50 and run.total == 100 and run.desc == "epoch 1"
    assert run.rate == pytest.approx(20, rel=0.1)
    assert run.eta == pytest.approx(2.5, rel=0.15)
    assert [r["step"] for r in run.ranks] == [50, 25]
    # every published history point arrived, in order, although polls were sparse
    steps = [p[1] for p in run.history]
    assert steps == sorted(steps) and len(steps) == r0._history_index
    assert run.series["loss"][-1] == pytest.approx(1 / 50)
    html = progress_render.ranks_html(run.ranks)
    assert "(-25)" in html  # the straggler is flagged


def test_runstate_finish_states():
    run = RunState(3)
    run.set_engine_status(["ok", None, "error"])
    run.finish("failed", failed_rank=2)
    assert [r["state"] for r in run.ranks] == ["done", "stopped", "failed"]
    assert run.state == "failed" and run.fraction() < 1
    run = RunState(2)
    run.finish("interrupted")
    assert [r["state"] for r in run.ranks] == ["interrupted", "interrupted"]
    run = RunState(2)
    run.finish("done")
    assert run.fraction() == 1.0 and [r["state"] for r in run.ranks] == ["done", "done"]


def test_last_metrics_table(monkeypatch):
    reporter, sink, clock = make()
    run = RunState(1, clock=clock)
    monkeypatch.setattr(progress_view, "_last_run", run)
    for i in range(1, 6):
        clock.now += 1
        reporter.report(i, 5, None, False, {"loss": 10.0 - i})
    run.ingest([sink.data])
    table = progress_view.last_metrics()
    pandas = pytest.importorskip("pandas")
    assert isinstance(table, pandas.DataFrame)
    assert list(table["step"]) == [1, 2, 3, 4, 5]
    assert list(table["loss"]) == [9.0, 8.0, 7.0, 6.0, 5.0]
    assert list(table["time"]) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_sparkline_is_inline_svg_with_bounded_points():
    svg = progress_render.sparkline_svg([float(i % 7) for i in range(1000)])
    assert svg.startswith("<svg") and "<polyline" in svg
    points = svg.split('points="')[1].split('"')[0].split()
    assert len(points) == progress_render.SPARK_POINTS
    assert progress_render.sparkline_svg([1.0]) == ""
    assert progress_render.sparkline_svg([1.0, float("nan"), 2.0]).count(",") >= 2


def test_text_line_format():
    line = progress_render.format_text_line(step=120, total=200, elapsed=7.2, rate=16.0,
                                            metrics={"loss": 0.123456}, desc="epoch 2")
    assert line == "[nbdist] epoch 2: 120/200 (60%) 0:07<0:05 16 it/s loss=0.1235"


# ---- frontends ------------------------------------------------------------------------------
def test_widget_frontend_detection(monkeypatch):
    monkeypatch.delenv("NBDIST_WIDGETS", raising=False)
    assert progress_view.widget_frontend(True) is False  # plain pytest: no kernel
    monkeypatch.setenv("NBDIST_WIDGETS", "1")
    assert progress_view.widget_frontend(True) is True
    assert progress_view.widget_frontend(False) is False  # --no-widgets wins
    monkeypatch.setenv("NBDIST_WIDGETS", "0")
    assert progress_view.widget_frontend(True) is False


class FakeAsyncResult:
    """Only .data / .metadata / wait_for_output, fed by real Reporters: the text view's input."""

    def __init__(self, sinks):
        self.sinks = sinks
        self.statuses = [None] * len(sinks)

    @property
    def data(self):
        return [s.data for s in self.sinks]

    @property
    def metadata(self):
        return [{"status": s} for s in self.statuses]

    def wait_for_output(self, timeout):
        return True


def test_text_view_without_a_kernel_writes_rank0_lines(monkeypatch):
    monkeypatch.setenv("NBDIST_TEXT_INTERVAL", "0")
    r0, s0, clock = make(0)
    r1 = Reporter(MergingSink(), 1, clock=clock, wallclock=clock)
    ar = FakeAsyncResult([s0, r1.sink])
    out = io.StringIO()
    view = progress_view.ProgressView(ar, 2, widgets=True, stream=out)
    view.poll()
    assert out.getvalue() == ""  # nothing reported yet: nothing drawn
    for i in range(1, 4):
        clock.now += 1
        r0.report(i, 3, None, False, {"loss": 1.0 / i})
        r1.report(i, 3, None, False, None)
        view.poll()
    ar.statuses = ["ok", "error"]
    view.finish("failed", failed_rank=1)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[nbdist] 1/3 (33%)")
    assert lines[-1].startswith("[nbdist] failed: 3/3 (100%)")
    assert "loss=0.3333" in lines[-1] and "1:3(failed)" in lines[-1]


def run_python(code: str, env_extra: dict, n: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "NBDIST_WIDGETS"))}
    env.update(env_extra)
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if n is not None:
        from conftest import MPIEXEC  # the venv's mpiexec
        cmd = [MPIEXEC, "-n", str(n), *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)


LOOP = """
    import time, nbdist.rank.report as m
    for i in range(20):
        time.sleep(0.01)
        m.report(step=i + 1, total=20, loss=1.0 / (i + 1))
    for i in range(5):
        m.report(acc=i / 10)        # no total: held back, then flushed at exit
"""


def test_text_fallback_outside_a_cluster_prints_rank0_to_stderr():
    result = run_python(LOOP, {"NBDIST_TEXT_INTERVAL": "0.05"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert 2 <= len(lines) <= 12, lines  # rate-limited, not 25 lines
    assert any(line.startswith("[nbdist] 20/20 (100%)") and "loss=0.05" in line for line in lines)
    assert lines[-1].startswith("[nbdist] 25/20") and "acc=0.4" in lines[-1]  # the exit flush


def test_text_fallback_is_silent_on_other_ranks():
    result = run_python(LOOP, {"NBDIST_TEXT_INTERVAL": "0", "PMI_RANK": "1"})
    assert result.returncode == 0 and result.stderr == ""


def test_text_fallback_under_mpiexec_prints_from_rank0_only():
    code = textwrap.dedent(LOOP) + "\nimport sys; print('rank', m.detect_rank(), file=sys.stdout)\n"
    result = run_python(code, {"NBDIST_TEXT_INTERVAL": "10"}, n=2)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]
    lines = [line for line in result.stderr.splitlines() if line.startswith("[nbdist]")]
    # 10 s interval: the first report, the last step (step == total) and the exit flush
    assert len(lines) == 3, result.stderr


# ---- the real transport: datapub from a 2-engine MPI ipyparallel cluster --------------------
@pytest.fixture(scope="module")
def mpi_cluster():
    ipp = pytest.importorskip("ipyparallel")
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")  # the venv's mpiexec
    cluster = ipp.Cluster(engines="mpi", n=2, log_level=40)
    client = cluster.start_and_connect_sync(activate=False)
    try:
        yield client
    finally:
        client.close()
        cluster.stop_cluster_sync()


CELL = """
import time
import nbdist.rank.report as m
for i in range(40):  # stops early (total 50): the last report is held back by the rate
    time.sleep(0.02 if m.get_reporter().rank == 0 else 0.03)   # limit, and the post-cell
    m.report(step=i + 1, total=50, loss=1.0 / (i + 1), lr=0.1)  # flush must deliver it
"""


@pytest.mark.timeout(180)
def test_datapub_from_real_engines_reaches_the_view(mpi_cluster, monkeypatch):
    monkeypatch.setenv("NBDIST_TEXT_INTERVAL", "0")
    for _cell in range(2):  # the second cell must start from a clean state on the engines
        ar = mpi_cluster[:].execute(CELL, block=False)
        out = io.StringIO()
        view = progress_view.ProgressView(ar, 2, stream=out)
        seen_steps = set()
        while not ar.ready():
            view.poll()
            seen_steps.add(view.run.step)
            time.sleep(0.1)
        ar.get()
        view.finish("done")
        run = view.run
        assert len(seen_steps - {None}) >= 3  # it moved while the cell ran
        assert run.step == 40 and run.total == 50
        assert run.metrics == {"loss": 1.0 / 40, "lr": 0.1}
        assert [r["step"] for r in run.ranks] == [40, 40]
        assert [r["state"] for r in run.ranks] == ["done", "done"]
        assert run.history[0][1] <= 2 and run.history[-1][1] == 40
        assert out.getvalue().splitlines()[-1].startswith("[nbdist] done: 40/50")


@pytest.mark.timeout(240)
def test_keras_progress_callback_in_a_real_fit():
    pytest.importorskip("keras")
    code = """
    import os, sys
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np, keras
    import nbdist.rank.report as m
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 3), "float32"), np.zeros((32, 1), "float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[m.keras_progress_callback()])
    print(type(model).__name__, file=sys.stdout)
    """
    result = run_python(code, {"NBDIST_TEXT_INTERVAL": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("[nbdist]")]
    assert lines[-1].startswith("[nbdist] epoch 2/2: 8/8 (100%)"), lines
    assert "val_loss=" in lines[-1] and "epoch=2" in lines[-1]


def test_top_level_report_progress_last_metrics_are_lazy():
    code = """
    import sys, nbdist
    assert "nbdist.rank.report" not in sys.modules and "ipywidgets" not in sys.modules
    if not hasattr(nbdist, "report"):
        print("NOT-EXPORTED")
        raise SystemExit(0)
    import nbdist.rank.report, nbdist.notebook.progress_view
    assert nbdist.report is nbdist.rank.report.report
    assert nbdist.progress is nbdist.rank.report.progress
    assert nbdist.last_metrics is nbdist.notebook.progress_view.last_metrics
    assert "ipywidgets" not in sys.modules
    print("OK")
    """
    result = run_python(code, {})
    assert result.returncode == 0, result.stderr
    if "NOT-EXPORTED" in result.stdout:
        pytest.skip("nbdist/__init__.py does not export report/progress/last_metrics yet")
    assert result.stdout.strip() == "OK"


def test_sparkline_uses_a_log_scale_when_the_values_span_decades():
    """A loss falling from 10 to 1e-4 over many steps is drawn as a slope, not a flat line."""
    import re

    loss = [10.0 * 10 ** (-5 * i / 99) for i in range(100)]  # 10 -> 1e-4, steady in log space
    svg = progress_render.sparkline_svg(loss, height=34)
    assert "nbdist-log" in svg
    ys = [float(p.split(",")[1]) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]
    mid = ys[len(ys) // 2]
    assert abs(mid - (ys[0] + ys[-1]) / 2) < 2.0, "halfway in decades must be halfway up the chart"
    assert "nbdist-log" not in progress_render.sparkline_svg([3.0, 2.0, 1.0])  # one decade: linear
    assert "nbdist-log" not in progress_render.sparkline_svg([1.0, -1.0, 1e-6])  # not all positive
    assert "(log scale)" in progress_render.metrics_html({"loss": loss[-1]}, {"loss": loss})
