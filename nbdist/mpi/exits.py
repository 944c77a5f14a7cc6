"""`nbdist run`'s watch on its own host's ranks: a rank that ended without a word.

hydra sees a rank's end and stops the others. Once in CI it did not (pmodels/mpich#7057: a
rank that `_exit`s right after MPI_Init): the peer finished its script and then waited for
ever in MPI_Finalize's PMI barrier, and the run never ended. So each rank records its pid when
it starts and a done record when its script returns (nbdist.rank.batch); the launcher watches
the pids of the ranks on its host, and a rank whose process ended with no done record is one
MPI will not get past. If mpiexec still runs `EXIT_GRACE_S` later, the launcher stops the run
and names the rank itself.

The wait status is read from /proc while the process is a zombie, before its parent (hydra's
proxy) reaps it; a watcher thread blocked on a pidfd per rank wakes at once, so it usually
gets there first. When it does not, the status is unknown (None) and the report says so.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time

from ..wire import read_done_ranks, read_start_records
from .deaths import zombie_wait_status

EXIT_GRACE_S = 5.0  # hydra stops the others well within this; a loaded machine once took longer
_LOOK_S = 0.2  # how often to look for ranks that have just started


class RankExits:
    """Watches the ranks on `host` as their start records appear in `folder`."""

    def __init__(self, folder: str, host: str, ranks: int):
        self._folder = folder
        self._host = host
        self._ranks = ranks  # the run's ranks: start records to look for
        self._seen: set[int] = set()
        self._watched: dict[int, tuple[int, int]] = {}  # pidfd -> (rank, pid)
        self._gone: dict[int, tuple[float, int | None]] = {}  # rank -> (when seen, wait status)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._epoll = select.epoll() if hasattr(os, "pidfd_open") else None
        self._thread = threading.Thread(target=self._run, name="nbdist-rank-exits", daemon=True)
        if self._epoll is not None:
            self._thread.start()

    def _adopt(self) -> None:
        assert self._epoll is not None
        for rec in read_start_records(self._folder):
            rank = int(rec["rank"])
            if rank in self._seen:
                continue
            self._seen.add(rank)  # every host's: once all have started, no more looking
            if rec.get("host") != self._host:
                continue
            try:
                fd = os.pidfd_open(int(rec["pid"]))
            except OSError:  # already gone (and reaped) before we looked
                with self._lock:
                    self._gone[rank] = (time.monotonic(), None)
                continue
            self._watched[fd] = (rank, int(rec["pid"]))
            self._epoll.register(fd, select.EPOLLIN)

    def _run(self) -> None:
        assert self._epoll is not None
        while not self._stop.is_set():
            looking = len(self._seen) < self._ranks
            if looking:
                self._adopt()
            for fd, _ in self._epoll.poll(_LOOK_S if looking else 1.0):
                rank, pid = self._watched.pop(fd)
                status = zombie_wait_status(pid)  # before the proxy reaps it, if we are first
                with self._lock:
                    self._gone[rank] = (time.monotonic(), status)
                self._epoll.unregister(fd)
                os.close(fd)

    def unexplained(self, grace_s: float = EXIT_GRACE_S) -> dict[int, int | None]:
        """Ranks gone for at least grace_s whose script did not return: rank -> wait status
        (None: not read in time), in the order they were seen to end. A known status 0 is
        left out: that rank ended as it meant to (os._exit(0))."""
        now = time.monotonic()
        with self._lock:
            gone = sorted(self._gone.items(), key=lambda item: item[1][0])
        if not any(now - when >= grace_s for _, (when, _) in gone):
            return {}
        done = read_done_ranks(self._folder)
        return {rank: status for rank, (_, status) in gone if rank not in done and status != 0}

    def stop(self, kill: bool = False) -> None:
        """Stop watching. kill: SIGKILL this host's ranks that still run (the run was stopped,
        and hydra gives each rank a session of its own, so stopping mpiexec may leave them)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for fd in self._watched:
            if kill:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)  # the rank itself, never a reused pid
                except OSError:
                    pass
            os.close(fd)
        self._watched.clear()
        if self._epoll is not None:
            self._epoll.close()
