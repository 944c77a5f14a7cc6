"""One small synchronous allreduce through each API users call, beside mpi4py, in one run.

    mpiexec -n 2 .venv/bin/python benchmarks/small_ops.py [--bytes 4096] [--iters 2000]

The calls a training loop makes between steps (a loss, an accuracy, a flag), each
repeated: nbdist.common on numpy (in place and not), nbdist.torch's `allreduce` and
`allreduce_`, nbdist.tensorflow's eager `allreduce`, each named and unnamed (Horovod
numbers unnamed ops in call order), and mpi4py's `comm.Allreduce` on the same bytes.
The cases run in alternating rounds; reported: the slowest rank's mean µs per call
(median of rounds) and its ratio to mpi4py's from the same rounds. torch and
TensorFlow rows appear when the framework imports.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", type=int, default=4096, help="bytes per allreduce (float32)")
    p.add_argument("--iters", type=int, default=2000, help="calls per case per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    import nbdist.common as nb
    from mpi4py import MPI

    nb.init()
    comm = MPI.COMM_WORLD
    a = np.ones(max(1, args.bytes // 4), np.float32)
    out = np.empty_like(a)
    cases = {
        "mpi4py Allreduce": lambda: comm.Allreduce(a, out),
        "numpy allreduce_ named": lambda: nb.allreduce_(a, op=nb.Sum, name="np.inplace"),
        "numpy allreduce named": lambda: nb.allreduce(a, op=nb.Sum, name="np.out"),
        "numpy allreduce unnamed": lambda: nb.allreduce(a, op=nb.Sum),
    }
    try:
        import torch

        import nbdist.torch as th

        t = torch.from_numpy(a.copy())
        cases["torch allreduce_ named"] = lambda: th.allreduce_(t, op=th.Sum, name="t.inplace")
        cases["torch allreduce named"] = lambda: th.allreduce(t, op=th.Sum, name="t.out")
        cases["torch allreduce unnamed"] = lambda: th.allreduce(t, op=th.Sum)
    except ImportError:
        pass
    try:
        import tensorflow as tf

        import nbdist.tensorflow as tfh

        x = tf.constant(a)
        cases["tf eager allreduce named"] = lambda: tfh.allreduce(x, op=tfh.Sum, name="tf.x")
        cases["tf eager allreduce unnamed"] = lambda: tfh.allreduce(x, op=tfh.Sum)
    except ImportError:
        pass

    def timed(fn) -> float:
        for _ in range(max(20, args.iters // 20)):
            fn()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return comm.allreduce((time.perf_counter() - start) / args.iters * 1e6, op=MPI.MAX)

    rows: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            rows[name].append(timed(fn))
    if comm.rank == 0:
        base = rows["mpi4py Allreduce"]
        print(f"small_ops: {comm.size} ranks, {a.nbytes} B float32 allreduce, "
              f"{args.rounds} rounds x {args.iters} calls (median)")
        print(f"{'':28s} {'µs per call':>12s} {'/ mpi4py':>9s}")
        for name, times in rows.items():
            ratio = statistics.median(t / b for t, b in zip(times, base))
            print(f"{name:28s} {statistics.median(times):12.2f} {ratio:8.2f}x")
    nb.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
