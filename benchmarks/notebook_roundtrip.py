"""Notebook overheads of nbdist beside ipyparallel's own, measured in the same run.

1. Warm round trip of a trivial cell on 4 engines: `%%distributed` vs ipyparallel's
   `%%px` (both on an already-running cluster; target: at most 1.5x %%px).
2. Cold start of 4 MPI engines: nbdist's cluster start (controller, mpiexec, engine
   hooks) vs `ipyparallel.Cluster(engines="mpi", n=4).start_and_connect_sync()`
   (target: at most +1 s).

    python benchmarks/notebook_roundtrip.py [--n 4] [--reps 30] [--starts 3] [--json out.json]

Runs inside a terminal IPython shell (the magics need one); ranks are real MPI engines.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbdist")
    return ip


def warm_roundtrip(ip, n: int, reps: int) -> dict:
    import ipyparallel as ipp
    from traitlets.config import Config

    from nbdist.notebook import magics
    from nbdist.mpi.hydra import mpiexec_path

    dist = magics._loaded[id(ip)]
    ip.run_cell_magic("distributed", f"-n {n} --output none --no-widgets", "x = 1")

    cfg = Config()
    cfg.MPILauncher.mpi_cmd = [mpiexec_path()]
    px_cluster = ipp.Cluster(engines="mpi", n=n, config=cfg, log_level=40)
    rc = px_cluster.start_and_connect_sync()
    try:
        view = rc[:]
        view.block = True
        view.activate()  # registers %%px on this shell
        ip.run_cell_magic("px", "", "x = 1")

        def timed(fn):
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            return samples

        # interleave to share the machine's noise fairly
        dist_s, px_s = [], []
        for _ in range(3):
            dist_s += timed(lambda: ip.run_cell_magic("distributed", "--output none --no-widgets", "x + 1"))
            px_s += timed(lambda: ip.run_cell_magic("px", "", "x + 1"))
    finally:
        rc.close()
        px_cluster.stop_cluster_sync()
        dist.cluster.stop(quiet=True)
    return {"distributed_ms": statistics.median(dist_s) * 1e3, "px_ms": statistics.median(px_s) * 1e3}


def cold_start(n: int, starts: int) -> dict:
    import ipyparallel as ipp
    from traitlets.config import Config

    from nbdist.notebook.cluster import DistCluster
    from nbdist.mpi.hydra import mpiexec_path

    ours, theirs = [], []
    for _ in range(starts):
        c = DistCluster(notify=lambda *a, **k: None)
        t0 = time.perf_counter()
        c.start(n)
        ours.append(time.perf_counter() - t0)
        c.stop(quiet=True)

        cfg = Config()
        cfg.MPILauncher.mpi_cmd = [mpiexec_path()]
        t0 = time.perf_counter()
        cl = ipp.Cluster(engines="mpi", n=n, config=cfg, log_level=40)
        rc = cl.start_and_connect_sync()
        theirs.append(time.perf_counter() - t0)
        rc.close()
        cl.stop_cluster_sync()
    return {"nbdist_start_s": statistics.median(ours), "ipp_start_s": statistics.median(theirs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30, help="cells per round (3 interleaved rounds)")
    parser.add_argument("--starts", type=int, default=3, help="cold starts of each")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)

    ip = _shell()
    warm = warm_roundtrip(ip, args.n, args.reps)
    cold = cold_start(args.n, args.starts)
    ratio = warm["distributed_ms"] / warm["px_ms"]
    extra = cold["nbdist_start_s"] - cold["ipp_start_s"]
    print(f"\nnbdist notebook overheads, {args.n} MPI engines, {os.cpu_count()} cores (medians)")
    print(f"{'':34}{'nbdist':>10}{'ipyparallel':>13}{'':>4}result   target")
    print(f"{'warm trivial cell (%%distributed/%%px)':34}{warm['distributed_ms']:>8.1f}ms{warm['px_ms']:>11.1f}ms"
          f"    {ratio:.2f}x    <= 1.5x {'ok' if ratio <= 1.5 else 'MISSED'}")
    print(f"{'cold start of the MPI engines':34}{cold['nbdist_start_s']:>9.2f}s{cold['ipp_start_s']:>12.2f}s"
          f"    {extra:+.2f}s   <= +1 s {'ok' if extra <= 1.0 else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, **warm, **cold, "ratio": ratio, "extra_start_s": extra}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
