"""Which rank died first, seen from outside the MPI job.

When one rank dies, hydra kills every other rank with SIGKILL, and its exit-code report
then shows signal 9 for all of them: a rank killed by SIGKILL (the OOM killer, `kill -9`)
cannot be told from the ranks MPI stopped. A thread in the notebook kernel holds a pidfd
for each local rank and notes which are gone when the first one goes: that is the cause.
If several are gone by the time it looks (a loaded machine), it says so and names none.

It also reads the first dead rank's wait status from /proc while the process is still a
zombie (a pidfd wakes at exit, before hydra's proxy reaps it), so a death is named with its
status even when mpiexec's exit-code report comes late or never (it once took hydra more
than 40 s to stop the other ranks on this loaded 2-core machine).
"""
from __future__ import annotations

import os
import select
import threading
import time


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


class DeathWatch:
    """Watches local rank processes; `first_dead()` is the set of ranks that died first."""

    def __init__(self, pids_by_rank: dict[int, int]):
        self._fds: dict[int, int] = {}  # fd -> rank
        self._first: set[int] | None = None
        self._status: dict[int, int] = {}
        self._pids = dict(pids_by_rank)
        self.first_at: float | None = None
        self._stop = False
        if not hasattr(os, "pidfd_open"):
            return
        for rank, pid in pids_by_rank.items():
            try:
                self._fds[os.pidfd_open(pid)] = rank
            except OSError:  # already gone, or not ours to watch
                continue
        if self._fds:
            threading.Thread(target=self._run, name="nbdist-death-watch", daemon=True).start()

    def _run(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        try:
            while not self._stop:
                events = poller.poll(500)
                if not events:
                    continue
                # One look right after the wake-up: the processes gone by now died first
                # (MPI's SIGKILL to the others takes hydra a wake-up and a kill() longer).
                gone = {self._fds[fd] for fd, _ in events}
                for rank in gone:
                    status = zombie_wait_status(self._pids[rank])
                    if status is not None:
                        self._status[rank] = status
                self._first, self.first_at = gone, time.time()
                return
        finally:
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def first_dead(self) -> set[int]:
        """The ranks that died first (empty: none died yet, or pidfds are unavailable)."""
        return set(self._first or ())

    def first_dead_statuses(self) -> dict[int, int]:
        """Wait statuses of the first dead ranks, where /proc still had them."""
        return dict(self._status) if self._first else {}

    def stop(self) -> None:
        self._stop = True
