"""This process's world: MPI_COMM_WORLD, or the world an elastic driver assigned after a resize.

An elastic run (hvd.elastic.run) outlives the loss of a rank: the survivors build a new
communicator among themselves (MPI_Comm_create_group is collective over the group only,
so the dead rank takes no part) and take in new ranks started by another mpiexec
(MPI_Comm_accept/connect, then a merge). Which processes make up the next world is
decided by one driver - the notebook kernel, or `nbdist run --elastic` - never by the
ranks themselves: a rank that saw one death and a rank that saw two would otherwise
build different groups and wait for ever.

The driver publishes each world as a *plan* in the folder named by NBDIST_ELASTIC_DIR
(private to the user, on the ranks' node: elastic worlds are one node only):

    world.json  {"generation": g, "pids": [pid of new rank 0, 1, ...],
                 "joiners": [pids that join from a new mpiexec], "abort": "" or a reason}

A process is named by its pid, which the driver and the rank both know on one node.
Generation 0 is the world mpiexec started (COMM_WORLD in rank order).
"""
from __future__ import annotations

import json
import os
import time

from ..mpi.deaths import pid_alive
from .config import env_path

ELASTIC_DIR_ENV = "NBDIST_ELASTIC_DIR"
PLAN_FILE = "world.json"
PLAN_WAIT_S = 120.0  # how long a rank waits for the driver's next world before it gives up
POLL_S = 0.02
SETTLE_S = 0.3  # after a first death, the driver waits this long for others: one resize for both

_current: dict = {"comm": None, "generation": 0, "pids": None}


class WorldError(RuntimeError):
    """The world could not be rebuilt (the driver gave up, or this process is not in it)."""


def elastic_dir() -> str | None:
    """The driver's plan folder, or None outside an elastic cluster."""
    return env_path(ELASTIC_DIR_ENV.removeprefix("NBDIST_")) or None


def world_comm():
    """The communicator init() builds the runtime on: the elastic world once rebuilt, else COMM_WORLD."""
    comm = _current["comm"]
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def generation() -> int:
    """The generation of the world this process is in (0: the one mpiexec started)."""
    return int(_current["generation"])


# -- plans (written by the driver, read by the ranks) --------------------------------------
def write_plan(folder: str, plan: dict) -> None:
    """Publish a world plan atomically (a rank never reads half a file)."""
    tmp = os.path.join(folder, f".{PLAN_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(plan, f)
    os.replace(tmp, os.path.join(folder, PLAN_FILE))


def read_plan(folder: str | None = None) -> dict | None:
    """The latest published plan, or None when there is none (or no driver)."""
    folder = folder or elastic_dir()
    if not folder:
        return None
    try:
        with open(os.path.join(folder, PLAN_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def published_generation() -> int:
    """The generation of the driver's latest plan (this process's own when there is no driver)."""
    plan = read_plan()
    return int(plan["generation"]) if plan else generation()


def lost_members(pids: list[int]) -> list[int]:
    """For a driver: the indices of the members whose process is gone. After seeing a first
    death it waits SETTLE_S and looks again, so kills close together make one resize (the
    ranks must never be handed two worlds for one event)."""
    dead = [i for i, p in enumerate(pids) if not pid_alive(p)]
    if dead:
        time.sleep(SETTLE_S)
        dead = [i for i, p in enumerate(pids) if not pid_alive(p)]
    return dead


def _current_pids(comm) -> list[int]:
    """Every rank's pid in the current world, in rank order (learned once, while all live)."""
    if _current["pids"] is None:
        plan = read_plan()
        if plan and int(plan["generation"]) == 0:
            _current["pids"] = list(plan["pids"])
        else:
            _current["pids"] = comm.allgather(os.getpid())
            folder = elastic_dir()
            if comm.rank == 0 and plan is None and folder:
                # no driver wrote generation 0 (nbdist run --elastic): tell it who is who
                write_plan(folder, {"generation": 0, "pids": _current["pids"], "joiners": [],
                                    "abort": ""})
    return _current["pids"]


def remember_members() -> None:
    """Learn the current world's pids now, while every rank is alive (init() calls it)."""
    if elastic_dir() is not None:
        _current_pids(world_comm())
        if not _exit_state["marked"]:
            import atexit

            _exit_state["marked"] = True
            atexit.register(_mark_exit)


def exit_marker(folder: str, pid: int) -> str:
    """The file a rank writes when its program ends: a driver tells a finished rank from a dead one."""
    return os.path.join(folder, f"exited-{pid}")


def _mark_exit() -> None:
    folder = elastic_dir()
    if folder:
        try:
            open(exit_marker(folder, os.getpid()), "w").close()
        except OSError:
            pass


def next_world(timeout_s: float = PLAN_WAIT_S) -> dict | None:
    """After a failure or a host update: the plan to rebuild on, or None to keep this world.

    A newer plan is taken at once. Without one, if every rank of this world still runs
    (a collective failed for another reason), the world is kept; if one is dead, the
    driver will publish the survivors' plan: wait for it (bounded).
    """
    if elastic_dir() is None:
        return None
    comm = world_comm()
    pids = _current_pids(comm)
    deadline = time.monotonic() + timeout_s
    while True:
        plan = read_plan()
        if plan and int(plan["generation"]) > generation():
            if plan.get("abort"):
                raise WorldError(plan["abort"])
            return plan
        if all(pid_alive(p) for p in pids):
            return None
        if time.monotonic() > deadline:
            raise WorldError(f"rank {comm.rank}: a rank of this world died and the elastic driver "
                             f"published no new world within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _port_file(plan: dict) -> str:
    return os.path.join(elastic_dir() or ".", f"port-{int(plan['generation'])}")


def rebuild(plan: dict) -> None:
    """Build the plan's world and make it this process's (collective over the plan's pids)."""
    me = os.getpid()
    order = [int(p) for p in plan["pids"]]
    joiners = {int(p) for p in plan.get("joiners") or []}
    if me not in order:
        raise WorldError(f"process {me} is not in the elastic world of generation "
                         f"{plan['generation']} (the driver counted it as lost)")
    if me in joiners:
        comm = _join(plan)
        # tells the driver this rank is in (a join the run never took is called off instead)
        open(joined_marker(elastic_dir() or ".", int(plan["generation"]), me), "w").close()
    else:
        old = world_comm()
        index = {p: i for i, p in enumerate(_current_pids(old))}
        stay = [index[p] for p in order if p not in joiners]
        comm = old.Create_group(old.Get_group().Incl(stay))
        if joiners:
            comm = _accept(plan, comm)
    new = comm.Split(0, key=order.index(me))  # ranks in the plan's order
    lost = set(_current["pids"] or []) - set(order)
    _current.update(comm=new, generation=int(plan["generation"]), pids=order)
    if lost or me in joiners:
        _exit_without_mpi_finalize()


_exit_state: dict = {"registered": False, "failed": False, "marked": False}


def _exit_without_mpi_finalize() -> None:
    """After a rank of COMM_WORLD died (or from a joined world), MPI_Finalize waits for ever for
    it; so this process ends right after Python's own exit handlers (the runtime's shutdown
    included), with status 1 if the program died of an exception, else 0."""
    import atexit
    import sys

    if _exit_state["registered"]:
        return
    _exit_state["registered"] = True
    previous = sys.excepthook

    def excepthook(*exc_info):
        _exit_state["failed"] = True
        previous(*exc_info)

    sys.excepthook = excepthook

    def finish() -> None:
        from . import basics

        _mark_exit()
        try:
            basics.shutdown()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(1 if _exit_state["failed"] else 0)

    atexit.register(finish)


def _accept(plan: dict, comm):
    """The ranks already in the world open a port (its name goes through the plan folder)
    and take the joiners in; the joiners come last in the merged order."""
    from mpi4py import MPI

    port = MPI.Open_port() if comm.rank == 0 else ""
    if comm.rank == 0:
        path = _port_file(plan)
        with open(path + ".tmp", "w") as f:
            f.write(port)
        os.replace(path + ".tmp", path)
    inter = comm.Accept(port, root=0)
    merged = inter.Merge(high=False)
    if comm.rank == 0:
        MPI.Close_port(port)
        try:
            os.unlink(_port_file(plan))
        except OSError:
            pass
    return merged


def joined_marker(folder: str, generation: int, pid: int) -> str:
    """The file a joiner writes once it is in the world of `generation` (the driver looks)."""
    return os.path.join(folder, f"joined-{generation}-{pid}")


def _join(plan: dict):
    """A new process (its own mpiexec's COMM_WORLD) connects to the running world."""
    from mpi4py import MPI

    path = _port_file(plan)
    deadline = time.monotonic() + PLAN_WAIT_S
    while not os.path.exists(path):
        newest = read_plan()
        if newest and int(newest["generation"]) > int(plan["generation"]):
            raise WorldError(f"process {os.getpid()}: the elastic run ended before this rank "
                             "could join it")
        if time.monotonic() > deadline:
            raise WorldError(f"process {os.getpid()}: the running ranks opened no port to join "
                             f"within {PLAN_WAIT_S:.0f} s")
        time.sleep(POLL_S)
    with open(path) as f:
        port = f.read()
    inter = MPI.COMM_WORLD.Connect(port, root=0)
    return inter.Merge(high=True)


def join_pending() -> dict | None:
    """A newer world this process belongs to and has not built yet, for init() to build first:
    a rank started to join, or a survivor whose code did not run hvd.elastic.run (its cell
    failed on the lost rank; hvd.shutdown() and hvd.init() then start it on the survivors)."""
    plan = read_plan()
    if (plan and not plan.get("abort") and int(plan["generation"]) > generation()
            and os.getpid() in plan["pids"]):
        return plan
    return None
