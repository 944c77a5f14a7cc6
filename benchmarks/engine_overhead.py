"""nbdist engine's steady-state cost per op, beside plain mpi4py on the same MPI, one run.

    mpiexec -n 2 .venv/bin/python benchmarks/engine_overhead.py [--ops 16] [--steps 300] [--api torch]

The steady state of training: every "step" submits the same named allreduces
(`--ops` of them, `--bytes` each) asynchronously, then synchronizes them all. Measured
in alternating rounds on every rank:

  sync       one named 4 KiB allreduce_ at a time (latency of one negotiated op)
  step       --ops named allreduce_async_ then synchronize each (fused by the engine)
  mpi4py     comm.Allreduce of one buffer (sync), and of --ops buffers one by one

Reported: wall µs per op/step (slowest rank's mean, median of rounds) and rank 0's
process CPU µs per step (all threads: the engine's thread included), and the ratios
nbdist / mpi4py measured in the same round. `--profile` prints rank 0's engine-thread
cProfile (top functions by own time) after the run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=16, help="allreduces per step (default 16)")
    p.add_argument("--bytes", type=int, default=4096, help="bytes per allreduce (default 4096)")
    p.add_argument("--steps", type=int, default=200, help="steps per round (default 200)")
    p.add_argument("--sync-iters", type=int, default=500, help="sync ops per round (default 500)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's engine thread")
    p.add_argument("--unnamed", action="store_true",
                   help="nbdist's ops without names (matched by order, as hvd.allreduce(x))")
    p.add_argument("--api", choices=("numpy", "torch"), default="numpy",
                   help="nbdist's ops on numpy arrays (nbdist.common) or on torch tensors "
                        "(nbdist.torch); default numpy")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    profiler = None
    if args.profile:
        import cProfile

        from nbdist.common import engine as engine_mod

        profiler = cProfile.Profile()

        def profiled(original):
            def run(self):
                if self.rank == 0:
                    profiler.runcall(original, self)
                else:
                    original(self)
            return run

        # the MPI coordinator's loop, and the shared-memory agreement's
        engine_mod.Engine._run = profiled(engine_mod.Engine._run)
        engine_mod.Engine._run_shm = profiled(engine_mod.Engine._run_shm)

    import nbdist.common as nb
    from mpi4py import MPI
    from nbdist.common import engine as engine_mod

    from nbdist.common import agreement as agreement_mod

    cycles = [0]  # the engine thread's passes (wake-ups), to see polling apart from noise
    original_cycle = engine_mod.Engine._cycle

    def counted_cycle(self, new, control):
        cycles[0] += 1
        return original_cycle(self, new, control)

    engine_mod.Engine._cycle = counted_cycle
    original_shm_cycle = agreement_mod.ShmAgreement.cycle

    def counted_shm_cycle(self, items):  # the shm agreement: one pass = one cycle
        cycles[0] += 1
        return original_shm_cycle(self, items)

    agreement_mod.ShmAgreement.cycle = counted_shm_cycle

    nb.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    elements = max(1, args.bytes // 4)
    one = np.ones(elements, np.float32)
    bufs = [np.ones(elements, np.float32) for _ in range(args.ops)]
    names = [f"grad.{i}" for i in range(args.ops)]

    def timed(fn, iters):
        comm.Barrier()
        n0, c0, t0 = cycles[0], time.process_time(), time.perf_counter()
        for _ in range(iters):
            fn()
        t, c = time.perf_counter() - t0, time.process_time() - c0
        t = comm.allreduce(t, op=MPI.MAX)
        n = comm.allreduce(cycles[0] - n0, op=MPI.MAX)
        return t / iters * 1e6, c / iters * 1e6, n / iters

    api, one_t, bufs_t = nb, one, bufs
    if args.api == "torch":
        import torch

        import nbdist.torch as api  # type: ignore[no-redef]

        one_t = torch.from_numpy(one)  # the same memory: mpi4py's rows use the same buffers
        bufs_t = [torch.from_numpy(b) for b in bufs]

    sync_name = None if args.unnamed else "sync"
    step_names = [None] * len(names) if args.unnamed else names

    def nb_sync():
        api.allreduce_(one_t, op=api.Sum, name=sync_name)

    def nb_step():
        handles = [api.allreduce_async_(b, op=api.Sum, name=n) for b, n in zip(bufs_t, step_names)]
        for h in handles:
            api.synchronize(h)

    def mpi_sync():
        comm.Allreduce(MPI.IN_PLACE, one, op=MPI.SUM)

    def mpi_step():
        for b in bufs:
            comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

    # warm-up: first negotiation, cache, fusion buffers
    for _ in range(20):
        nb_sync()
        nb_step()
        mpi_sync()
        mpi_step()

    rows = {k: [] for k in ("nb_sync", "mpi_sync", "nb_step", "mpi_step")}
    for _ in range(args.rounds):
        rows["nb_sync"].append(timed(nb_sync, args.sync_iters))
        rows["mpi_sync"].append(timed(mpi_sync, args.sync_iters))
        rows["nb_step"].append(timed(nb_step, args.steps))
        rows["mpi_step"].append(timed(mpi_step, args.steps))

    if rank == 0:
        def med(key, i):
            return statistics.median(r[i] for r in rows[key])

        def ratio(a, b):
            return statistics.median(x[0] / y[0] for x, y in zip(rows[a], rows[b]))

        unnamed = " (unnamed ops)" if args.unnamed else ""
        print(f"engine_overhead: {size} ranks, {args.api} API{unnamed}, {args.ops} x {args.bytes} B "
              "allreduces per step, "
              f"{args.rounds} rounds (median)")
        print(f"{'':28s} {'wall µs':>10s} {'cpu µs r0':>10s} {'engine passes (max rank)':>26s}")
        print(f"{'nbdist sync 1 op':28s} {med('nb_sync', 0):10.1f} {med('nb_sync', 1):10.1f} "
              f"{med('nb_sync', 2):26.1f}")
        print(f"{'mpi4py sync 1 op':28s} {med('mpi_sync', 0):10.1f} {med('mpi_sync', 1):10.1f}")
        print(f"{'nbdist step (async+fused)':28s} {med('nb_step', 0):10.1f} "
              f"{med('nb_step', 1):10.1f} {med('nb_step', 2):26.1f}")
        print(f"{'mpi4py step (one by one)':28s} {med('mpi_step', 0):10.1f} "
              f"{med('mpi_step', 1):10.1f}")
        print(f"nbdist/mpi4py: sync {ratio('nb_sync', 'mpi_sync'):.1f}x, "
              f"step {ratio('nb_step', 'mpi_step'):.2f}x; nbdist step per op "
              f"{med('nb_step', 0) / args.ops:.1f} µs wall, {med('nb_step', 1) / args.ops:.1f} µs cpu")
    nb.shutdown()
    if profiler is not None and rank == 0:
        import pstats

        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
