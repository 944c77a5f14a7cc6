"""Which rank died first, seen from outside the MPI job.

When one rank dies, hydra kills every other rank with SIGKILL, and its exit-code report
then shows signal 9 for all of them: a rank killed by SIGKILL (the OOM killer, `kill -9`)
cannot be told from the ranks MPI stopped. A small process started with the cluster holds
a pidfd for each local rank and notes which are gone when the first one goes: that is the cause.
If several are gone by the time it looks (a loaded machine), it says so and names none.

It also reads the first dead rank's wait status from /proc while the process is still a
zombie (a pidfd wakes at exit, before hydra's proxy reaps it), so a death is named with its
status even when mpiexec's exit-code report comes late or never (it once took hydra more
than 40 s to stop the other ranks on this loaded 2-core machine).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading


def zombie_wait_status(pid: int) -> int | None:
    """A dead, not yet reaped process's wait status (as waitpid gives it), from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state); exit_code is field 52 (Linux >= 3.5), set only for zombies
    if fields[0] != "Z" or len(fields) < 50:
        return None
    try:
        return int(fields[49])
    except ValueError:
        return None


def _watch(pids_by_rank: dict[int, int]) -> dict:
    """Block until one of the processes exits; which ones are gone then, and their statuses."""
    fds: dict[int, int] = {}
    for rank, pid in pids_by_rank.items():
        try:
            fds[os.pidfd_open(pid)] = rank
        except OSError:  # already gone, or not ours to watch
            continue
    if not fds:
        return {"first": [], "status": {}}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    print("watching", flush=True)  # the parent waits for this: no death can be missed after it
    events = poller.poll()
    # One look right after the wake-up: the processes gone by now died first (MPI's SIGKILL
    # to the others takes hydra's proxy a wake-up and a kill() longer).
    gone = sorted({fds[fd] for fd, _ in events})
    status = {}
    for rank in gone:
        st = zombie_wait_status(pids_by_rank[rank])
        if st is not None:
            status[rank] = st
    reaped = [rank for rank in gone if rank not in status]
    if reaped and status:
        # Both kinds at the first look (a busy machine woke us late): hydra reaps the first
        # dead rank before it asks its proxies to kill the others, so the ranks already reaped
        # went first and the zombies are its clean-up kills. Their statuses come from mpiexec.
        return {"first": reaped, "status": {}}
    return {"first": gone, "status": status}


class DeathWatch:
    """Watches local rank processes; `first_dead()` is the set of ranks that died first.

    The watching is done by a small process of its own, blocked in poll(): woken by the
    first exit it needs only a CPU, not the notebook kernel's GIL, to look before MPI has
    stopped the others.
    """

    def __init__(self, pids_by_rank: dict[int, int], via: list[str] | None = None):
        """via: a command prefix that runs the watcher where the ranks are, e.g. [ssh, host]
        for ranks on another host (the same Python path there, as hydra assumes)."""
        self._first: set[int] = set()
        self._status: dict[int, int] = {}
        self._proc: subprocess.Popen | None = None
        if not hasattr(os, "pidfd_open") or not pids_by_rank:
            return
        args = [f"{rank}:{pid}" for rank, pid in sorted(pids_by_rank.items())]
        self._proc = subprocess.Popen([*(via or []), sys.executable, "-m", "nbdist.mpi.deaths", *args],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()  # "watching": pidfds held before any cell runs
        if ready.strip() != "watching":
            self.stop()
            return
        threading.Thread(target=self._read, name="nbdist-death-watch", daemon=True).start()

    def _read(self) -> None:
        proc = self._proc
        if proc is None or proc.stdout is None:
            return
        line = proc.stdout.readline()
        try:
            found = json.loads(line) if line else {}
        except ValueError:
            found = {}
        self._status = {int(r): int(s) for r, s in found.get("status", {}).items()}
        self._first = set(found.get("first", []))
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def first_dead(self) -> set[int]:
        """The ranks that died first (empty: none died yet, or pidfds are unavailable)."""
        return set(self._first)

    def first_dead_statuses(self) -> dict[int, int]:
        """Wait statuses of the first dead ranks, where /proc still had them."""
        return dict(self._status)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)


def main(argv: list[str]) -> int:
    pids = {int(r): int(p) for r, p in (a.split(":") for a in argv)}
    print(json.dumps(_watch(pids)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
