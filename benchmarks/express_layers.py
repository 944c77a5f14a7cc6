"""Where a small synchronous allreduce's microseconds go on the express path, layer by layer.

    mpiexec -n 2 .venv/bin/python benchmarks/express_layers.py [--bytes 4096] [--iters 3000]

Each layer of a cached `allreduce_` (docs/common-api.md, "Unnamed ops, and torch's
layer") is called directly, every rank in step, beside mpi4py's `comm.Allreduce`:
the user call (`nbdist.common.allreduce_`), `Engine.express`, `ShmAgreement.express`
(agreement lock held), the shm transport's `express_allreduce`, the native
`express_allreduce` itself (vote and bytes in one call), and the native allreduce
alone (`allreduce_into`, no vote). The difference between two rows is what that
layer costs. Reported: the slowest rank's mean µs per call, median of rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, default=4096, help="bytes per allreduce (float32)")
    p.add_argument("--iters", type=int, default=3000, help="calls per layer per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    import nbdist.common as nb
    from mpi4py import MPI

    from nbdist.common import basics
    from nbdist.common.engine import EXPRESS_WAIT_S
    from nbdist.common.requests import ALLREDUCE

    nb.init()
    comm = MPI.COMM_WORLD
    eng = basics.engine()
    agreement = eng.agreement
    if agreement is None:
        if comm.rank == 0:
            print("express_layers: no shm agreement here (ranks on more than one node?)")
        nb.shutdown()
        return 1
    a = np.ones(max(1, args.bytes // 4), np.float32)
    out = np.empty_like(a)
    op = nb.Sum
    for _ in range(50):  # cached, and its express plan worked out
        nb.allreduce_(a, op=op, name="layers")
    plan = agreement._express_plans["layers"]
    seg, nbits = agreement.seg, agreement._vote_slots()
    native, data = seg._native, plan.transport._native
    dtype, op_code, factor = plan.args
    timeout_s, stop = seg.timeout_s, seg.should_stop

    layers = {
        "mpi4py Allreduce": (False, lambda: comm.Allreduce(a, out)),
        "user allreduce_": (False, lambda: nb.allreduce_(a, op=op, name="layers")),
        "Engine.express": (False, lambda: eng.express(ALLREDUCE, "layers", a, True, op)),
        "ShmAgreement.express": (True, lambda: agreement.express(
            ALLREDUCE, "layers", a, True, op, 1.0, -1, EXPRESS_WAIT_S)),
        "transport express_allreduce": (True, lambda: seg.express_allreduce(
            plan.cid, nbits, EXPRESS_WAIT_S, plan.transport, a, a, *plan.args)),
        "native express_allreduce": (True, lambda: native.express_allreduce(
            plan.cid, nbits, EXPRESS_WAIT_S, data, a, a, a.size, dtype, op_code, factor,
            timeout_s, stop)),
        "native allreduce_into": (True, lambda: data.allreduce_into(
            a, a, a.size, dtype, op_code, 1.0, timeout_s, stop)),
    }

    def timed(fn) -> float:
        for _ in range(100):
            fn()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return comm.allreduce((time.perf_counter() - start) / args.iters * 1e6, op=MPI.MAX)

    rows: dict[str, list[float]] = {k: [] for k in layers}
    for _ in range(args.rounds):
        for name, (locked, fn) in layers.items():
            if locked:  # as Engine.express holds it; the engine thread waits meanwhile
                agreement.lock.acquire()
            try:
                rows[name].append(timed(fn))
            finally:
                if locked:
                    agreement.hold(False)
                    agreement.lock.release()
    if comm.rank == 0:
        print(f"express_layers: {comm.size} ranks, {a.nbytes} B float32, "
              f"{args.rounds} rounds x {args.iters} calls (median, slowest rank)")
        for name, v in rows.items():
            print(f"  {name:30s} {statistics.median(v):7.2f} us")
    nb.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
