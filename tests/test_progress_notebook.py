"""The progress view in a real notebook: nbclient runs `%%distributed -n 2` cells that report.

The notebook is executed with store_widget_state=True, written to disk and read back, so the
assertions are about what a re-opened notebook holds: the widget models' saved state (bar at
its end, rank 0's last metric values, per-rank states), the text/html snapshot for viewers
without widgets, and the --no-widgets text line.
"""
from __future__ import annotations

import html
import re

import nbformat
import pytest
from nbclient import NotebookClient

import nbharness as h
from nbharness import ROOT, notebook

pytestmark = pytest.mark.timeout(300)

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"

TRAIN = """\
%%distributed -n 2
import time
import nbdist
from nbdist.rank.report import detect_rank
rank = detect_rank()
for step in range(1, 41):
    time.sleep(0.03 if rank == 0 else 0.04)   # rank 1 lags: the rank row shows it
    nbdist.report(step=step, total=40, loss=1.0 / step, acc=step / 40)
print("trained")
"""

FAIL = """\
%%distributed -n 2
import time
import nbdist.rank.report
for step in range(1, 200):
    time.sleep(0.02)
    nbdist.rank.report.report(step=step, total=200, loss=1.0 / step)
    if step == 15 and nbdist.rank.report.detect_rank() == 1:
        raise ValueError("rank 1 broke at step 15")
"""

INTERRUPT = ("""\
%%distributed -n 2
import time
import nbdist.rank.report
for step in nbdist.progress(range(1000), desc="slow"):
    time.sleep(0.02)
""", {"interrupt_after": 8})

TIMEOUT = """\
%%distributed -n 2 --timeout 2
import time
import nbdist.rank.report
for step in range(1, 1000):
    time.sleep(0.02)
    nbdist.rank.report.report(step=step, total=1000, loss=0.5)
"""

TEXT = """\
%%distributed -n 2 --no-widgets
import time
import nbdist.rank.report
for step in range(1, 11):
    time.sleep(0.03)
    nbdist.rank.report.report(step=step, total=10, loss=2.0 / step)
"""

TRAIN4 = TRAIN.replace("-n 2", "-n 4").replace("total=40", "total=40, ranks=4")

TABLE = ("import nbdist\ntable = nbdist.last_metrics()\n"
         "print(list(table['step'])[-1], list(table['loss'])[-1], len(table))")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Execute the notebook once (widget state stored), save it, and read it back."""
    nb = notebook("%load_ext nbdist", TRAIN, FAIL, INTERRUPT, TIMEOUT, TEXT, TABLE, TRAIN4,
                  "%dist_stop")

    def timeout_func(cell):
        return cell.metadata.get("interrupt_after", 180)

    client = NotebookClient(nb, timeout=180, timeout_func=timeout_func, interrupt_on_timeout=True,
                            allow_errors=True, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    path = tmp_path_factory.mktemp("progress") / "progress.ipynb"
    nbformat.write(nb, path)
    return nbformat.read(path, as_version=4)


def progress_output(cell):
    """The cell's progress display (the one whose text/plain is the [nbdist] line)."""
    found = [o for o in cell.outputs if o.output_type == "display_data"
             and str(o.data.get("text/plain", "")).startswith("[nbdist]")]
    assert len(found) == 1, [o.get("data", o.get("text")) for o in cell.outputs]
    return found[0]


def widget_tree(nb, output):
    """The saved state of the progress VBox and of every model under it, by model name."""
    states = nb.metadata["widgets"][STATE_MIME]["state"]
    root = output.data[WIDGET_MIME]["model_id"]
    found, todo = {}, [root]
    while todo:
        model = states[todo.pop()]
        found.setdefault(model["model_name"], []).append(model["state"])
        for child in model["state"].get("children", []):
            todo.append(child.removeprefix("IPY_MODEL_"))
    return found


def html_values(tree) -> str:
    return "\n".join(s["value"] for s in tree["HTMLModel"])


def rank_states(markup: str) -> dict[int, str]:
    return {int(r): s for r, s in re.findall(r'data-rank="(\d+)" data-state="(\w+)"', markup)}


def test_saved_widget_shows_the_bar_at_its_end_and_rank0_metrics(saved):
    cell = saved.cells[1]
    assert "trained" in h.text_of(cell)  # rank 0's own output block
    out = progress_output(cell)
    tree = widget_tree(saved, out)
    (bar,) = tree["IntProgressModel"]
    assert bar["value"] == bar["max"] == 40 and bar["bar_style"] == "success"
    markup = html_values(tree)
    assert 'data-state="done"' in markup and "40/40 (100%)" in markup
    # rank 0's last values, each with its sparkline
    assert re.search(r'data-metric="loss".*?nbdist-value[^>]*>0\.025<', markup, re.S)
    assert re.search(r'data-metric="acc".*?nbdist-value[^>]*>1<', markup, re.S)
    assert markup.count("<polyline") == 2
    assert rank_states(markup) == {0: "done", 1: "done"}
    assert "rank 1 &middot; 40 &middot; done" in markup
    # the static snapshot for viewers without widgets, and the final text line
    assert "nbdist-progress" in out.data["text/html"] and "0.025" in out.data["text/html"]
    assert out.data["text/plain"].startswith("[nbdist] done: 40/40 (100%)")


def test_failure_is_marked_with_the_failing_rank(saved):
    cell = saved.cells[2]
    assert any(o.output_type == "error" for o in cell.outputs)
    tree = widget_tree(saved, progress_output(cell))
    (bar,) = tree["IntProgressModel"]
    assert bar["bar_style"] == "danger" and bar["value"] < bar["max"] == 200
    markup = html_values(tree)
    assert "failed on rank 1" in markup
    assert rank_states(markup)[1] == "failed"


def test_interrupt_is_marked_interrupted(saved):
    cell = saved.cells[3]
    tree = widget_tree(saved, progress_output(cell))
    (bar,) = tree["IntProgressModel"]
    assert bar["bar_style"] == "warning" and 0 < bar["value"] < 1000
    markup = html_values(tree)
    assert 'data-state="interrupted"' in markup and "slow" in markup


def test_timeout_is_marked_timeout(saved):
    tree = widget_tree(saved, progress_output(saved.cells[4]))
    assert tree["IntProgressModel"][0]["bar_style"] == "warning"
    assert 'data-state="timeout"' in html_values(tree)


def test_no_widgets_gives_a_text_line(saved):
    cell = saved.cells[5]
    out = progress_output(cell)
    assert WIDGET_MIME not in out.data and "text/html" not in out.data
    line = out.data["text/plain"]
    assert line.startswith("[nbdist] done: 10/10 (100%)")
    assert "loss=0.2" in line and "0:10(done) 1:10(done)" in line


def test_last_metrics_is_a_table_of_the_last_run(saved):
    text = "".join(o.get("text", "") for o in saved.cells[6].outputs if o.output_type == "stream")
    last_step, last_loss, rows = text.split()
    assert (int(last_step), float(last_loss)) == (10, 0.2) and int(rows) >= 2


def test_four_ranks_each_get_a_row(saved):
    tree = widget_tree(saved, progress_output(saved.cells[7]))
    (bar,) = tree["IntProgressModel"]
    assert bar["value"] == bar["max"] == 40 and bar["bar_style"] == "success"
    markup = html_values(tree)
    assert rank_states(markup) == {0: "done", 1: "done", 2: "done", 3: "done"}
    assert re.search(r'data-metric="ranks".*?nbdist-value[^>]*>4<', markup, re.S)


def test_the_saved_snapshot_is_plain_html(saved):
    snapshot = progress_output(saved.cells[1]).data["text/html"]
    assert "<script" not in snapshot and html.unescape(snapshot).count("rank ") >= 2


def test_terminal_ipython_gets_a_text_line(tmp_path):
    """No widget frontend (terminal IPython): rank 0's progress as text lines on stderr."""
    import os
    import subprocess
    import sys

    session = ("%load_ext nbdist\n%%distributed -n 2\nimport time, nbdist\nfor i in range(20):\n"
               "    time.sleep(0.05)\n    nbdist.report(step=i + 1, total=20, loss=1.0 / (i + 1))\n"
               "\n\n%dist_stop\n")
    ipython = os.path.join(os.path.dirname(sys.executable), "ipython")
    env = dict(os.environ, NBDIST_TEXT_INTERVAL="0.3")
    env.pop("NBDIST_WIDGETS", None)
    result = subprocess.run([ipython, "--simple-prompt", "--no-banner", "--colors=NoColor"],
                            input=session, capture_output=True, text=True, timeout=180,
                            cwd=tmp_path, env=env)
    lines = [line for line in result.stderr.splitlines() if line.startswith("[nbdist]")]
    assert lines, result.stdout + result.stderr
    assert lines[-1].startswith("[nbdist] done: 20/20 (100%)"), lines
    assert "loss=0.05" in lines[-1] and "0:20(done) 1:20(done)" in lines[-1]
    assert 2 <= len(lines) <= 10  # rate-limited, not one line per step
    assert "stopped the cluster" in result.stdout
