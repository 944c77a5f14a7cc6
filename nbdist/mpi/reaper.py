"""Reaper that keeps a notebook's cluster from outliving the notebook kernel.

The controller and the mpiexec that owns the engines run in their own sessions
(ipyparallel starts them so), so nothing kills them when the kernel is SIGKILLed
or crashes. This small process, started beside each cluster, polls the kernel's
pid; when the kernel is gone it kills the cluster's process trees, removes the
MPI shared-memory segments they left behind and the private profile directory.
It exits by itself once the cluster's processes are gone (a normal stop).

Usage: python -m nbdist.mpi.reaper KERNEL_PID KERNEL_START_TIME PROFILE_DIR START_TIME PID@START_TIME...
"""
from __future__ import annotations

import os
import shutil
import sys
import time

import psutil

POLL_S = 0.5
SCAN_EVERY = 4  # read the ranks' /proc maps every 2 s: MPI maps per-communicator segments late
# A killed rank unmaps its segments only once the OS has torn it down: seconds on a loaded
# 2-core machine running 4 ranks, so wait that long for ours to be released.
SETTLE_S = 15.0


def _alive(pid: int, create_time: float | None = None) -> bool:
    """True while the process exists (and is the same process, not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 1.0:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_trees(pids: list[int] | list[psutil.Process]) -> list[psutil.Process]:
    """The processes and all their descendants (collect before killing: orphans lose their parent).
    A psutil.Process given is taken only while it is still that process (its pid not reused)."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            root = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
            if not root.is_running():  # gone, or its pid now another process's
                continue
        except psutil.Error:
            continue
        try:
            procs.extend(root.children(recursive=True))
        except psutil.Error:
            pass
        procs.append(root)
    return procs


def kill_procs(procs: list[psutil.Process], grace_s: float = 2.0) -> None:
    """SIGTERM the processes, then SIGKILL whatever remains after grace_s; wait for them to end."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def kill_trees(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM the processes and all their descendants, then SIGKILL whatever remains."""
    kill_procs(process_trees(pids), grace_s)


# MPICH names its intra-node segments mpich_shm_*; nbdist's own transport uses nbdist*.
SHM_PREFIXES = ("mpich_shm_", "nbdist")


def _mapped_shm_files() -> set[str]:
    """Every /dev/shm path that some live process of this user maps or holds open."""
    held: set[str] = set()
    me = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != me:
                continue
            with open(f"/proc/{proc.pid}/maps") as maps:
                for line in maps:
                    idx = line.find("/dev/shm/")
                    if idx >= 0:
                        held.add(line[idx:].strip().removesuffix(" (deleted)"))
            for entry in os.scandir(f"/proc/{proc.pid}/fd"):
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    held.add(target)
        except (OSError, psutil.Error):
            continue
    return held


def segments_of(procs: list[psutil.Process]) -> set[str]:
    """The /dev/shm files these processes map or hold open (taken before killing them)."""
    found: set[str] = set()
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                for line in maps:
                    idx = line.find("/dev/shm/")
                    if idx >= 0:
                        found.add(line[idx:].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def remove_orphan_segments(since: float, known: set[str] | None = None, settle_s: float = 0.0) -> list[str]:
    """Remove this user's MPI/nbdist segments created since `since` that no live process uses.

    Segments are matched by prefix and age (or named in `known`), and kept while any process
    still maps them, so a concurrent MPI job of the same user keeps its own. With settle_s,
    look again for that long while one of ours is still held: a killed rank unmaps its
    segments only when the kernel has finished tearing it down, which takes a moment on a
    loaded machine.
    """
    deadline = time.monotonic() + settle_s
    removed = _remove_orphan_segments_once(since, known)
    while known and time.monotonic() < deadline and any(os.path.exists(p) for p in known):
        time.sleep(0.1)
        removed += _remove_orphan_segments_once(since, known)
    return removed


def _remove_orphan_segments_once(since: float, known: set[str] | None) -> list[str]:
    removed: list[str] = []
    for path in orphan_segments(since, known):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def orphan_segments(since: float, known: set[str] | None = None) -> list[str]:
    """This user's MPI/nbdist segments created since `since` (or named in `known`) that no
    live process maps or holds open."""
    try:
        entries = list(os.scandir("/dev/shm"))
    except OSError:
        return []
    candidates = []
    for entry in entries:
        path = entry.path
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.getuid():
            continue
        ours = known is not None and path in known
        if ours or (entry.name.startswith(SHM_PREFIXES) and st.st_mtime >= since - 2.0):
            candidates.append(path)
    if not candidates:
        return []
    held = _mapped_shm_files()
    return [path for path in candidates if path not in held]


def main(argv: list[str]) -> int:
    kernel_pid, kernel_start = int(argv[0]), float(argv[1])
    profile_dir, since = argv[2], float(argv[3])
    # PID@START_TIME: this machine's pids wrap at 32768, and a watchdog that outlived its
    # cluster's processes once killed a rank of the next cluster (CI) that got one's pid
    pids = [p for p in map(_watched, argv[4:]) if p is not None]
    # Ignore Ctrl-C aimed at the kernel's process group: we must outlive a kernel interrupt.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen: set[str] = set()  # every segment the ranks mapped so far (they create some late)
    polls = 0
    while True:
        if not any(_alive(p.pid, p.create_time()) for p in pids):
            # Stopped by its owner, who removes the segments; but the kernel may be killed
            # mid-stop (jupyter_client's shutdown grace ends), so sweep what is left
            # unheld. A segment still mapped by a live process is never touched.
            remove_orphan_segments(since, known=seen, settle_s=SETTLE_S)
            return 0
        if not _alive(kernel_pid, kernel_start):
            break
        if polls % SCAN_EVERY == 0:
            seen |= segments_of(process_trees(pids))
        polls += 1
        time.sleep(POLL_S)
    tree = process_trees(pids)
    segments = seen | segments_of(tree)  # the ranks' own segments, whatever their age
    kill_procs(tree)
    remove_orphan_segments(since, known=segments, settle_s=SETTLE_S)
    shutil.rmtree(profile_dir, ignore_errors=True)
    return 0


def watched_arg(proc: psutil.Process) -> str:
    """A process as main() takes it: PID@START_TIME."""
    return f"{proc.pid}@{proc.create_time()!r}"


def _watched(arg: str) -> psutil.Process | None:
    """The process PID@START_TIME names, or None when that pid is now another's (or gone)."""
    pid, _, start = arg.partition("@")
    try:
        proc = psutil.Process(int(pid))
        if start and abs(proc.create_time() - float(start)) > 1.0:
            return None
        return proc
    except (psutil.Error, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
