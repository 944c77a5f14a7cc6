"""Benchmark: the two-level (hierarchical) allreduce against flat MPI on simulated hosts.

    sudo .venv/bin/python tests/multinode/bench_two_level.py [--layout h1:2,h2:2] [--sizes 4K,64K,1M,16M]

Starts the simulated hosts (tests/multinode/simhosts.py), runs this file on every
rank under `mpiexec -launcher ssh -hosts ...`, and prints one row per size: the
median time of nbdist's hierarchical transport (shm inside a host, MPI between host
leaders), of nbdist's flat MPI transport (every rank in one MPI allreduce) and of
mpi4py's Allreduce on the same communicator, interleaved in one run, with ratios.
Not a test: timings on a shared machine are noisy; compare the ratios.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bytes(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def ranks_main(sizes: list[int], seconds: float, repeats: int) -> None:
    import numpy as np
    from mpi4py import MPI

    from nbdist.common.config import Config
    from nbdist.common.ops_base import ReduceOp
    from nbdist.common.topology import Topology
    from nbdist.common.transports.select import TransportSet

    comm = MPI.COMM_WORLD
    config = Config.from_environment()
    topo = Topology.from_mpi(comm, config.local_size)
    ts = TransportSet(config, topo, lambda: None)
    hier = ts.for_op("cpu", "allreduce")
    assert hier.name == "hierarchical", hier.name
    flat_comm = comm.Dup()
    impls = {
        "two-level": lambda b: hier.allreduce(b, ReduceOp.Sum),
        "flat (nbdist mpi)": lambda b: ts.mpi.allreduce(b, ReduceOp.Sum),
        "flat (mpi4py)": lambda b: flat_comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM),
    }
    rows = []
    for size in sizes:
        buf = np.ones(size // 4, np.float32)
        results = {name: [] for name in impls}
        for _ in range(repeats):
            for name, fn in impls.items():
                fn(buf)  # warm up
                comm.Barrier()
                iters, t0 = 0, time.perf_counter()
                while True:
                    fn(buf)
                    iters += 1
                    # every rank must run the same number of iterations: rank 0 decides
                    done = comm.bcast(time.perf_counter() - t0 >= seconds and iters >= 3, root=0)
                    if done:
                        break
                elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                results[name].append(elapsed / iters)
        rows.append((size, {k: sorted(v)[len(v) // 2] for k, v in results.items()}))
    if comm.rank == 0:
        hosts = sorted(set(topo.hosts))
        print(f"allreduce float32 sum, {comm.size} ranks on {len(hosts)} simulated hosts "
              f"({', '.join(f'{h}: {topo.hosts.count(h)}' for h in hosts)}); median of {repeats}")
        names = list(impls)
        print("| size | " + " | ".join(names) + " | flat mpi / two-level | mpi4py / two-level |")
        print("|---|" + "---|" * (len(names) + 2))
        for size, t in rows:
            cells = " | ".join(f"{t[n] * 1e6:,.0f} µs" for n in names)
            print(f"| {size:,} B | {cells} | {t[names[1]] / t[names[0]]:.2f} | "
                  f"{t[names[2]] / t[names[0]]:.2f} |")
    ts.close()
    topo.free()
    flat_comm.Free()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="h1:2,h2:2", help="hydra host list (hosts h1, h2, ...)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument("--time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [_bytes(s) for s in args.sizes.split(",")]
    if args.ranks:
        ranks_main(sizes, args.time, args.repeats)
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from multinode.simhosts import SimHosts

    names = [h.split(":")[0] for h in args.layout.split(",")]
    n = sum(int(h.split(":")[1]) for h in args.layout.split(","))
    sim = SimHosts(names).start()
    try:
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        cmd = [mpiexec, "-launcher", "ssh", "-hosts", args.layout, "-localhost",
               sim.controller_address, "-n", str(n), sys.executable, __file__, "--ranks",
               "--layout", args.layout, "--sizes", args.sizes, "--time", str(args.time),
               "--repeats", str(args.repeats)]
        return subprocess.call(cmd, env={**os.environ, **sim.env()}, cwd=ROOT,
                               stdin=subprocess.DEVNULL)
    finally:
        sim.stop()


if __name__ == "__main__":
    sys.exit(main())
