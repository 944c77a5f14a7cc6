"""Shared test helpers: run a file on N MPI ranks, bounded, and report each rank's output.

Multi-rank tests live in tests/ranks/ and run *inside* `mpiexec -n N pytest ...`
(every rank runs the same tests in the same order). The outer suite starts those
runs through `run_ranks`, so one hung collective fails one test, not the CI run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbdist.mpi.hydra import mpiexec_path
from nbdist.mpi.reaper import orphan_segments

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = mpiexec_path()  # the one finder: this environment's mpich wheel, else PATH's

LEAK_SETTLE_S = 20  # a killed cluster's segments are swept by its reaper a moment later
_SESSION: dict = {}

# The rank-level test files are collected only inside an mpiexec run.
collect_ignore_glob = [] if os.environ.get("NBDIST_RANK_TESTS") else ["ranks/*"]


def rank_env(**extra: str) -> dict:
    """The environment for ranks: quick timeouts so a broken test fails fast."""
    env = dict(os.environ)
    env.setdefault("NBDIST_TIMEOUT_S", "60")
    env["NBDIST_RANK_TESTS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_ranks(n: int, args: list[str], timeout: float = 240, env: dict | None = None,
              check: bool = True, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `python args...` on n ranks under mpiexec, killing the whole group on timeout;
    `wrapper` goes before python on each rank's command line (e.g. setpriv and its options)."""
    cmd = [MPIEXEC, "-n", str(n), *wrapper, sys.executable, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or rank_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{n} ranks did not finish within {timeout} s: {' '.join(args)}\n{out[-6000:]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        pytest.fail(f"{n} ranks failed (exit {proc.returncode}): {' '.join(args)}\n{out[-8000:]}")
    return result


def run_rank_tests(n: int, test_file: str, timeout: float = 300, extra_env: dict | None = None,
                   pytest_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run one tests/ranks/ file with pytest on n ranks; every rank must pass."""
    env = rank_env(**(extra_env or {}))
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--timeout", "120",
            str(ROOT / "tests" / "ranks" / test_file), *pytest_args]
    return run_ranks(n, args, timeout=timeout, env=env)


def pytest_sessionstart(session):
    _SESSION["since"] = time.time()
    try:  # segments that were there before (another user's job, an earlier run) are not ours
        _SESSION["before"] = {entry.path for entry in os.scandir("/dev/shm")}
    except OSError:
        _SESSION["before"] = set()


def pytest_sessionfinish(session, exitstatus):
    """Every test removes the shared-memory segments its processes made (MPI's and nbdist's):
    fail the run when one is left that no process holds."""
    if "since" not in _SESSION or os.environ.get("NBDIST_RANK_TESTS"):
        return  # (inside a ranks run the outer session looks, once the ranks are gone)
    deadline = time.monotonic() + LEAK_SETTLE_S
    while True:
        left = sorted(set(orphan_segments(_SESSION["since"])) - _SESSION["before"])
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left:
        sys.stderr.write(f"\nshared-memory segments left by the tests (no process holds them): {left}\n")
        session.exitstatus = 1
