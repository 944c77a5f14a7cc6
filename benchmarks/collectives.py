"""Collective benchmarks: nbdist beside mpi4py (same MPI) and torch.distributed gloo, one run.

Run on every rank under mpiexec (`nbdist bench -n 4` starts it for you):

    mpiexec -n 4 python benchmarks/collectives.py --sizes 4K,4M,64M --json out.json

For each op and size it times, with the same buffers and iteration counts on all ranks:
  nbdist      the public API (nbdist.common.allreduce_ / allgather / broadcast_: the engine)
  nbdist-raw  the transport the engine would pick, called directly (engine overhead = the gap)
  mpi4py      comm.Allreduce / Allgather / Bcast on the same MPI
  gloo        torch.distributed with the gloo backend (when torch is installed)
Time per op is the slowest rank's mean, the median of --repeats interleaved measurements.
algbw = bytes / time; busbw follows nccl-tests: allreduce × 2(n-1)/n, allgather × (n-1)/n
(bytes = the gathered total), broadcast × 1.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import numpy as np

from nbdist.common.sizes import MiB, format_bytes, parse_bytes

DEFAULT_SIZES = "4K,64K,1M,4M,16M,64M,256M"
OPS = ("allreduce", "allgather", "broadcast")
IMPLS = ("nbdist", "nbdist-raw", "mpi4py", "gloo")


def size_list(text: str) -> list[int]:
    """--sizes: bytes, comma-separated (4096, 4K, 1.5M, 2GiB)."""
    try:
        return [parse_bytes(s) for s in text.split(",") if s]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv):
    p = argparse.ArgumentParser(prog="nbdist bench", description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated: allreduce,allgather,broadcast")
    p.add_argument("--sizes", type=size_list, default=DEFAULT_SIZES,
                   help=f"bytes per rank's buffer (default {DEFAULT_SIZES})")
    p.add_argument("--impls", default=",".join(IMPLS), help="which of nbdist,nbdist-raw,mpi4py,gloo")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--time", type=float, default=0.25, help="seconds to spend per measurement (default 0.25)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements per implementation, interleaved; the median is reported (default 3)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--json", dest="json_file", help="write the rows to this JSON file")
    p.add_argument("--plot", dest="plot_file", help="draw busbw against size to this image (matplotlib)")
    p.add_argument("--markdown", dest="markdown_file", help="write the tables as Markdown to this file")
    return p.parse_args(argv)


class Peers:
    """Sets up each implementation once; call(impl, op, buf, out) runs one op."""

    def __init__(self, comm, impls):
        self.comm = comm
        self.impls = list(impls)
        self.hvd = self.raw = self.dist = self.torch = None
        if "nbdist" in impls or "nbdist-raw" in impls:
            import nbdist.common as hvd
            from nbdist.common.config import Config
            from nbdist.common.topology import Topology
            from nbdist.common.transports.select import TransportSet

            hvd.init(comm)
            self.hvd = hvd
            config = Config.from_environment()
            self._topology = Topology.from_mpi(comm, config.local_size)
            self.raw = TransportSet(config, self._topology, lambda: None)
        if "gloo" in impls:
            try:
                import torch
                import torch.distributed as dist
            except ImportError:
                self.impls.remove("gloo")
            else:
                from peer_group import init_peer_group

                init_peer_group("gloo", comm.rank, comm.size, lambda value: comm.bcast(value, root=0))
                self.dist, self.torch = dist, torch

    def transport_name(self, op: str) -> str:
        return self.raw.for_op("cpu", op).name if self.raw else "-"

    def call(self, impl: str, op: str, buf: np.ndarray, out: np.ndarray, ctx: dict) -> None:
        from mpi4py import MPI

        n = self.comm.size
        if impl == "mpi4py":
            if op == "allreduce":
                self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            elif op == "allgather":
                self.comm.Allgather(buf, out)
            else:
                self.comm.Bcast(buf, root=0)
        elif impl == "nbdist":
            hvd = self.hvd
            if op == "allreduce":
                hvd.allreduce_(buf, op=hvd.Sum, name="bench.allreduce")
            elif op == "allgather":
                hvd.allgather(buf, name="bench.allgather")  # the API's result is the output
            else:
                hvd.broadcast_(buf, 0, name="bench.broadcast")
        elif impl == "nbdist-raw":
            from nbdist.common.ops_base import ReduceOp

            t = self.raw.for_op("cpu", op)
            if op == "allreduce":
                t.allreduce(buf, ReduceOp.Sum)
            elif op == "allgather":
                t.allgatherv(buf, out, [buf.size] * n)
            else:
                t.broadcast(buf, 0)
        elif impl == "gloo":
            tb = ctx["tb"]
            if op == "allreduce":
                self.dist.all_reduce(tb)
            elif op == "allgather":
                self.dist.all_gather(ctx["to_list"], tb)
            else:
                self.dist.broadcast(tb, 0)

    def close(self):
        if self.raw is not None:
            self.raw.close()
            self._topology.free()
        if self.dist is not None:
            self.dist.destroy_process_group()


def measure(peers: Peers, impl: str, op: str, nbytes: int, dtype, seconds: float, min_iters: int) -> float:
    """Mean seconds per op, the slowest rank's, with the same iteration count on every rank."""
    from mpi4py import MPI

    comm = peers.comm
    n = comm.size
    count = max(1, nbytes // np.dtype(dtype).itemsize)
    buf = np.ones(count, dtype)
    out = np.empty(count * n, dtype) if op == "allgather" else None
    ctx = {}
    if impl == "gloo":
        torch = peers.torch
        ctx["tb"] = torch.from_numpy(buf)
        ctx["to"] = torch.from_numpy(out) if out is not None else None
        if out is not None:
            ctx["to_list"] = list(ctx["to"].chunk(n))
    for _ in range(2):  # warm-up: first-touch pages, connections, caches
        peers.call(impl, op, buf, out, ctx)
    comm.Barrier()
    start = time.perf_counter()
    peers.call(impl, op, buf, out, ctx)
    probe = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    iters = max(min_iters, min(10000, int(seconds / max(probe, 1e-7))))
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        peers.call(impl, op, buf, out, ctx)
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


def memcpy_reference(nbytes: int = 64 * MiB, trials: int = 3) -> float:
    """One core's numpy copyto bandwidth (bytes of array per second) at `nbytes`: the best of `trials`."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    for _ in range(2):
        np.copyto(dst, src)
    best, iters = 0.0, 10
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            np.copyto(dst, src)
        best = max(best, nbytes * iters / (time.perf_counter() - start))
    return best


def bus_factor(op: str, n: int) -> float:
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "broadcast": 1.0}[op]


def run(argv) -> int:
    from mpi4py import MPI

    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    ops = [o for o in args.ops.split(",") if o]
    sizes = args.sizes
    impls = [i for i in args.impls.split(",") if i]
    peers = Peers(comm, impls)
    impls = peers.impls
    comm.Barrier()
    memcpy = memcpy_reference() if rank == 0 else 0.0  # the others wait: one core really alone
    memcpy = comm.bcast(memcpy, root=0)
    rows = []
    if rank == 0:
        print(f"nbdist bench: {n} ranks on {socket.gethostname()}, {args.dtype}, "
              f"single-core memcpy (numpy copyto, 64 MiB) {memcpy / 1e9:.2f} GB/s")
        print("transports: " + ", ".join(f"{op}→{peers.transport_name(op)}" for op in ops))
    for op in ops:
        if rank == 0:
            header = f"{'size':>9} " + "".join(f"| {i + ' time':>17} {'algbw':>6} {'busbw':>6} " for i in impls)
            # API: nbdist's user path (hvd.allreduce...); raw: its transport alone
            print(f"\n{op} (GB/s; ratios of busbw: nbdist's API, and raw, against each peer)")
            print(header + "| API/mpi4py | raw/mpi4py |   API/gloo |   raw/gloo | raw % memcpy")
        for nbytes in sizes:
            row = {"op": op, "bytes": nbytes, "ranks": n, "dtype": args.dtype,
                   "memcpy_GBps": memcpy / 1e9}
            # Interleaved repeats: a burst of load from elsewhere on a shared machine
            # hits every implementation alike, and the median drops the outliers.
            times = {impl: [] for impl in impls}
            for _ in range(max(1, args.repeats)):
                for impl in impls:
                    times[impl].append(measure(peers, impl, op, nbytes, np.dtype(args.dtype),
                                               args.time, args.min_iters))
            for impl in impls:
                per_op = float(np.median(times[impl]))
                moved = nbytes * n if op == "allgather" else nbytes
                algbw = moved / per_op / 1e9
                row[impl] = {"time_us": per_op * 1e6, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * bus_factor(op, n),
                             "all_time_us": [t * 1e6 for t in times[impl]]}
            best = row.get("nbdist-raw") or row.get("nbdist")
            if best:
                for peer in ("mpi4py", "gloo"):
                    if peer in row:
                        row[f"busbw_vs_{peer}"] = best["busbw_GBps"] / row[peer]["busbw_GBps"]
                        row[f"time_vs_{peer}"] = best["time_us"] / row[peer]["time_us"]
                row["busbw_pct_memcpy"] = 100 * best["busbw_GBps"] / (memcpy / 1e9)
            if "nbdist" in row:  # the same ratios through the engine (its overhead included)
                for peer in ("mpi4py", "gloo"):
                    if peer in row:
                        row[f"engine_busbw_vs_{peer}"] = row["nbdist"]["busbw_GBps"] / row[peer]["busbw_GBps"]
                        row[f"engine_time_vs_{peer}"] = row["nbdist"]["time_us"] / row[peer]["time_us"]
            rows.append(row)
            if rank == 0:
                cells = "".join(f"| {row[i]['time_us']:>14.1f} us {row[i]['algbw_GBps']:>6.2f} "
                                f"{row[i]['busbw_GBps']:>6.2f} " for i in impls)
                ratios = "".join(f"| {row[k]:>9.2f}x " if k in row else "|          - "
                                 for k in ("engine_busbw_vs_mpi4py", "busbw_vs_mpi4py",
                                           "engine_busbw_vs_gloo", "busbw_vs_gloo"))
                pct = f"| {row['busbw_pct_memcpy']:>11.1f}%" if "busbw_pct_memcpy" in row else ""
                print(f"{format_bytes(nbytes):>9} {cells}{ratios}{pct}", flush=True)
    peers.close()
    if rank == 0:
        if args.json_file:
            with open(args.json_file, "w") as f:
                json.dump({"ranks": n, "memcpy_GBps": memcpy / 1e9, "rows": rows}, f, indent=1)
        if args.plot_file:
            plot(rows, impls, n, args.plot_file)
        if args.markdown_file:
            with open(args.markdown_file, "w") as f:
                f.write(markdown(rows, impls, n, memcpy))
    return 0


def markdown(rows, impls, n, memcpy) -> str:
    """The rows as Markdown tables (time per op and busbw per implementation, and the ratios)."""
    out = [f"{n} ranks, single-core memcpy {memcpy / 1e9:.2f} GB/s; busbw in GB/s; "
           "raw = the transport alone, engine = through nbdist.common\n"]
    for op in [o for o in OPS if any(r["op"] == o for r in rows)]:
        head = "| " + op + " | " + " | ".join(f"{i} time | {i} busbw" for i in impls)
        head += (" | raw busbw vs mpi4py | raw busbw vs gloo | raw time vs gloo | raw % of memcpy"
                 " | engine busbw vs mpi4py | engine busbw vs gloo | engine time vs gloo |")
        out += [head, "|" + "---|" * (head.count("|") - 1)]
        for r in (r for r in rows if r["op"] == op):
            cells = " | ".join(f"{r[i]['time_us']:.1f} µs | {r[i]['busbw_GBps']:.2f}" for i in impls)
            ratios = " | ".join(f"{r[k]:.2f}×" if k in r else "-"
                                for k in ("busbw_vs_mpi4py", "busbw_vs_gloo", "time_vs_gloo"))
            pct = f"{r['busbw_pct_memcpy']:.0f} %" if "busbw_pct_memcpy" in r else "-"
            engine = " | ".join(f"{r[k]:.2f}×" if k in r else "-" for k in
                                ("engine_busbw_vs_mpi4py", "engine_busbw_vs_gloo", "engine_time_vs_gloo"))
            out.append(f"| {format_bytes(r['bytes'])} | {cells} | {ratios} | {pct} | {engine} |")
        out.append("")
    return "\n".join(out)


def plot(rows, impls, n, path) -> None:
    """busbw against size, one panel per op, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op]
        for impl in impls:
            ax.plot([r["bytes"] for r in mine], [r[impl]["busbw_GBps"] for r in mine], marker="o", label=impl)
        ax.axhline(mine[0]["memcpy_GBps"], color="grey", linestyle=":", label="1-core memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op}, {n} ranks")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
