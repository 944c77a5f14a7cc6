"""Several hosts for real, on simulated hosts (network namespaces with their own address,
hostname and sshd; see tests/multinode/simhosts.py): one MPI world across hosts through
hydra's ssh launcher, topology, the two-level collectives at 2x2 and 3+1, a torch
training run. `pytest -m multinode` runs these alone. They skip, with the reason,
where namespaces or sshd cannot be started (not root, no openssh-server).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

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
    assert not left, f"processes left behind on the hosts: {left}"
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
    rank_pytest(hosts, layout, "ranks/torch_training.py")
