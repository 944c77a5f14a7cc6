"""Horovod's process sets: collectives over a subset of the ranks.

Each set other than the global one runs its own engine over its own MPI
sub-communicator, so it has its own agreement (its coordinator is the set's first
rank), its own response cache and, where its ranks share a node, its own
shared-memory group. Sets are created on every rank in the same order (init's
`process_sets=`, or `add_process_set` called by all ranks), which gives them the same
id everywhere. As in Horovod, `root_rank` arguments stay global ranks.
"""
from __future__ import annotations

import threading
from typing import Sequence

from . import basics, errors


class ProcessSet:
    """A set of ranks that run collectives together: `hvd.ProcessSet([0, 2])`.

    Pass it to `init(process_sets=[...])` or `add_process_set(...)`; then `process_set=`
    on any collective. `process_set_id` is None until it is registered.
    """

    def __init__(self, ranks_or_comm=None):
        self.process_set_id: int | None = None
        self.mpi_comm = None
        self.ranks: list[int] | None = None
        if ranks_or_comm is None:
            return
        if hasattr(ranks_or_comm, "Get_group") and hasattr(ranks_or_comm, "Split"):
            self.mpi_comm = ranks_or_comm  # an mpi4py communicator: its ranks in COMM_WORLD
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be ints, got {ranks_or_comm!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks_or_comm!r}")
        self.ranks = ranks

    def size(self) -> int | None:
        """The number of ranks in the set (None while not registered)."""
        if self.process_set_id is None:
            return None
        return len(_ranks_of(self))

    def rank(self) -> int | None:
        """This rank's index in the set (None while not registered, or not a member)."""
        if self.process_set_id is None:
            return None
        ranks = _ranks_of(self)
        return ranks.index(basics.rank()) if basics.rank() in ranks else None

    def included(self) -> bool | None:
        """True when this rank belongs to the set."""
        ranks = self.ranks if self.process_set_id != 0 else list(range(basics.size()))
        return None if ranks is None else basics.rank() in ranks

    def __eq__(self, other) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        if self.process_set_id is not None and other.process_set_id is not None:
            return self.process_set_id == other.process_set_id
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        if self.process_set_id == 0:
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0

_lock = threading.Lock()
# id -> (ProcessSet, engine or None when this rank is not a member, topology or None)
_sets: dict[int, tuple] = {}
_next_id = [1]


def _ranks_of(process_set: ProcessSet) -> list[int]:
    if process_set.process_set_id == 0:
        return list(range(basics.size()))
    return list(process_set.ranks or [])


def _build(process_set: ProcessSet) -> ProcessSet:
    """Create the set on every rank (collective over the world); returns it registered."""
    world_topology = basics.topology()
    world = world_topology.world
    size, rank = world_topology.size, world_topology.rank
    if process_set.mpi_comm is not None:
        comm = process_set.mpi_comm
        process_set.ranks = sorted(world.allgather(rank if comm.rank >= 0 else -1))
        process_set.ranks = [r for r in process_set.ranks if r >= 0]
    ranks = process_set.ranks
    if ranks is None:
        raise ValueError("add_process_set needs a ProcessSet of ranks")
    bad = [r for r in ranks if not 0 <= r < size]
    if bad or not ranks:
        raise ValueError(f"process set {ranks}: ranks must be within 0..{size - 1} and the set "
                         "non-empty")
    # Every rank must call with the same ranks, in the same order of calls: check, so a
    # mistake is a clear error on all ranks rather than a split that hangs.
    seen = world.allgather(tuple(ranks))
    if len(set(seen)) > 1:
        raise errors.MismatchError("add_process_set: ranks passed different sets: "
                                   + "; ".join(f"rank {r}: {list(s)}" for r, s in enumerate(seen)))
    with _lock:
        for existing, _, _ in _sets.values():
            if existing.ranks == ranks:
                raise ValueError(f"a process set with ranks {ranks} exists already "
                                 f"(id {existing.process_set_id})")
        set_id = _next_id[0]
        _next_id[0] += 1
    from mpi4py import MPI

    member = rank in ranks
    sub = world.Split(color=0 if member else MPI.UNDEFINED, key=rank)
    engine = topology = None
    if member:
        from .engine import Engine
        from .topology import Topology
        from .transports.select import TransportSet

        config = basics.config()
        topology = Topology.from_mpi(sub, config.local_size)
        engine = Engine(topology, config,
                        lambda should_stop: TransportSet(config, topology, should_stop))
        sub.Free()  # the topology holds its own duplicates
    process_set.process_set_id = set_id
    with _lock:
        _sets[set_id] = (process_set, engine, topology)
    return process_set


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set; every rank must call it, with the same ranks."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is registered already")
    return _build(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Stop a process set's engine on every rank; True if it existed. Call on every rank."""
    set_id = getattr(process_set, "process_set_id", None)
    if not set_id:
        return False
    with _lock:
        entry = _sets.pop(set_id, None)
    if entry is None:
        return False
    _, engine, topology = entry
    if engine is not None:
        engine.stop()
        topology.free()
    process_set.process_set_id = None
    return True


def init_process_sets(process_sets) -> None:
    """init(process_sets=[...]): register each (a 'dynamic' string is accepted, as Horovod's)."""
    if process_sets is None or isinstance(process_sets, str):
        return
    for ps in process_sets:
        add_process_set(ps)


def shutdown_process_sets() -> None:
    """Stop every set's engine (shutdown())."""
    with _lock:
        entries = list(_sets.values())
        _sets.clear()
        _next_id[0] = 1
    for ps, engine, topology in entries:
        ps.process_set_id = None
        if engine is not None:
            engine.stop()
            topology.free()


def by_id(process_set_id: int, what: str) -> ProcessSet:
    """The registered process set with this id (0: the global set), or a ValueError."""
    if process_set_id == 0:
        return global_process_set
    entry = _sets.get(process_set_id)
    if entry is None:
        raise ValueError(f"{what}: no process set with id {process_set_id} is registered")
    return entry[0]


def is_global(process_set) -> bool:
    """True for the global set (None, global_process_set, or a copy with id 0)."""
    return process_set is None or process_set is global_process_set or \
        getattr(process_set, "process_set_id", None) == 0


def is_member(process_set) -> bool:
    """True when this rank belongs to `process_set` (None and the global set: always).

    A rank outside a DistributedOptimizer's (or tape's) set keeps its own gradients,
    as in Horovod.
    """
    return is_global(process_set) or bool(process_set.included())


def size_of(process_set) -> int:
    """The number of ranks an op on `process_set` (None: the global set) runs over."""
    return basics.size() if is_global(process_set) else len(process_set.ranks or [])


def rank_in(process_set) -> int:
    """This rank's index among the ranks of `process_set` (None: the global set).

    Call it only on a member (ops on a set have been resolve()d first).
    """
    if is_global(process_set):
        return basics.rank()
    return list(process_set.ranks or []).index(basics.rank())


def resolve(process_set, what: str):
    """(engine, set ranks) for an op on `process_set` (None: the global set); clear errors
    for a set that is not registered or does not hold this rank."""
    if process_set is None or process_set is global_process_set:
        return basics.engine(), None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, got "
                        f"{type(process_set).__name__}")
    if is_global(process_set):
        return basics.engine(), None
    entry = _sets.get(process_set.process_set_id) if process_set.process_set_id else None
    if entry is None:
        raise ValueError(f"{what}: {process_set!r} is not registered; pass it to "
                         "init(process_sets=[...]) or add_process_set() first (on every rank)")
    _, engine, _ = entry
    if engine is None:
        raise ValueError(f"{what}: rank {basics.rank()} is not in {process_set!r}")
    return engine, process_set.ranks
