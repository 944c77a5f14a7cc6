"""The everyday life of a notebook cluster, executed through a real kernel with nbclient.

State between cells, rank 0's value and rich output, grouped output of the other ranks,
reuse and restart on a new -n (with its notice), bad input leaving the cluster intact,
%dist_push/%dist_pull/%dist_run/%dist_status, --targets and --output, and nothing left
after %dist_stop or after the kernel is killed.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from jupyter_client import KernelManager

import nbharness as h

pytestmark = pytest.mark.timeout(600)

AFTER_STOP = r'''
import json as _json, os as _os, psutil as _ps, time as _time
def _left():
    out = []
    for _pid, _t in _fp["pids"]:
        try:
            _p = _ps.Process(_pid)
            if abs(_p.create_time() - _t) < 1e-3 and _p.status() != _ps.STATUS_ZOMBIE:
                out.append(_pid)
        except _ps.Error:
            pass
    return out
print("AFTER_STOP " + _json.dumps({"pids": _left(), "shm": [s for s in _fp["shm"] if _os.path.exists(s)]}))
'''


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    script = tmp_path_factory.mktemp("script") / "job.py"
    script.write_text("from mpi4py import MPI\nran_script = MPI.COMM_WORLD.Get_rank() * 100\n"
                      "print('script on rank', MPI.COMM_WORLD.Get_rank())\n")
    nb = h.notebook(
        "%load_ext nbdist",
        "%%distributed -n 2\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.Get_rank()\nx = 10 * (r + 1)\n"
        "print('defined x on', r)",
        "%%distributed\nprint('x is', x)\n{'rank': r, 'x': x}",                                   # 2
        "%%distributed\nfrom IPython.display import HTML, display\ndisplay(HTML(f'<b>html from {r}</b>'))",
        "%%distributed -n abc\nx = 'must not run'",                                           # 4
        "%%distributed --bogus\nx = 'must not run'",                                          # 5
        "%%distributed\n",                                                                    # 6
        "%%distributed\nprint('x survived:', x)",                                             # 7
        "notebook_value = [1, 2, 3]\n%dist_push notebook_value",                               # 8
        "%%distributed\nfrom_notebook = sum(notebook_value) + r",                             # 9
        "%dist_pull from_notebook --rank 1\nprint('pulled', from_notebook)",                  # 10
        f"%dist_run {script}",                                                                # 11
        "%%distributed --targets 1\nprint('only on', r)",                                     # 12
        "%%distributed --output 0\nprint('quiet', r)",                                        # 13
        "%dist_status",                                                                       # 14
        "%%distributed -n 1\nprint('world', MPI.COMM_WORLD.Get_size()) if 'MPI' in dir() else print('fresh')",
        "%%distributed -n 2\nfrom mpi4py import MPI\nprint('back to', MPI.COMM_WORLD.Get_size())",  # 16
        h.FOOTPRINT + "\n_fp = {'pids': _pids, 'shm': _shm}",                                 # 17
        "%dist_stop",                                                                         # 18
        AFTER_STOP,                                                                           # 19
        "%dist_status",                                                                       # 20
    )
    h.execute(nb, timeout=300)
    return nb


def text(nb, i):
    return h.text_of(nb.cells[i])


def test_state_lives_on_and_rank0_value_is_the_result(executed):
    assert h.error_of(executed.cells[1]) is None, text(executed, 1)
    out = text(executed, 2)
    assert "x is 10" in out and "[rank 1] x is 20" in out
    results = [o for o in executed.cells[2].outputs if o.output_type == "execute_result"]
    assert results and results[0].data["text/plain"] == "{'rank': 0, 'x': 10}"


def test_start_indicator_shown(executed):
    assert "2 ranks ready in" in text(executed, 1)


def test_rank0_rich_output_shown(executed):
    htmls = [o.data["text/html"] for o in executed.cells[3].outputs
             if o.output_type == "display_data" and "text/html" in o.data]
    assert any("html from 0" in x for x in htmls)
    assert not any("html from 1" in x for x in htmls), "only rank 0's rich output is shown"


def test_other_ranks_grouped_and_collapsible(executed):
    htmls = [o.data["text/html"] for o in executed.cells[2].outputs
             if o.output_type == "display_data" and "nbdist-ranks" in o.data.get("text/html", "")]
    assert htmls and "<details>" in htmls[-1] and "rank 1" in htmls[-1]


@pytest.mark.parametrize("index, message", [(4, "whole number"), (5, "unrecognized arguments"),
                                            (6, "empty")])
def test_bad_input_is_a_clear_error(executed, index, message):
    # IPython shows a UsageError as one line on stderr, without a traceback
    out = text(executed, index)
    assert "UsageError:" in out and message in out, out


def test_bad_input_loses_nothing(executed):
    assert h.error_of(executed.cells[7]) is None
    assert "x survived: 10" in text(executed, 7)
    assert "restarting" not in text(executed, 7)


def test_push_pull_and_run(executed):
    for i in (8, 9, 10, 11):
        assert h.error_of(executed.cells[i]) is None, text(executed, i)
    assert "pulled 7" in text(executed, 10)  # sum([1,2,3]) + rank 1
    assert "script on rank 0" in text(executed, 11) and "[rank 1] script on rank 1" in text(executed, 11)


def test_targets_and_output_modes(executed):
    assert "only on 1" in text(executed, 12) and "only on 0" not in text(executed, 12)
    assert "quiet 0" in text(executed, 13) and "quiet 1" not in text(executed, 13)


def test_status_lists_ranks(executed):
    out = text(executed, 14)
    assert "2 ranks (local launcher), idle" in out
    assert "rank" in out and "pid" in out and "gpus" in out


def test_new_n_restarts_with_a_notice(executed):
    out = text(executed, 15)
    assert "engine state" in out and "reset" in out
    assert "world 1" in out or "fresh" in out
    assert "back to 2" in text(executed, 16)


def test_nothing_left_after_dist_stop(executed):
    assert "stopped the cluster of 2 ranks" in text(executed, 18)
    line = [ln for ln in text(executed, 19).splitlines() if ln.startswith("AFTER_STOP ")]
    assert line, text(executed, 19)
    left = json.loads(line[0][len("AFTER_STOP "):])
    assert left == {"pids": [], "shm": []}
    assert "no cluster is running" in text(executed, 20)


def test_engines_do_not_outlive_a_killed_kernel():
    """SIGKILL the notebook kernel: the watchdog and the engines' kernel watch clean up."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(h.ROOT))
    kc = km.client()
    kc.start_channels()
    outputs = []
    try:
        kc.wait_for_ready(timeout=60)

        def run(code):
            reply = kc.execute_interactive(code, timeout=180, output_hook=lambda m: outputs.append(m))
            shown = [m["content"].get("text") or m["content"].get("evalue")
                     or m["content"].get("data", {}).get("text/plain") for m in outputs]
            assert reply["content"]["status"] == "ok", (reply["content"], shown[-10:])

        run("%load_ext nbdist")
        warm = ("%%distributed -n 2\nimport nbdist.common as hvd, numpy as np\nhvd.init()\n"
                "hvd.allreduce(np.ones(2), name='warm')")
        try:
            run(warm)
        except AssertionError as exc:
            # Once in a full CI run this first cell failed (cause not found yet); say what
            # the kernel showed, and try once more: the test is about the clean-up below.
            print(f"first cell failed, retrying once: {exc}", file=sys.stderr)
            run(warm)
        run(h.FOOTPRINT)
        texts = [m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream"]
        fp = json.loads(next(t for t in "".join(texts).splitlines() if t.startswith("FOOTPRINT "))
                        [len("FOOTPRINT "):])
        assert len(fp["pids"]) >= 4
        os.kill(km.provisioner.pid, signal.SIGKILL)
        time.sleep(1)
        assert h.alive(fp["pids"], wait_s=20) == []
        assert h.shm_left(fp["shm"]) == []
    finally:
        kc.stop_channels()
        try:
            km.shutdown_kernel(now=True)
        except Exception:
            pass


def test_status_shows_the_transport_each_op_uses():
    """On one node the CPU ops run on shared memory; the status must say so (not 'mpi')."""
    nb = h.notebook(
        "%load_ext nbdist",
        "%%distributed -n 2\nimport nbdist.common as hvd\nhvd.init()",
        "%dist_status",
        "%dist_stop",
    )
    h.execute(nb, timeout=240)
    for i in (1, 2):
        assert h.error_of(nb.cells[i]) is None, h.text_of(nb.cells[i])
    status = h.text_of(nb.cells[2])
    assert status.count("cpu: shm") == 2, status
