"""Which rank died first, seen from outside the MPI job.

When one rank dies, hydra kills every other rank with SIGKILL, and its exit-code report
then shows signal 9 for all of them: a rank killed by SIGKILL (the OOM killer, `kill -9`)
cannot be told from the ranks MPI stopped. A small process started with the cluster
watches the local ranks and names the one that went first: that is the cause.

The order comes from the kernel, not from when the watcher gets a CPU. Each rank holds
the write end of a FIFO of the watcher's (`nbdist.rank.hooks.hold_death_pipe`); a dying
process closes its files before it is reaped, and in the same pass as its PMI socket, whose
closing is what makes hydra's proxy kill the others. The watcher waits on those FIFOs and
on a pidfd per rank in one epoll, and epoll hands back events in the order they happened:
the first one is the first death, even when a loaded machine wakes the watcher late and
every rank is gone by then. (Exits alone, by pidfd, are not enough: a process is gone only
when all its threads are, and a rank whose threads take longer to end was seen after the
ranks MPI stopped because of it.) A rank that has no FIFO open (it could not open one) is
still watched by its pidfd.

It also reads the first dead rank's wait status from /proc while the process is still a
zombie, so a death is named with its status even when mpiexec's exit-code report comes
late or never (it once took hydra more than 40 s to stop the other ranks on this loaded
2-core machine).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

# A rank whose FIFO closed first but whose process has not ended this long after another
# rank's has is not the cause (user code closed the fd): the next in order is.
EXIT_GRACE_S = 2.0


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


def pid_alive(pid: int) -> bool:
    """True while the process runs (a zombie - killed, not yet reaped - counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def fifo_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}")


class _Watcher:
    """The watching process's state: one epoll over FIFOs, pidfds and its own stdin."""

    def __init__(self, pids_by_rank: dict[int, int]):
        self.pids = pids_by_rank
        self.epoll = select.epoll()
        self.what: dict[int, tuple[int, str]] = {}  # fd -> (rank, "pipe" | "exit")
        self.dir: str | None = tempfile.mkdtemp(prefix="nbdist-deaths-")
        for rank, pid in pids_by_rank.items():
            try:
                self._add(os.pidfd_open(pid), rank, "exit")
            except OSError:  # already gone, or not ours to watch
                continue
            path = fifo_path(self.dir, rank)
            os.mkfifo(path, 0o600)
            # Linux reports no hang-up on a FIFO before its first writer has come and gone
            self._add(os.open(path, os.O_RDONLY | os.O_NONBLOCK), rank, "pipe")
        self.epoll.register(sys.stdin.fileno(), select.EPOLLIN)

    def _add(self, fd: int, rank: int, kind: str) -> None:
        self.what[fd] = (rank, kind)
        self.epoll.register(fd, select.EPOLLIN)

    def unlink(self) -> None:
        """The ranks hold their FIFOs open: the names are no longer needed."""
        directory, self.dir = self.dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def first_death(self) -> dict | None:
        """Block until a rank is gone; the first one by the kernel's order. None: told to stop."""
        order: list[int] = []  # ranks, by the first sign of each one's end
        exited: set[int] = set()
        deadline = None
        while True:
            timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            for fd, _ in self.epoll.poll(timeout):
                if fd == sys.stdin.fileno():
                    if not self._read_command():
                        return None
                    continue
                rank, kind = self.what[fd]
                self.epoll.unregister(fd)  # a closed FIFO stays ready
                if rank not in order:
                    order.append(rank)
                if kind == "exit":
                    exited.add(rank)
            if not exited:
                continue
            if deadline is None:
                deadline = time.monotonic() + EXIT_GRACE_S
            # the earliest sign, once that rank has ended too (it closes its files first)
            waiting = time.monotonic() < deadline
            for rank in order:
                if rank in exited:
                    status = zombie_wait_status(self.pids[rank])
                    return {"first": [rank], "status": {} if status is None else {rank: status}}
                if waiting:
                    break

    def _read_command(self) -> bool:
        line = sys.stdin.readline()
        if not line:
            return False  # the notebook side is gone
        if line.strip() == "armed":
            self.unlink()
        return True


def _watch(pids_by_rank: dict[int, int]) -> dict | None:
    watcher = _Watcher(pids_by_rank)
    try:
        if not watcher.what:
            return {"first": [], "status": {}}
        # the parent waits for this line: no death can be missed after it
        print(f"watching {watcher.dir}", flush=True)
        return watcher.first_death()
    finally:
        watcher.unlink()


class DeathWatch:
    """Watches local rank processes; `first_dead()` is the rank that died first.

    The watching is done by a small process of its own, blocked in epoll: woken by the
    first death it needs only a CPU, not the notebook kernel's GIL, and the kernel's event
    order, not its wake-up time, says who went first.
    """

    def __init__(self, pids_by_rank: dict[int, int], via: list[str] | None = None,
                 connect: Callable[[dict[int, str]], None] | None = None):
        """via: a command prefix that runs the watcher where the ranks are, e.g. [ssh, host]
        for ranks on another host (the same Python path there, as hydra assumes).
        connect: given {pid: FIFO path}, makes each rank hold its FIFO open for writing (the
        engines' `hold_death_pipe`); without it the watch sees exits only."""
        self._first: set[int] = set()
        self._status: dict[int, int] = {}
        self._proc: subprocess.Popen | None = None
        if not hasattr(os, "pidfd_open") or not pids_by_rank:
            return
        args = [f"{rank}:{pid}" for rank, pid in sorted(pids_by_rank.items())]
        self._proc = subprocess.Popen([*(via or []), sys.executable, "-m", "nbdist.mpi.deaths", *args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        assert self._proc.stdout is not None and self._proc.stdin is not None
        ready = self._proc.stdout.readline().split(maxsplit=1)  # "watching DIR": set before any cell runs
        if not ready or ready[0] != "watching":
            self.stop()
            return
        if connect is not None and len(ready) == 2:
            try:
                connect({pid: fifo_path(ready[1].strip(), rank) for rank, pid in pids_by_rank.items()})
            except Exception:
                pass  # those ranks are watched by their exit alone
        try:
            self._proc.stdin.write("armed\n")
            self._proc.stdin.flush()
        except OSError:
            pass
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
        """The rank that died first (empty: none died yet, or pidfds are unavailable)."""
        return set(self._first)

    def first_dead_statuses(self) -> dict[int, int]:
        """Wait status of the first dead rank, where /proc still had it."""
        return dict(self._status)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.close()  # the watcher removes its FIFOs and ends
                proc.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def main(argv: list[str]) -> int:
    pids = {int(r): int(p) for r, p in (a.split(":") for a in argv)}
    found = _watch(pids)
    if found is not None:
        print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
