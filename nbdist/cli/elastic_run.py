"""`nbdist run --elastic --min-np M -n N script.py`: the batch twin of an elastic cell.

The same mechanism as the notebook (docs/elastic.md) with this process as the driver:
mpiexec with -disable-auto-cleanup runs each rank under nbdist.rank.survive, so a killed
rank leaves the others running; rank 0 publishes the first world (every rank's pid) in a
private folder at hvd.init(); when a rank's process is gone this driver publishes the
survivors' world (nbdist.common.world), and hvd.elastic.run on the survivors rebuilds it and
goes on from the last commit. Below --min-np it publishes an abort: the survivors fail with
the reason and the run exits 1. One node only. Growing is the notebook's (%dist_scale,
--max-np): a batch run has no new hosts to discover.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..common.world import ELASTIC_DIR_ENV, exit_marker, lost_members, read_plan, write_plan
from ..mpi import reaper
from ..mpi.hydra import mpiexec_path, parse_exit_codes
from .run import _env_dict, _pump, _stop

POLL_S = 0.05


def _say(text: str) -> None:
    print(f"nbdist: {text}", file=sys.stderr, flush=True)


def run_elastic(script: str, args: list[str], n: int, min_np: int, timeout: float | None = None,
                env: list[str] | dict[str, str] | None = None) -> int:
    """Run script on n ranks elastically; return the exit status (0: the survivors finished)."""
    if not os.path.isfile(script):
        _say(f"no such script: {script}")
        return 2
    if not 1 <= min_np <= n:
        _say(f"--min-np must be between 1 and -n ({n}), got {min_np}")
        return 2
    try:
        extra = _env_dict(env)
    except ValueError as exc:
        _say(str(exc))
        return 2
    folder = tempfile.mkdtemp(prefix="nbdist-elastic-")  # 0700: the plans stay private
    started = time.time()
    cmd = [mpiexec_path(), "-print-all-exitcodes", "-disable-auto-cleanup", "-n", str(n),
           sys.executable, "-m", "nbdist.rank.survive", sys.executable, "-u", script, *args]
    run_env = {**os.environ, **extra, ELASTIC_DIR_ENV: folder, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=run_env, start_new_session=True)
    captured: list[str] = []
    pump = threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, captured), daemon=True)
    pump.start()
    lost: list[int] = []  # ranks (numbered as mpiexec started them) that died
    failed = ""
    aborted = False  # below --min-np: the survivors were told to stop and end by themselves
    original: list[int] | None = None
    try:
        while proc.poll() is None:
            if timeout and time.time() - started > timeout:
                failed = f"the run took longer than --timeout {timeout:g} s"
                break
            plan = read_plan(folder)
            if plan is None or plan.get("abort"):
                time.sleep(POLL_S)
                continue
            if original is None:
                original = list(plan["pids"])
            pids = list(plan["pids"])
            # a rank whose program ended left a marker: finished, not lost
            dead = [i for i in lost_members(pids) if not os.path.exists(exit_marker(folder, pids[i]))]
            if not dead:
                time.sleep(POLL_S)
                continue
            gone = [pids[i] for i in dead]
            lost += [original.index(p) for p in gone if p in original]
            survivors = [p for p in pids if p not in gone]
            names = ", ".join(f"rank {i} (pid {pids[i]})" for i in dead)
            generation = int(plan["generation"]) + 1
            if len(survivors) < min_np:
                failed = (f"the elastic run lost {names}: {len(survivors)} rank"
                          f"{'s' if len(survivors) != 1 else ''} left, below --min-np {min_np}")
                write_plan(folder, {"generation": generation, "pids": survivors, "joiners": [],
                                    "abort": failed})
                aborted = True
                break
            write_plan(folder, {"generation": generation, "pids": survivors, "joiners": [], "abort": ""})
            _say(f"elastic: lost {names}; resized {len(pids)} -> {len(survivors)} ranks "
                 f"(generation {generation}); resuming from the last commit")
        if aborted:
            _end(proc, wait_s=10.0)
        elif failed:
            _stop(proc)
        proc.wait()
    except KeyboardInterrupt:
        failed = "interrupted"
        _stop(proc)
    finally:
        pump.join(5.0)
        tree = reaper.process_trees([proc.pid])
        reaper.kill_procs([p for p in tree if reaper._alive(p.pid)], grace_s=2.0)
        reaper.remove_orphan_segments(started, settle_s=reaper.SETTLE_S if lost else 0.0)
        shutil.rmtree(folder, ignore_errors=True)
    if failed:
        _say(failed)
        return 1
    statuses = parse_exit_codes("".join(captured), {socket.gethostname(): list(range(n))})
    bad = {r: s for r, s in statuses.items() if s != 0 and r not in lost}
    if bad or (proc.returncode != 0 and not statuses and not lost):
        _say(f"rank{'s' if len(bad) != 1 else ''} {', '.join(map(str, sorted(bad)))} failed "
             f"(exit statuses {bad})" if bad else f"mpiexec exited with status {proc.returncode}")
        return 1
    if lost:
        _say(f"elastic: finished on {n - len(lost)} of {n} ranks (lost: "
             f"{', '.join(map(str, sorted(lost)))})")
    return 0


def _end(proc: subprocess.Popen, wait_s: float) -> None:
    """Give the ranks wait_s to end by themselves (they got the abort), then stop them as
    nbdist run stops its ranks."""
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
