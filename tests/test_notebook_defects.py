"""Faults a new user met in JupyterLab, each pinned end to end through a real kernel (2 ranks).

- an interrupted or timed-out cell, with the ranks in different places, leaves every
  rank's runtime clean: the next cells' collectives work (it used to fail every later cell);
- SIGKILL of one rank blames that rank, not every rank MPI stopped afterwards;
- a segfault shows the crashing rank's Python frames (faulthandler);
- rank 0's output stays in one piece above the other ranks' block;
- tracebacks name the notebook's cell number and the user's line.
"""
from __future__ import annotations

import re

import pytest

import nbharness as h

pytestmark = pytest.mark.timeout(600)

SETUP = """%%distributed -n 2
import os, signal, time
import numpy as np
import nbdist.common as hvd
hvd.init()
r = hvd.rank()"""

ASYM = """%%distributed --timeout 3
if hvd.rank() == 1:
    time.sleep(600)
hvd.allreduce(np.ones(3), name="asym")"""

ASYM_INTERRUPTED = """%%distributed
if hvd.rank() == 1:
    time.sleep(600)
hvd.allreduce(np.ones(3), name="asym-interrupted")"""

WORKS = """%%distributed
got = hvd.allreduce(np.ones(2) * (hvd.rank() + 1), op=hvd.Sum, name="works-{tag}")
print("works-{tag}", got.tolist())"""

SIGKILL = """%%distributed
if r == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(30)"""

SEGFAULT = """%%distributed
import ctypes
def read_null_pointer():
    return ctypes.string_at(0)
if r == 1:
    read_null_pointer()
time.sleep(30)"""

SPLIT_OUTPUT = """%%distributed
if r == 1:
    print("rank one speaks first")
time.sleep(1.0)
if r == 0:
    print("zero-a")
    time.sleep(0.6)
    print("zero-b")"""

TRACEBACK_LINE = """%%distributed
x = 1

def fails():
    raise ValueError("line five of the cell")
fails()"""


@pytest.fixture(scope="module")
def executed():
    nb = h.notebook(
        "%load_ext nbdist",                          # 0
        SETUP,                                       # 1
        ASYM,                                        # 2
        WORKS.format(tag="after-timeout"),           # 3
        WORKS.format(tag="after-timeout-2"),         # 4
        (ASYM_INTERRUPTED, {"interrupt_after": 4}),  # 5
        WORKS.format(tag="after-interrupt"),         # 6
        SIGKILL,                                     # 7
        SETUP,                                       # 8
        SEGFAULT,                                    # 9
        SETUP,                                       # 10
        SPLIT_OUTPUT,                                # 11
        TRACEBACK_LINE,                              # 12
        "%dist_stop",                                # 13
    )
    h.execute(nb, timeout=300)
    return nb


def test_timed_out_cell_leaves_the_runtime_clean(executed):
    err = h.error_of(executed.cells[2])
    assert err is not None and err[0] == "DistributedTimeout", h.text_of(executed.cells[2])
    for index, tag in ((3, "after-timeout"), (4, "after-timeout-2")):
        cell = executed.cells[index]
        assert h.error_of(cell) is None, h.text_of(cell)
        assert f"works-{tag} [3.0, 3.0]" in h.text_of(cell)


def test_interrupted_cell_leaves_the_runtime_clean(executed):
    err = h.error_of(executed.cells[5])
    assert err is not None and err[0] == "DistributedInterrupt", h.text_of(executed.cells[5])
    cell = executed.cells[6]
    assert h.error_of(cell) is None, h.text_of(cell)
    assert "works-after-interrupt [3.0, 3.0]" in h.text_of(cell)


def test_sigkill_blames_the_killed_rank_only(executed):
    err = h.error_of(executed.cells[7])
    assert err is not None, h.text_of(executed.cells[7])
    ename, evalue, tb = err
    assert ename == "RankDied"
    assert "rank 1 died (killed by signal 9" in evalue
    assert "rank 0 died" not in evalue, evalue
    assert h.error_of(executed.cells[8]) is None, h.text_of(executed.cells[8])


def test_segfault_shows_the_python_frames(executed):
    err = h.error_of(executed.cells[9])
    assert err is not None
    ename, evalue, tb = err
    assert "rank 1 died (killed by signal 11" in evalue, evalue
    assert "Fatal Python error: Segmentation fault" in tb, tb
    assert "read_null_pointer" in tb, tb


def test_rank0_output_is_one_block_above_the_others(executed):
    cell = executed.cells[11]
    assert h.error_of(cell) is None, h.text_of(cell)
    texts = [str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in cell.outputs]
    lead = [i for i, t in enumerate(texts) if "zero-a" in t or "zero-b" in t]
    others = [i for i, t in enumerate(texts) if "rank one speaks first" in t]
    assert len(lead) == 1 and "zero-a\nzero-b" in texts[lead[0]], texts
    assert others and lead[0] < others[0], texts


def test_traceback_names_the_notebook_cell_and_line(executed):
    cell = executed.cells[12]
    err = h.error_of(cell)
    assert err is not None
    tb = err[2]
    n = cell.execution_count
    assert f"Cell In[{n}], line 6" in tb, tb  # fails() is on line 6 of the notebook cell
    assert f"Cell In[{n}], line 5" in tb, tb  # the raise, line 5
    assert re.search(r"----> 5\s+raise ValueError", tb), tb
