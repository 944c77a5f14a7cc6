"""Slots against single copy (CMA), on the path users call: allreduce_, allgather, broadcast_.

    mpiexec -n 2 .venv/bin/python benchmarks/cma_threshold.py [--sizes 64K,256K,1M,4M,16M]

The shm transport moves an allgather or a broadcast either through its slots (two
copies, pipelined chunk by chunk) or by single copy (`process_vm_readv` from the owner's
buffer); an allreduce too, when the agreement's vote carries its addresses. Which is
faster depends on size, on rank count and on whether each op starts with the ranks in
step: through the API every op follows its agreement vote, so no rank is still finishing
the last op when the next begins, unlike a loop of raw transport calls. This measures
the API's ops (named, cached: the express path) with one transport switched between the
paths between rounds (every rank at once, after a barrier), beside mpi4py's Allreduce,
Allgather and Bcast in the same rounds (allreduce_: Max in place, as mpi4py's;
allreduce: the default Average into a new array, against mpi4py's Sum into a buffer it
keeps). Reported per size (bytes per rank): the slowest rank's mean µs per call, median
of rounds, and the CMA/slots, CMA+vote/CMA and best/mpi4py time ratios. "CMA+vote": the agreement's vote carries each
rank's addresses, so the single-copy op needs no synchronisation of its own before the
reads (ShmComm::vote_allreduce / vote_allgatherv / vote_broadcast, the default); "CMA":
the op syncs on its data segment after the vote (an allreduce: through the slots).
docs/native.md has the figures and the thresholds chosen from them
(NBDIST_SHM_CMA_BYTES, NBDIST_SHM_CMA_ALLGATHER_BYTES, NBDIST_SHM_CMA_ALLREDUCE_BYTES).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from nbdist.common.sizes import parse_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64K,256K,1M,4M,16M", help="bytes per rank, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.2, help="time per case per round (about)")
    args = p.parse_args(argv)

    import nbdist.common as nb
    from mpi4py import MPI

    nb.init()
    comm = MPI.COMM_WORLD
    transport = nb.basics.engine().transports.for_op("cpu", "allgather")
    if transport.__class__.__name__ != "ShmTransport":
        print("cma_threshold: the CPU transport here is not shm (ranks on several nodes?)")
        nb.shutdown()
        return 1
    vote = nb.basics.engine().agreement.native
    # (broadcast, allgather, allreduce) thresholds in bytes, whether the vote carries a CMA
    # op's addresses ("CMA": the op's own syncs on the data segment after the vote), and
    # the kinds whose path is tuned: "tuned" is the default, the thresholds nbdist starts
    # from and local rank 0's choice by measurement (it starts afresh in each round)
    modes = {"slots": ((0, 0, 0), False, ()), "CMA": ((1, 1, 1), False, ()),
             "CMA+vote": ((1, 1, 1), True, ()),
             "tuned": (transport.single_copy_bytes, True, ("broadcast", "allgather", "allreduce"))}

    def timed(fn) -> float:
        fn()
        comm.Barrier()
        start = time.perf_counter()
        fn()
        one = time.perf_counter() - start
        n = max(3, int(args.seconds / max(one, 1e-6)))
        n = comm.allreduce(n, op=MPI.MIN)  # every rank the same number of calls
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return comm.allreduce((time.perf_counter() - start) / n * 1e6, op=MPI.MAX)

    rows: dict[tuple[str, int, str], list[float]] = {}
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    for size in sizes:
        a = np.ones(size // 4, np.float32)
        b = a.copy()
        gathered = np.empty(a.size * comm.size, a.dtype)
        c = a.copy()
        summed = np.empty_like(a)
        cases = {
            "allreduce_": lambda c=c: nb.allreduce_(c, op=nb.Max, name=f"cma.r{c.nbytes}"),
            "allreduce": lambda a=a: nb.allreduce(a, name=f"cma.avg{a.nbytes}"),
            "allgather": lambda a=a: nb.allgather(a, name=f"cma.g{a.nbytes}"),
            "broadcast_": lambda b=b: nb.broadcast_(b, 0, name=f"cma.b{b.nbytes}"),
        }
        peers = {"allreduce_": lambda c=c: comm.Allreduce(MPI.IN_PLACE, c, op=MPI.MAX),
                 "allreduce": lambda a=a, out=summed: comm.Allreduce(a, out, op=MPI.SUM),
                 "allgather": lambda a=a, g=gathered: comm.Allgather(a, g),
                 "broadcast_": lambda b=b: comm.Bcast(b, root=0)}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                comm.Barrier()
                thresholds, carries, tuned = modes[mode]
                transport.set_single_copy(thresholds, tuned)
                vote.set_vote_carries(carries)
                comm.Barrier()
                for op, fn in cases.items():
                    rows.setdefault((op, size, mode), []).append(timed(fn))
            for op, fn in peers.items():
                rows.setdefault((op, size, "mpi4py"), []).append(timed(fn))
    if comm.rank == 0:
        print(f"cma_threshold: {comm.size} ranks, float32, {args.rounds} rounds (median); "
              "µs per call through the API")
        print(f"{'op':11s} {'bytes/rank':>10s} {'slots':>9s} {'CMA':>9s} {'CMA+vote':>9s} {'tuned':>9s} "
              f"{'mpi4py':>9s} {'CMA/slots':>9s} {'+vote/CMA':>9s} {'tuned/best':>10s} {'mpi4py/tuned':>12s}")
        for op in cases:
            for size in sizes:
                t = {m: statistics.median(rows[(op, size, m)]) for m in (*modes, "mpi4py")}
                best = min(t["slots"], t["CMA"], t["CMA+vote"])
                print(f"{op:11s} {size:10d} {t['slots']:9.1f} {t['CMA']:9.1f} {t['CMA+vote']:9.1f} "
                      f"{t['tuned']:9.1f} {t['mpi4py']:9.1f} {t['CMA'] / t['slots']:9.2f} "
                      f"{t['CMA+vote'] / t['CMA']:9.2f} {t['tuned'] / best:10.2f} "
                      f"{t['mpi4py'] / t['tuned']:12.2f}")
    nb.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
