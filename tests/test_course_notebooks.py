"""The course notebooks (notebooks/01-*.ipynb ... 07-*.ipynb) run top to bottom, headless, on 2 ranks.

Each one runs in a fresh kernel as a user's would (nbclient, the notebook's folder as
working directory); any error fails the test, except in cells tagged
`raises-exception` (the faults a notebook demonstrates). The notebooks are kept in git
without outputs: the first test checks that, and the shape every lesson shares.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
COURSE = sorted(NOTEBOOKS.glob("0[1-9]-*.ipynb"))
COURSE_NAMES = ["01-ranks-and-collectives", "02-pytorch-data-parallel", "03-tensorflow-keras",
                "04-scaling-study", "05-faults-and-debugging", "06-from-notebook-to-batch", "07-gpus"]

# What each lesson must really show (besides running): a few lines of its output.
EXPECT = {
    "01-ranks-and-collectives": [r"MismatchError: allreduce 'oops': ranks disagree on shape", r"still fine"],
    "02-pytorch-data-parallel": [r"all ranks: \[(0\.\d+), \1\]; largest weight difference between ranks 0",
                                 r"the chart above was drawn ([2-9]|\d\d+) times while the cell trained"],
    "03-tensorflow-keras": [r"MismatchError: broadcast_variables\(root_rank=0\): the ranks passed different",
                            r"largest weight difference between ranks 0"],
    "04-scaling-study": [r"async, fused"],
    "05-faults-and-debugging": [r"rank 1 raised ValueError: corrupt record", r"stall: allreduce 'waits-for-rank-1'",
                                r"longer than --timeout 8 s", r"interrupted: every rank got KeyboardInterrupt",
                                r"rank 1 died \(exit status 3\)", r"<Figure size",
                                r"still here; weights = \[0.0, 1.0, 2.0\]; collectives work: 2"],
    "06-from-notebook-to-batch": [r"2 ranks, 10 epochs: test accuracy", r"\[0\] 2 ranks, 5 epochs: test accuracy"],
    "07-gpus": [r"No GPU on this machine|GPU\(s\) for PyTorch", r"the cells below run as %%distributed -n"],
}


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(str(out.data.get("text/plain", "")) + str(out.data.get("text/html", "")))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}\n" + "\n".join(out.traceback))
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(parts))


def test_course_is_complete_and_stored_without_outputs():
    assert [p.stem for p in COURSE] == COURSE_NAMES
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        dirty = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
        assert not dirty, (f"{path.name}: cells {dirty} have outputs; strip them before committing "
                           f"(make notebooks-clean)")
        assert "widgets" not in nb.metadata, f"{path.name}: saved widget state; strip it (make notebooks-clean)"
    for path in COURSE:
        nb = nbformat.read(path, as_version=4)
        markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
        assert "What you will learn" in markdown[0], f"{path.name}: the first cell says what you will learn"
        assert markdown[-1].lstrip().startswith("## Exercises"), f"{path.name}: the last text cell is the exercises"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", COURSE_NAMES)
def test_course_notebook_runs_headless(name):
    path = NOTEBOOKS / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.monotonic()
    client.execute()  # raises CellExecutionError on an error outside a raises-exception cell
    print(f"{name}: {time.monotonic() - start:.0f} s")
    failed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and "raises-exception" not in c.metadata.get("tags", [])
              and any(o.output_type == "error" for o in c.outputs)]
    assert not failed, f"{name}: cells {failed} failed"
    expected_failures = [i for i, c in enumerate(nb.cells)
                         if "raises-exception" in c.metadata.get("tags", [])]
    for i in expected_failures:  # a demonstrated fault must really happen
        assert any(o.output_type == "error" for o in nb.cells[i].outputs), \
            f"{name}: cell {i} is tagged raises-exception but did not fail"
    text = "\n".join(_text(c) for c in nb.cells)
    for pattern in EXPECT[name]:
        assert re.search(pattern, text), f"{name}: {pattern!r} not in its output:\n{text[-3000:]}"


@pytest.mark.timeout(120)
def test_bench_measure_returns_rows():
    from nbdist.cli.bench import measure

    rows = measure(ranks=[2], sizes=["4K", "64K"], impls=["nbdist"], seconds=0.02)
    assert [(r["ranks"], r["op"], r["bytes"], r["impl"]) for r in rows] == \
        [(2, "allreduce", 4096, "nbdist"), (2, "allreduce", 65536, "nbdist")]
    assert all(r["time_us"] > 0 and r["busbw_GBps"] > 0 for r in rows)
    with pytest.raises(ValueError, match="at least 2"):
        measure(ranks=[1])


@pytest.mark.timeout(60)
def test_bench_says_which_size_it_cannot_read_before_starting_ranks():
    # told once by the command itself (exit 2, argparse's usage error), not by every rank
    nbdist = Path(sys.executable).with_name("nbdist")  # the console script beside this python
    proc = subprocess.run([str(nbdist), "bench", "-n", "2", "--sizes", "4K,4X"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "running:" not in proc.stdout
    assert proc.stderr.count("argument --sizes: not a size in bytes: '4X'") == 1, proc.stderr
