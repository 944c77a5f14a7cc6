"""One collective in a long loop, through nbdist's API or mpi4py: something to profile.

    perf record -F 1000 -g -D 3000 -- mpiexec -n 2 .venv/bin/python benchmarks/op_loop.py \
        --op allgather --impl api --bytes 4194304 --iters 4000

`perf record -D` skips the start-up (imports, init) so the profile is the loop's; rank 0
prints the mean µs per call. The API's calls are the ones users make (`hvd.allgather`
returns a new array; `allreduce_` and `broadcast_` work in place); mpi4py's are
`Allgather` into a buffer it keeps, `Allreduce` in place, `Bcast`. allreduce uses Max, so
the values stay put over any number of calls.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=("allreduce", "allgather", "broadcast"), default="allgather")
    p.add_argument("--impl", choices=("api", "mpi4py"), default="api")
    p.add_argument("--bytes", type=int, default=4 << 20, help="bytes per rank (float32)")
    p.add_argument("--iters", type=int, default=4000)
    args = p.parse_args()

    import nbdist.common as hvd

    hvd.init()
    comm = MPI.COMM_WORLD
    x = np.full(max(1, args.bytes // 4), hvd.rank(), np.float32)
    out = np.empty(x.size * comm.size, np.float32)
    calls = {
        ("api", "allreduce"): lambda: hvd.allreduce_(x, op=hvd.Max, name="loop"),
        ("api", "allgather"): lambda: hvd.allgather(x, name="loop"),
        ("api", "broadcast"): lambda: hvd.broadcast_(x, 0, name="loop"),
        ("mpi4py", "allreduce"): lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.MAX),
        ("mpi4py", "allgather"): lambda: comm.Allgather(x, out),
        ("mpi4py", "broadcast"): lambda: comm.Bcast(x, root=0),
    }
    call = calls[(args.impl, args.op)]
    for _ in range(5):  # the API's first calls negotiate; the loop runs cached
        call()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        call()
    comm.Barrier()
    if comm.rank == 0:
        per_call = (time.perf_counter() - start) / args.iters
        print(f"{args.impl} {args.op} {args.bytes} B: {per_call * 1e6:.1f} us per call", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
