"""The notebook kernel as the elastic driver (docs/elastic.md).

An elastic cluster (`%dist_start -n 4 --elastic` / `%%distributed -n 4 --elastic --min-np 2`)
starts its engines so that one rank's death leaves the others running (cluster.py:
hydra's -disable-auto-cleanup, each engine under nbdist.rank.survive). The kernel then
decides every world, as Horovod's driver does:

- while an elastic cell runs, ElasticWatch.poll() (called by the cell loop) notices a
  dead rank (its pid is gone: one node, so the kernel sees the ranks' processes), waits
  world.SETTLE_S for deaths close together (two kills at once are one resize), and publishes
  the survivors' world (nbdist.common.world.write_plan). The survivors, whose runtime
  failed with HorovodInternalError within ~0.1 s, restore their last commit, build that
  world and go on (nbdist.common.elastic). Below --min-np it publishes an abort instead,
  and the cell fails naming the lost ranks and the minimum.
- grow() starts new engines (an extra ipyparallel engine set: its own mpiexec) and
  publishes a world with them as joiners; the ranks take them in (MPI accept/connect).

The kernel keeps `cluster.ranks` in the new world's order, so %dist_status, --targets and
the next cells see the resized world. One node only: plans are files in the kernel's
private folder and ranks are known by pid.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Callable

import psutil

from ..common.world import joined_marker, lost_members, write_plan
from ..failure import FailureReport, rank_ranges
from ..mpi.deaths import DeathWatch
from . import display

JOIN_TIMEOUT_S = 120.0


def _publish(cluster, pids: list[int], joiners: list[int] | None = None, abort: str = "") -> int:
    """Publish the next world; returns its generation."""
    cluster.generation += 1
    write_plan(cluster.elastic_dir, {"generation": cluster.generation, "pids": pids,
                                     "joiners": joiners or [], "abort": abort})
    return cluster.generation


def _renumber(cluster, order: list) -> None:
    """cluster.ranks in the new world's order (RankInfo objects), and a fresh death watch."""
    cluster.ranks = {new: replace(info, rank=new) for new, info in enumerate(order)}
    cluster.n = len(order)
    if cluster._death_watch is not None:
        cluster._death_watch.stop()
    cluster._death_watch = DeathWatch({r: info.pid for r, info in cluster.ranks.items()})


def dead_ranks(cluster) -> list[int]:
    """The ranks of the current world whose process is gone (after world.SETTLE_S, if any)."""
    ranks = sorted(cluster.ranks)
    return [ranks[i] for i in lost_members([cluster.ranks[r].pid for r in ranks])]


class ElasticWatch:
    """The cell loop's elastic side: shrink the world on deaths, or fail below min_np."""

    def __init__(self, cluster, min_np: int, progress=None, labels: dict[int, tuple[int, int]] | None = None,
                 max_np: int | None = None):
        self.cluster = cluster
        self.min_np = min_np
        self.max_np = max_np
        # called with new engine ids: they run the cell (and join the world)
        self.on_join: Callable[[list[int]], None] | None = None
        self._starting: tuple[int, set[int], str] | None = None  # (how many, ids before, engine set)
        self.joining: dict[int, tuple[int, int]] = {}  # engine id -> (pid, generation): asked to join
        # engine id -> the joiner's process as it was when asked (psutil checks its start time
        # before a signal: a pid reused since is never killed for it)
        self._joiner_procs: dict[int, psutil.Process] = {}
        self.progress = progress
        # engine id -> (the rank it had when the cell started, its index in the AsyncResult)
        self.labels = labels or {}
        self.lost_engines: set[int] = set()
        self.failure: FailureReport | None = None
        self.events: list[str] = []
        self.lost_at: float | None = None
        self.resized_at: float | None = None
        self.step_at_resize = None
        self.resumed = True

    def _event(self, text: str, lost_index: int | None = None) -> None:
        self.events.append(text)
        display.notice(f"elastic: {text}", "warning")
        if self.progress is not None:
            self.progress.event(text, lost_index)

    def poll(self) -> bool:
        """Handle deaths since the last call; False when the run cannot go on (see .failure)."""
        cluster = self.cluster
        self._check_resumed()
        seen_at = time.monotonic()
        dead = dead_ranks(cluster)
        if not dead:
            self._grow()
            return True
        self.lost_at = seen_at
        size = len(cluster.ranks)
        survivors = [r for r in sorted(cluster.ranks) if r not in dead]
        lost_info = [cluster.ranks[r] for r in dead]
        for info in lost_info:
            self.lost_engines.add(info.engine_id)
        names = ", ".join(f"rank {r} (pid {cluster.ranks[r].pid})" for r in dead)
        if len(survivors) < self.min_np:
            reason = (f"the elastic run lost {names}: {len(survivors)} rank"
                      f"{'s' if len(survivors) != 1 else ''} left, below --min-np {self.min_np}")
            _publish(cluster, [cluster.ranks[r].pid for r in survivors], abort=reason)
            for info in lost_info:
                self._event(f"lost rank {info.rank}", self.labels.get(info.engine_id, (None, None))[1])
            lost = sorted(self.labels[e][0] for e in self.lost_engines if e in self.labels)
            self.failure = FailureReport(reason, None, [], [
                f"ranks lost in this cell: {rank_ranges(lost)} (numbered as when the cell started)"])
            return False
        _publish(cluster, [cluster.ranks[r].pid for r in survivors])
        _renumber(cluster, [cluster.ranks[r] for r in survivors])
        for info in lost_info:
            self._event(f"lost rank {info.rank} (pid {info.pid})", self.labels.get(info.engine_id, (None, None))[1])
        self._event(f"resized {size} -> {len(survivors)} ranks (generation {cluster.generation}); "
                    f"resuming from the last commit")
        self.resized_at = time.monotonic()
        self.step_at_resize = self.progress.run.step if self.progress is not None else None
        self.resumed = False
        return True

    def _check_resumed(self) -> None:
        """'resumed at step S' once rank 0 reports a new step after the resize."""
        if self.resumed or self.progress is None:
            return
        run = self.progress.run
        if run.step is not None and run.step != self.step_at_resize:
            self.resumed = True
            took = time.monotonic() - (self.lost_at or time.monotonic())
            self._event(f"resumed at step {run.step} on {len(self.cluster.ranks)} ranks "
                        f"({took:.1f} s after the loss was seen)")

    def _grow(self) -> None:
        """Below --max-np: start engines; once they registered, publish the world with them as
        joiners and have them run the cell. The running ranks take them in at their next
        commit() (HostsUpdatedInterrupt), as Horovod's host updates."""
        cluster = self.cluster
        if not self.max_np or self.on_join is None:
            return
        if self._starting is None:
            k = self.max_np - len(cluster.ranks)
            if k > 0:
                before = set(cluster.client.ids)
                engine_set = cluster.cluster.start_engines_sync(k, environment=cluster.engine_env)
                self._starting = (k, before, engine_set)
                cluster._open_output_files()
                self._event(f"starting {k} new rank{'s' if k != 1 else ''} to grow back to "
                            f"--max-np {self.max_np}")
            return
        k, before, _ = self._starting
        new = sorted(set(cluster.client.ids) - before)
        if len(new) < k:
            return
        self._starting = None
        old = [cluster.ranks[r] for r in sorted(cluster.ranks)]
        newcomers = _describe_new(cluster, new, len(old))
        size = len(old)
        _publish(cluster, [i.pid for i in old + newcomers], joiners=[i.pid for i in newcomers])
        self.joining = {i.engine_id: (i.pid, cluster.generation) for i in newcomers}
        self._joiner_procs = {}
        for i in newcomers:
            try:
                self._joiner_procs[i.engine_id] = psutil.Process(i.pid)
            except psutil.NoSuchProcess:  # gone already: nothing to stop later
                pass
        _renumber(cluster, old + newcomers)
        self.on_join(new)
        self._event(f"resized {size} -> {len(cluster.ranks)} ranks (generation {cluster.generation}): "
                    f"the new rank{'s join' if len(new) != 1 else ' joins'} at the next commit")

    def joined(self) -> None:
        """Forget the joiners that are in the world now (each wrote its marker)."""
        for eid, (pid, generation) in list(self.joining.items()):
            if os.path.exists(joined_marker(self.cluster.elastic_dir, generation, pid)):
                del self.joining[eid]

    def call_off_join(self) -> None:
        """The run ended before it took the joiners in (no commit came): stop them, and move the
        ranks (idle now) to a world without them, so no rank waits for the other side."""
        cluster = self.cluster
        if not self.joining:
            return
        for eid in self.joining:
            self.lost_engines.add(eid)
            proc = self._joiner_procs.pop(eid, None)
            try:
                if proc is not None:
                    proc.kill()  # (raises NoSuchProcess, not kills, if the pid was reused)
            except psutil.NoSuchProcess:
                pass
        keep = [info for r, info in sorted(cluster.ranks.items()) if info.engine_id not in self.joining]
        self.joining = {}
        self.max_np = None  # the run is over: start nothing more in this cell
        _publish(cluster, [i.pid for i in keep])
        _renumber(cluster, keep)
        ar = cluster.client[[i.engine_id for i in keep]].apply_async(_adopt_world,
                                                                      any_initialized(cluster, keep))
        ar.wait(JOIN_TIMEOUT_S)
        ar.get()
        self._event(f"the run ended before the new rank joined: it was stopped; "
                    f"{len(keep)} ranks")

    def finish(self) -> None:
        """The cell ended: engines still starting for --max-np are not needed any more."""
        if self._starting is not None:
            engine_set = self._starting[2]
            self._starting = None
            try:
                self.cluster.cluster.stop_engines_sync(engine_set)
            except Exception:  # it ends with the cluster anyway
                pass
            self._event("the run ended before the new rank started: it was stopped")

    def ignores(self, engine_id: int) -> bool:
        """True for an engine this run lost: its EngineError is the event, not the cell's error."""
        return engine_id in self.lost_engines


def grow(cluster, k: int) -> None:
    """Start k engines and take them into the world (between cells: every rank is idle).

    The running ranks rebuild their world with the newcomers (nbdist.common.world), and
    their runtime is started again where it ran; the newcomers hold no names from earlier
    cells: an elastic run's state.sync() (or the next cell) gives them the state.
    """
    if k <= 0:
        return
    old = [cluster.ranks[r] for r in sorted(cluster.ranks)]
    new_ids = _start_engines(cluster, k)
    newcomers = _describe_new(cluster, new_ids, len(old))
    order = old + newcomers
    _publish(cluster, [info.pid for info in order], joiners=[info.pid for info in newcomers])
    everyone = cluster.client[[info.engine_id for info in order]]
    ar = everyone.apply_async(_adopt_world, any_initialized(cluster, old))
    if not ar.wait(JOIN_TIMEOUT_S):
        raise RuntimeError(f"the ranks did not build the grown world within {JOIN_TIMEOUT_S:.0f} s")
    ar.get()
    _renumber(cluster, order)
    cluster._wait_for_engines(len(order))


def _describe_new(cluster, engine_ids: list[int], first_rank: int) -> list:
    """Install the engine hooks on new engines; their RankInfo as ranks first_rank, first_rank+1..."""
    import os
    import socket

    from .cluster import RankInfo

    view = cluster.client[engine_ids]
    code = ("import nbdist.rank.hooks as __nbdist_engine\n"
            f"__nbdist_info = __nbdist_engine.setup({os.getpid()}, {socket.gethostname()!r})\n")
    view.execute(code, block=True, silent=True)
    infos = view.pull("__nbdist_info", block=True)
    view.execute("del __nbdist_info, __nbdist_engine", block=True, silent=True)
    return [RankInfo(rank=first_rank + i, engine_id=eid, host=info["host"], pid=info["pid"],
                     local_rank=first_rank + i, gpus=info["gpus"], extra=info)
            for i, (eid, info) in enumerate(zip(engine_ids, infos))]


def any_initialized(cluster, infos) -> bool:
    """Whether the runtime runs on the ranks (then it runs again on the grown world)."""
    ar = cluster.client[[i.engine_id for i in infos]].apply_async(_is_initialized)
    ar.wait(30)
    return any(ar.get())


def _is_initialized() -> bool:
    import sys

    common = sys.modules.get("nbdist.common")
    return bool(common is not None and common.is_initialized())


def _adopt_world(start_runtime: bool) -> int:
    """On every rank (old and new): move to the driver's newest world; start the runtime there
    if it ran before. Returns the rank in the new world."""
    from nbdist.common import basics, world

    plan = world.read_plan()
    if plan is None or int(plan["generation"]) <= world.generation():
        raise RuntimeError("no newer elastic world was published")
    basics.shutdown()
    world.rebuild(plan)
    if start_runtime:
        basics.init()
    return world.world_comm().rank


def _start_engines(cluster, k: int) -> list[int]:
    """k more engines as a new engine set (its own mpiexec); their engine ids."""
    before = set(cluster.client.ids)
    cluster.cluster.start_engines_sync(k, environment=cluster.engine_env)
    cluster._open_output_files()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while len(set(cluster.client.ids) - before) < k:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{k} new engine(s) did not register within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    return sorted(set(cluster.client.ids) - before)
