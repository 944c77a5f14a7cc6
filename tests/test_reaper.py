"""The notebook cluster's watchdog (python -m nbdist.mpi.reaper): when the kernel is gone it
kills the cluster's process trees, and never a process that only got one of their pids."""
from __future__ import annotations

import subprocess
import sys
import tempfile

import psutil
import pytest

from nbdist.mpi.reaper import watched_arg

pytestmark = pytest.mark.timeout(60)

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _reaper(kernel: subprocess.Popen, *watched: str) -> subprocess.Popen:
    me = psutil.Process(kernel.pid)
    return subprocess.Popen([sys.executable, "-m", "nbdist.mpi.reaper", str(kernel.pid), repr(me.create_time()),
                             tempfile.mkdtemp(prefix="nbdist-reaper-test-"), "0", *watched],
                            start_new_session=True)


def test_the_clusters_processes_are_killed_when_the_kernel_dies():
    kernel, mpiexec = subprocess.Popen(SLEEP), subprocess.Popen(SLEEP)
    try:
        reaper = _reaper(kernel, watched_arg(psutil.Process(mpiexec.pid)))
        kernel.kill()
        kernel.wait()
        assert reaper.wait(30) == 0
        assert mpiexec.wait(10) is not None
    finally:
        for p in (kernel, mpiexec):
            p.kill()
            p.wait()


def test_a_pid_now_anothers_is_not_killed():
    """CI's pids wrap at 32768: a watched process that is gone may have its pid taken by a rank
    of the next cluster. Here a live process stands for it, named with another start time."""
    kernel, bystander = subprocess.Popen(SLEEP), subprocess.Popen(SLEEP)
    try:
        start = psutil.Process(bystander.pid).create_time()
        reaper = _reaper(kernel, f"{bystander.pid}@{start - 100.0!r}")
        kernel.kill()
        kernel.wait()
        assert reaper.wait(30) == 0
        assert bystander.poll() is None, "the reaper killed a process that only had a watched pid"
    finally:
        for p in (kernel, bystander):
            p.kill()
            p.wait()
