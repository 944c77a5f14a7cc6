"""`nbdist run`: the batch twin of a cell, with the same error reporting, on 2 and 4 ranks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NBDIST = str(Path(sys.executable).parent / "nbdist")

pytestmark = pytest.mark.timeout(240)


def _process_tree(pid: int) -> str:
    """Each process under `pid` (nbdist run, mpiexec, its proxy, the ranks): state, kernel
    wait channel, command line; what a hung run's failure message shows."""
    import psutil

    lines = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return "(the run's processes were gone)"
    for p in procs:
        try:
            wchan = Path(f"/proc/{p.pid}/wchan").read_text()
            lines.append(f"{p.pid} ppid {p.ppid()} {p.status()} wchan={wchan} "
                         f"{' '.join(p.cmdline())[:200]}")
        except (psutil.Error, OSError):
            continue
    return "processes of the run:\n" + "\n".join(lines)


def _kill_tree(pid: int) -> None:
    """Kill `pid`'s process group and every process under it: hydra starts each rank in a
    session of its own, which a group kill misses (a rank hung in MPI_Finalize lived on)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    os.killpg(pid, signal.SIGKILL)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def nbdist_run(tmp_path, body: str, n: int, *extra: str, timeout: float = 180):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    proc = subprocess.Popen([NBDIST, "run", "-n", str(n), *extra, str(script), "alpha", "--beta"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "NBDIST_TIMEOUT_S": "60"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = _process_tree(proc.pid)  # where it hung, before the kill removes it
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"nbdist run did not finish in {timeout} s\n{out}\n{err}\n{tree}")
    return proc.returncode, out, err


@pytest.mark.parametrize("n", [2, 4])
def test_demo_prints_a_checked_distributed_result(n):
    proc = subprocess.run([NBDIST, "run", "-n", str(n), "examples/demo.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"nbdist demo on {n} ranks" in proc.stdout
    assert f"= 999999 * {n * (n + 1) // 2}" in proc.stdout
    assert "checked on every rank: OK" in proc.stdout


def test_script_args_env_and_tagged_output(tmp_path):
    rc, out, err = nbdist_run(tmp_path, """
        import os, sys
        rank = int(os.environ["PMI_RANK"])
        print("args", sys.argv[1:], "flavour", os.environ["FLAVOUR"], "rank", rank)
    """, 2, "--env", "FLAVOUR=mint")
    assert rc == 0, out + err
    assert "[0] args ['alpha', '--beta'] flavour mint rank 0" in out
    assert "[1] args ['alpha', '--beta'] flavour mint rank 1" in out


@pytest.mark.parametrize("n", [2, 4])
def test_raise_while_peers_wait_in_allreduce(tmp_path, n):
    rc, out, err = nbdist_run(tmp_path, """
        import time
        import numpy as np
        import nbdist.common as hvd
        hvd.init()
        def load_batch():
            raise ValueError("corrupt batch on rank 1")
        if hvd.rank() == 1:
            time.sleep(0.5)
            load_batch()
        hvd.allreduce(np.ones(4), name="grads")
    """, n)
    assert rc != 0
    assert "nbdist: rank 1 raised ValueError: corrupt batch on rank 1" in err
    assert err.index("traceback of rank 1") < err.index("load_batch")
    assert "AbortedError" in err, "peers are released by the abort and reported as follow-ons"
    assert "BAD TERMINATION" not in out + err, "hydra's banner is replaced by our summary"


def test_rank_death_is_named_with_exit_status(tmp_path):
    rc, out, err = nbdist_run(tmp_path, """
        import os, time
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            os._exit(7)
        time.sleep(60)
    """, 2)
    if "mpiexec did not report" in err:  # hydra missed the exit (see the test below), and so did our read
        assert rc == 1 and "rank 1 died (mpiexec did not report its exit status)" in err, out + err
    else:
        assert rc == 7, out + err
        assert "rank 1 died (exit status 7)" in err
    assert "rank 1 was stopped" not in err, err  # the dead rank is not among those stopped after it


def test_a_death_mpiexec_misses_still_ends_the_run(tmp_path):
    """hydra once missed a rank's _exit and its peer waited in MPI_Finalize for ever (CI, 8c990e5;
    pmodels/mpich#7057). Made certain here: hydra's proxy is stopped (SIGSTOP) before rank 1 is
    killed, so nothing of MPI's acts on the death; nbdist run's own watch must end the run."""
    import psutil

    script = tmp_path / "script.py"
    script.write_text("import time\nfrom mpi4py import MPI\nprint('ready', flush=True)\ntime.sleep(60)\n")
    run = subprocess.Popen([NBDIST, "run", "-n", "2", str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    proxy = None
    try:
        assert run.stdout is not None
        for _ in range(2):
            assert "ready" in run.stdout.readline()
        proxy = next(p for p in psutil.Process(run.pid).children(recursive=True) if p.name() == "hydra_pmi_proxy")
        ranks = {int(p.environ()["PMI_RANK"]): p for p in proxy.children()}
        proxy.suspend()
        ranks[1].kill()
        out, err = run.communicate(timeout=60)
        assert run.returncode == 137, out + err
        assert "rank 1 died (killed by signal 9 (SIGKILL))" in err, err
        assert "rank 0 was stopped by nbdist run after the failure" in err, err
        assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE, "rank 0 was left running"
    finally:
        if run.poll() is None:
            _kill_tree(run.pid)
        if proxy is not None and proxy.is_running():
            proxy.kill()
        run.communicate()


def test_timeout_stops_every_rank(tmp_path):
    rc, out, err = nbdist_run(tmp_path, """
        import time
        print("started", flush=True)
        time.sleep(120)
    """, 2, "--timeout", "3", timeout=60)
    assert rc == 124, out + err
    assert "longer than --timeout 3 s" in err


def test_missing_script_is_a_clear_error(tmp_path):
    proc = subprocess.run([NBDIST, "run", "-n", "2", str(tmp_path / "nope.py")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "no such script" in proc.stderr
