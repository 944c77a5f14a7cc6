"""Several hosts for real, on simulated hosts (network namespaces with their own address,
hostname and sshd; see tests/multinode/simhosts.py): one MPI world across hosts through
hydra's ssh launcher, topology, the two-level collectives at 2x2 and 3+1, a torch
training run. `pytest -m multinode` runs these alone. They skip, with the reason,
where namespaces or sshd cannot be started (not root, no openssh-server).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MPIEXEC, ROOT, rank_env
from multinode.simhosts import SimHosts, Unavailable

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(600)]

LAYOUTS = {  # hydra host list -> each rank's host, in rank order
    "2x2": ("h1:2,h2:2", "h1,h1,h2,h2"),
    "3+1": ("h1:3,h2:1", "h1,h1,h1,h2"),
    # one slot per host: hydra deals ranks round robin, so a host's ranks are not consecutive
    "alternating": ("h1:1,h2:1", "h1,h2,h1,h2"),
}
EVEN_AND_UNEVEN = ["2x2", "3+1"]


@pytest.fixture(scope="module")
def hosts():
    """Two simulated hosts h1 and h2, torn down (namespaces, sshd, processes) even on failure."""
    sim = SimHosts(["h1", "h2"])
    try:
        sim.start()
    except Unavailable as exc:
        pytest.skip(f"simulated hosts unavailable: {exc}")
    try:
        yield sim
    finally:
        sim.stop()


def run_on_hosts(sim: SimHosts, hostlist: str, n: int, args: list[str], timeout: float = 300,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """`python args` on n ranks placed by hydra's ssh launcher on the simulated hosts."""
    cmd = [MPIEXEC, "-launcher", "ssh", "-hosts", hostlist, "-localhost", sim.controller_address,
           "-n", str(n), sys.executable, *args]
    full_env = {**rank_env(), **sim.env(), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"ranks on {hostlist} did not finish within {timeout} s\n{out[-6000:]}")
    finally:
        left = sim.wait_clean()
        segments = sim.wait_no_segments()
    assert not left, f"processes left behind on the hosts: {left}"
    assert not segments, f"shared-memory segments left behind on the hosts: {segments}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def rank_pytest(sim, layout: str, test_file: str, *pytest_args: str, timeout: float = 300):
    hostlist, placement = LAYOUTS[layout]
    n = len(placement.split(","))
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--timeout", "180",
            str(ROOT / "tests" / test_file), *pytest_args]
    result = run_on_hosts(sim, hostlist, n, args, timeout=timeout,
                          env={"NBDIST_TEST_PLACEMENT": placement})
    assert result.returncode == 0, f"{layout}: {test_file} failed\n{result.stdout[-8000:]}"
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_world_topology_and_transports(hosts, layout):
    rank_pytest(hosts, layout, "multinode/rank_topology.py")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_level_transport_every_op_and_dtype(hosts, layout):
    # Every op and dtype, sizes across the shm small/large paths, every root.
    rank_pytest(hosts, layout, "ranks/native_hierarchical.py", "-k", "not test_topology_and_choice")


@pytest.mark.parametrize("layout", EVEN_AND_UNEVEN)
def test_runtime_collectives_against_numpy(hosts, layout):
    # The runtime level (negotiation over MPI across hosts, fusion, every collective).
    # Its first test assumes equal hosts (cross_size * local_size == size).
    deselect = [] if layout == "2x2" else ["-k", "not test_init_twice_and_topology"]
    rank_pytest(hosts, layout, "ranks/common_collectives.py", *deselect)


@pytest.mark.parametrize("layout", EVEN_AND_UNEVEN)
def test_torch_training_identical_weights(hosts, layout):
    pytest.importorskip("torch")
    # 2x2 runs the whole training suite; 3+1 the runs that compare weights (keeps CI short)
    subset = [] if layout == "2x2" else ["-k", "same_parameters or sync_batch_norm or broadcast_parameters"]
    rank_pytest(hosts, layout, "ranks/torch_training.py", *subset)


# ---- the notebook across hosts: %dist_start --launcher ssh, faults, clean-up -------------------

TOPOLOGY_CELL = '''%%distributed
import socket
import numpy as np
import nbdist.common as hvd
hvd.init()
total = hvd.allreduce(np.array([hvd.rank()], np.int64), op=hvd.Sum, name="sum")
print("TOPO", hvd.rank(), socket.gethostname(), hvd.local_rank(), hvd.local_size(),
      hvd.cross_rank(), hvd.cross_size(), int(total[0]))
'''

KILL_REMOTE_CELL = '''%%distributed
import os, time
import numpy as np
x = hvd.allreduce(np.ones(4), name="before")
if hvd.rank() == 3:
    os.kill(os.getpid(), 9)
t0 = time.time()
while time.time() - t0 < 60:
    hvd.allreduce(np.ones(4), name="loop")
'''

AFTER_CELL = '''%%distributed
import socket
import numpy as np
import nbdist.common as hvd
hvd.init()
print("AFTER", hvd.rank(), socket.gethostname(), int(hvd.allreduce(np.array([1]), op=hvd.Sum, name="a")[0]))
'''


def _ssh_cut_cell(marker: str) -> str:
    return f'''%%distributed
import os, time
import numpy as np
if hvd.rank() == 3:
    open({marker!r}, "w").close()  # tells the test the cell is running
t0 = time.time()
while time.time() - t0 < 60:
    hvd.allreduce(np.ones(4), name="loop2")
'''


def _after_rows(cell) -> list[list[str]]:
    """[rank, host, total] of each rank's AFTER line, in rank order."""
    from nbharness import text_of

    rows = [ln.split()[ln.split().index("AFTER") + 1:] for ln in text_of(cell).splitlines() if "AFTER" in ln]
    return sorted(rows, key=lambda p: int(p[0]))


def _seconds(cell) -> float:
    """How long the cell ran, from nbclient's timing record."""
    from datetime import datetime

    meta = cell.metadata.get("execution", {})
    start, end = meta.get("iopub.execute_input"), meta.get("shell.execute_reply")
    parse = lambda t: datetime.fromisoformat(t.replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds() if start and end else float("nan")


def test_notebook_across_hosts_with_faults(hosts):
    """%dist_start --launcher ssh --hosts h1:2,h2:2: one world, topology, %dist_status hosts; a
    killed remote rank and an ssh cut fail their cell promptly naming rank/host; the next cell
    works after the restart; nothing is left on any host or here."""
    import threading

    from nbharness import error_of, execute, notebook, text_of

    marker = str(hosts.dir / "cell-running")
    nb = notebook(
        f"import os\nos.environ['HYDRA_LAUNCHER_EXEC'] = {hosts.ssh!r}\n%load_ext nbdist",
        "%dist_start -n 4 --launcher ssh --hosts h1:2,h2:2",
        TOPOLOGY_CELL,
        "%dist_status",
        KILL_REMOTE_CELL,
        AFTER_CELL,
        _ssh_cut_cell(marker),
        AFTER_CELL,
        "%dist_stop",
    )
    cut = {}

    def cut_when_running():
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not os.path.exists(marker):
            time.sleep(0.1)
        if os.path.exists(marker):
            time.sleep(1.0)
            cut["pids"] = hosts.cut_ssh("h2")

    cutter = threading.Thread(target=cut_when_running, daemon=True)
    cutter.start()
    execute(nb, timeout=300)
    cells = nb.cells
    start, topo, status, killed, after1, sshcut, after2, stop = (cells[i] for i in range(1, 9))
    assert error_of(start) is None, text_of(start)

    lines = [ln.split() for ln in text_of(topo).splitlines() if "TOPO" in ln]
    rows = sorted((int(p[p.index("TOPO") + 1]), p[p.index("TOPO") + 2:]) for p in lines)
    assert [r for r, _ in rows] == [0, 1, 2, 3], text_of(topo)
    assert [p[0] for _, p in rows] == ["h1", "h1", "h2", "h2"]
    assert [tuple(map(int, p[1:])) for _, p in rows] == [
        (0, 2, 0, 2, 6), (1, 2, 0, 2, 6), (0, 2, 1, 2, 6), (1, 2, 1, 2, 6)]

    status_text = text_of(status)
    assert "on h1 (ranks 0-1), h2 (ranks 2-3)" in status_text, status_text
    assert "hierarchical" in status_text, status_text

    err = error_of(killed)
    assert err is not None, text_of(killed)
    # hydra names the host; h2's death watch (run there over ssh) names the rank; where it
    # cannot tell (several ranks gone when it looked), the host's ranks are named instead
    assert re.search(r"rank 3 on h2 died \(killed by signal 9 \(SIGKILL\)|"
                     r"a rank on h2 died \(killed by signal 9 \(SIGKILL\).*ranks 2-3 ran there",
                     text_of(killed)), text_of(killed)
    assert "when rank 0 died" not in text_of(killed)
    assert _seconds(killed) < 60, f"the killed-rank cell took {_seconds(killed)} s"
    after = _after_rows(after1)
    assert len(after) == 4 and all(p[-1] == "4" for p in after), text_of(after1)

    assert cut.get("pids"), "the ssh connection to h2 was never found to cut"
    assert error_of(sshcut) is not None, text_of(sshcut)
    assert "host h2 was lost" in text_of(sshcut) and "ranks 2-3" in text_of(sshcut), text_of(sshcut)
    assert _seconds(sshcut) < 60, f"the ssh-cut cell took {_seconds(sshcut)} s"
    after = _after_rows(after2)
    assert len(after) == 4 and [p[1] for p in after] == ["h1", "h1", "h2", "h2"], text_of(after2)
    assert error_of(stop) is None, text_of(stop)

    assert not hosts.wait_clean(), "processes left on the hosts"
    assert not hosts.wait_no_segments(), f"segments left on the hosts: {hosts.wait_no_segments(0)}"
    deadline = time.monotonic() + 15
    while hosts.root_leftovers() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not hosts.root_leftovers(), hosts.root_leftovers()


# ---- the batch twin: nbdist run --hosts ------------------------------------------------------

def _nbdist_run(sim, tmp_path, mode: str, *extra: str, env: dict | None = None, timeout: float = 150):
    cmd = [str(Path(sys.executable).parent / "nbdist"), "run", "-n", "4", *extra,
           str(ROOT / "tests" / "multinode" / "batch_script.py"), mode]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **sim.env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def _run_rows(stdout: str) -> list[list[str]]:
    rows = [ln.split()[ln.split().index("RUN") + 1:] for ln in stdout.splitlines() if "RUN" in ln.split()]
    return sorted(rows, key=lambda p: int(p[0]))


def test_nbdist_run_across_hosts(hosts, tmp_path):
    """nbdist run -n 4 --hosts h1:2,h2:2 (horovodrun -H): one world; a killed remote rank and an
    ssh cut fail the run promptly naming the host; nothing is left on any host."""
    import threading

    proc, _ = _nbdist_run(hosts, tmp_path, "ok", "--hosts", "h1:2,h2:2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _run_rows(proc.stdout) == [["0", "h1", "0", "2", "0", "2", "6"], ["1", "h1", "1", "2", "0", "2", "6"],
                                      ["2", "h2", "0", "2", "1", "2", "6"], ["3", "h2", "1", "2", "1", "2", "6"]]
    assert "Exit codes" not in proc.stdout and "[h2] 0,0" not in proc.stdout, proc.stdout

    proc, took = _nbdist_run(hosts, tmp_path, "kill", "-H", "h1:2,h2:2")
    assert proc.returncode != 0
    # hydra names the host; the segment keepers there record which rank exited first, and
    # where that is not certain the host's ranks are named instead - never the wrong rank
    assert re.search(r"rank 3 on h2 died \(killed by signal 9 \(SIGKILL\), as hydra reports it\)|"
                     r"a rank on h2 died \(killed by signal 9 \(SIGKILL\).*ranks 2-3 ran there",
                     proc.stderr), proc.stderr
    assert "rank 2 on h2 died" not in proc.stderr, proc.stderr
    assert took < 60
    assert not hosts.wait_clean(), "processes left on the hosts"
    assert not hosts.wait_no_segments(), f"segments left on the hosts: {hosts.wait_no_segments(0)}"

    marker = tmp_path / "running"

    def cut_when_running():
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        hosts.cut_ssh("h2")

    threading.Thread(target=cut_when_running, daemon=True).start()
    proc, took = _nbdist_run(hosts, tmp_path, "loop", "--hosts", "h1:2,h2:2", env={"MARK": str(marker)})
    assert proc.returncode == 255, proc.stdout + proc.stderr
    assert "host h2 was lost (hydra's ssh connection to it ended): ranks 2-3 on h2" in proc.stderr, proc.stderr
    assert took < 40, f"the run took {took:.0f} s after the cut"  # the loop alone runs 40 s
    assert not hosts.wait_clean(), "processes left on the hosts"
    assert not hosts.wait_no_segments(), f"segments left on the hosts: {hosts.wait_no_segments(0)}"
    assert not hosts.root_leftovers(), hosts.root_leftovers()
    assert [p.name for p in tmp_path.iterdir()] == ["running"], "the run left files behind"


def test_nbdist_run_bad_hosts_say_why(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    nbdist = str(Path(sys.executable).parent / "nbdist")
    for hosts, words in [("h1:2,h2:x", "slots must be a positive whole number"),
                         ("h1:1,h2:1", "-n 4 needs 4 slots, but --hosts h1:1,h2:1 gives 2"),
                         ("h1:2,h1:2", "h1 appears twice")]:
        proc = subprocess.run([nbdist, "run", "-n", "4", "--hosts", hosts, str(script)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, (hosts, proc.stderr)


# ---- Slurm: a one-node cluster started by the test ---------------------------------------------

@pytest.fixture(scope="module")
def slurm():
    """slurmctld + slurmd (+ a private munged) on loopback; every job cancelled at the end."""
    from multinode.simslurm import SimSlurm
    from multinode.simslurm import Unavailable as SlurmUnavailable

    cluster = SimSlurm()
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"slurm unavailable: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


SLURM_CELL = '''%%distributed
import os
import numpy as np
import nbdist.common as hvd
hvd.init()
s = hvd.allreduce(np.array([hvd.rank() + 1]), op=hvd.Sum, name="s")
print("SLURM", hvd.rank(), hvd.size(), os.environ.get("SLURM_JOB_ID", "none"), int(s[0]))
'''


def test_slurm_cell_and_batch_job(slurm, tmp_path):
    """%dist_start --launcher slurm: ipyparallel's Slurm launcher submits the engines as one
    job whose mpiexec makes the world; a 2-rank cell runs in it. nbdist run --launcher slurm
    asks salloc for an allocation, and inside one (salloc nbdist run ...) uses it."""
    from nbharness import error_of, execute, notebook, text_of

    nb = notebook(
        f"import os\nos.environ['SLURM_CONF'] = {str(slurm.conf)!r}\n%load_ext nbdist",
        "%dist_start -n 2 --launcher slurm",
        SLURM_CELL,
        "%dist_stop",
    )
    execute(nb, timeout=200)
    start, cell, stop = nb.cells[1], nb.cells[2], nb.cells[3]
    assert error_of(start) is None, text_of(start)
    rows = sorted(ln.split()[ln.split().index("SLURM") + 1:] for ln in text_of(cell).splitlines()
                  if "SLURM" in ln.split())
    assert len(rows) == 2 and all(r[1] == "2" and r[3] == "3" for r in rows), text_of(cell)
    assert rows[0][2] != "none" and rows[0][2] == rows[1][2], "the ranks are not in one Slurm job"
    assert error_of(stop) is None, text_of(stop)
    strays = sorted(p.name for p in ROOT.iterdir() if p.name.startswith("slurm"))
    assert not strays, f"the Slurm launcher left files in the notebook's folder: {strays}"

    script = tmp_path / "train.py"
    script.write_text(
        "import os, numpy as np, nbdist.common as hvd\nhvd.init()\n"
        "s = hvd.allreduce(np.array([hvd.rank() + 1]), op=hvd.Sum, name='s')\n"
        "print('BATCH', hvd.rank(), hvd.size(), os.environ.get('SLURM_JOB_ID', 'none'), int(s[0]))\n")
    nbdist = str(Path(sys.executable).parent / "nbdist")
    env = {**os.environ, **slurm.env()}
    for cmd in ([nbdist, "run", "-n", "2", "--launcher", "slurm", str(script)],
                ["salloc", "--quiet", "-n", "2", nbdist, "run", "-n", "2", "--launcher", "slurm", str(script)]):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (cmd, proc.stdout, proc.stderr)
        rows = sorted(ln.split()[ln.split().index("BATCH") + 1:] for ln in proc.stdout.splitlines()
                      if "BATCH" in ln.split())
        assert [r[:2] for r in rows] == [["0", "2"], ["1", "2"]] and rows[0][3] == "3", proc.stdout
        assert rows[0][2] != "none", "not run inside a Slurm allocation"
    deadline = time.monotonic() + 20
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not slurm.jobs(), f"Slurm jobs left behind: {slurm.jobs()}"


def test_kernel_killed_leaves_nothing_on_any_host(hosts, tmp_path):
    """The notebook kernel dies (SIGKILL) with a cluster on h1 and h2: its reaper stops mpiexec,
    each host's hydra proxy then kills its ranks; nothing is left on any host or here."""
    ready = tmp_path / "ready"
    kernel = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from nbdist.notebook.cluster import DistCluster\n"
         "c = DistCluster()\n"
         "c.start(4, 'ssh', ['h1:2', 'h2:2'])\n"
         f"open({str(ready)!r} + '.part', 'w').write(' '.join(i.host for _, i in sorted(c.ranks.items())))\n"
         f"import os; os.replace({str(ready)!r} + '.part', {str(ready)!r})\n"
         "time.sleep(600)\n"],
        env={**os.environ, **hosts.env()}, cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists() and kernel.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), f"the cluster did not start: {kernel.stdout.read() if kernel.poll() is not None else ''}"
        assert ready.read_text() == "h1 h1 h2 h2"
        assert hosts.leftovers("h2"), "no ranks running on h2 before the kill"
        os.kill(kernel.pid, signal.SIGKILL)
        kernel.wait(10)
        left = hosts.wait_clean(timeout=30)
        assert not left, f"left on the hosts after the kernel died: {left}"
        assert not hosts.wait_no_segments(), f"segments left on the hosts: {hosts.wait_no_segments(0)}"
        deadline = time.monotonic() + 15
        while hosts.root_leftovers() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not hosts.root_leftovers(), hosts.root_leftovers()
    finally:
        if kernel.poll() is None:
            os.killpg(kernel.pid, signal.SIGKILL)
