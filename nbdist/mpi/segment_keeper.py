"""Removes a rank's shared-memory segments on its own host once the rank is gone.

The notebook kernel's reaper and `nbdist run` can sweep /dev/shm only on the machine they
run on. A rank on another host that is killed (SIGKILL, the OOM killer, MPI's clean-up
after a peer's death, a lost ssh link) leaves MPICH's `mpich_shm_*` and nbdist's own
segments in that host's /dev/shm, where nobody else looks. So each rank started on
another host spawns this small keeper beside it: it notes the segments the rank maps
(MPI maps some late, so it looks again now and then) and, once the rank has exited,
removes those that no process on the host still holds. It waits in poll() on a pidfd,
so it costs no CPU while the rank runs.

Usage: python -m nbdist.mpi.segment_keeper RANK_PID START_TIME [--settle S]
                                            [--report-dir DIR --rank R]
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

from ..wire import read_start_records, write_death_record
from .deaths import pid_alive
from .reaper import SETTLE_S, remove_orphan_segments, segments_of

FIRST_LOOK_S = 0.5
MAX_LOOK_S = 8.0  # MPI maps a new communicator's segment when it is created, at any time


def start_if_remote(watcher_host: str | None, report_dir: str | None = None,
                    rank: int | None = None) -> None:
    """Spawn the keeper for the calling rank when it runs on another host than the side that
    watches it (the notebook kernel, `nbdist run`), whose own sweep cannot reach here.
    In its own session: MPI's clean-up kills the rank's process group, and the keeper must
    outlive the rank. With report_dir (`nbdist run`), it records there which ranks of this
    host still ran when its rank exited. Never raises."""
    if not watcher_host or watcher_host == socket.gethostname():
        return
    try:
        record = ["--report-dir", report_dir, "--rank", str(rank)] if report_dir and rank is not None else []
        subprocess.Popen([sys.executable, "-m", "nbdist.mpi.segment_keeper", str(os.getpid()),
                          repr(time.time()), *record],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError:
        pass


def _wait_for_exit(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (False: still running after `timeout` seconds)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (old kernel): look at it instead
        time.sleep(timeout)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return _is_zombie(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def keep(pid: int, since: float, settle_s: float = SETTLE_S, report_dir: str | None = None,
         rank: int | None = None) -> list[str]:
    """Watch the rank until it exits, then remove its unheld segments; the ones removed."""
    import psutil

    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return remove_orphan_segments(since)
    seen: set[str] = set()
    look = FIRST_LOOK_S
    while True:
        seen |= segments_of([proc])
        if _wait_for_exit(pid, look):
            break
        look = min(look * 2, MAX_LOOK_S)
    _record_death(report_dir, rank)
    return remove_orphan_segments(since, known=seen, settle_s=settle_s)


def _record_death(report_dir: str | None, rank: int | None) -> None:
    """Under `nbdist run`, tell the launcher which ranks of this host still ran when this one
    was seen gone (its report folder is in the shared working directory): hydra's banner names
    only the host of a death. Which ranks still run, not when this keeper woke: on a loaded
    machine a keeper wakes late, and the rank MPI killed after the first death was once named
    first from wake-up times (CI)."""
    if not report_dir or rank is None:
        return
    host = socket.gethostname()
    alive = []
    try:
        for rec in read_start_records(report_dir):
            if rec.get("host") == host and rec.get("rank") != rank and pid_alive(int(rec["pid"])):
                alive.append(int(rec["rank"]))
        write_death_record(report_dir, rank, host, alive)
    except OSError:  # the run is over and its folder gone: nobody asks any more
        pass


def main(argv: list[str]) -> int:
    # The rank's Ctrl-C and a dropped ssh session are not ours to die of.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    import argparse

    parser = argparse.ArgumentParser(prog="python -m nbdist.mpi.segment_keeper")
    parser.add_argument("pid", type=int)
    parser.add_argument("since", type=float)
    parser.add_argument("--settle", type=float, default=SETTLE_S)
    parser.add_argument("--report-dir")
    parser.add_argument("--rank", type=int)
    args = parser.parse_args(argv)
    keep(args.pid, args.since, args.settle, args.report_dir, args.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
