"""`nbdist run --elastic --min-np 2 -n 4`: the batch twin of an elastic cell (real mpiexec, torch)."""
import json
import os
import subprocess
import time

import pytest

from conftest import ROOT

SCRIPT = str(ROOT / "tests" / "ranks" / "elastic_batch_train.py")


def _run(tmp_path, kill: str):
    env = dict(os.environ, NBDIST_TEST_KILL=kill, NBDIST_TEST_MARKER=str(tmp_path / "killed"),
               NBDIST_TIMEOUT_S="60")
    t0 = time.time()
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "nbdist"), "run", "--elastic", "--min-np", "2",
                           "-n", "4", "--timeout", "150", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=200)
    return proc, proc.stdout + proc.stderr, time.time() - t0


@pytest.mark.timeout(240)
def test_batch_run_goes_on_after_a_kill(tmp_path):
    since = time.time()
    proc, out, _ = _run(tmp_path, "7:2")
    assert proc.returncode == 0, out[-4000:]
    line = next(line for line in out.splitlines() if line.startswith("SUMMARY "))
    s = json.loads(line[len("SUMMARY "):])
    assert s["size"] == 3 and s["sizes"][0] == 4 and s["same_weights"] and s["complete"] == [True]
    assert "elastic: lost rank 2" in out and "resized 4 -> 3 ranks" in out
    assert "finished on 3 of 4 ranks" in out
    from nbdist.mpi.reaper import remove_orphan_segments

    assert remove_orphan_segments(since) == []  # nothing of the run was left in /dev/shm


@pytest.mark.timeout(240)
def test_batch_run_below_min_np_fails_clearly(tmp_path):
    proc, out, _ = _run(tmp_path, "5:1,2,3")
    assert proc.returncode == 1, out[-4000:]
    assert "below --min-np 2" in out and "lost rank 1" in out, out[-3000:]
