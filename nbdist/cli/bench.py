"""`nbdist bench`: the collective benchmarks of benchmarks/collectives.py, started under mpiexec.

    nbdist bench -n 4 --sizes 4K,4M,64M --json out.json --plot out.png

With -n (default 2) it starts `mpiexec -n N` itself; run under mpiexec already, it
measures in this process. The other options go to benchmarks/collectives.py.

From Python (a notebook, a script): `measure(ranks=[1, 2], sizes=["4K", "1M"])` runs the
same benchmark once per rank count and returns its measurements as rows.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..mpi.hydra import mpiexec_path
from ..mpi.ranks import under_mpi_launcher

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "collectives.py"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `nbdist bench`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `nbdist bench -- -n 4 ...` passes options through the CLI's parser
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="nbdist bench", add_help=False)
    parser.add_argument("-n", "--np", dest="n", type=int, default=None)
    parser.add_argument("-h", "--help", action="store_true")
    ours, rest = parser.parse_known_args(argv)
    if not SCRIPT.exists():
        print(f"nbdist bench: {SCRIPT} is missing (the benchmarks ship with the source tree, "
              "not the wheel); run it from a checkout", file=sys.stderr)
        return 2
    if ours.help:
        rest = ["--help"]
    spec = importlib.util.spec_from_file_location("nbdist_bench_collectives", SCRIPT)
    assert spec is not None and spec.loader is not None, SCRIPT
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print("usage: nbdist bench [-n N] [options below]") if ours.help else None
    try:
        if under_mpi_launcher() or ours.help:
            return module.run(rest)
        module.parse_args(rest)  # a typo is told here, once, not by every rank
    except SystemExit as exc:  # --help, or argparse's error
        return int(exc.code or 0)
    cmd = [mpiexec_path(), "-n", str(ours.n or 2), sys.executable, str(SCRIPT), *rest]
    print("running: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def measure(ranks: Iterable[int] = (2,), sizes: Iterable[int | str] = ("4K", "64K", "1M", "4M"),
            ops: Iterable[str] = ("allreduce",), impls: Iterable[str] = ("nbdist",),
            seconds: float = 0.1, repeats: int = 1, timeout: float = 600) -> list[dict]:
    """Run `nbdist bench` on each rank count and return one row per measurement.

    Each rank count (2 or more: one rank has nothing to communicate) is its own
    `mpiexec -n N` run of benchmarks/collectives.py (sizes as bytes or "4K"/"1M"; ops of
    allreduce, allgather, broadcast; impls of nbdist, nbdist-raw, mpi4py, gloo). A row is a
    dict: ranks, op, bytes, impl, time_us (the
    slowest rank's mean per op), algbw_GBps, busbw_GBps. Raises RuntimeError with the
    benchmark's output when a run fails.
    """
    if not SCRIPT.exists():
        raise RuntimeError(f"{SCRIPT} is missing (the benchmarks ship with the source tree, not the wheel)")
    ranks = [int(n) for n in ranks]
    if any(n < 2 for n in ranks):
        raise ValueError(f"measure(ranks={ranks}): every rank count must be at least 2")
    rows: list[dict] = []
    for n in ranks:
        with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [mpiexec_path(), "-n", str(n), sys.executable, str(SCRIPT),
                   "--ops", ",".join(ops), "--sizes", ",".join(str(s) for s in sizes),
                   "--impls", ",".join(impls), "--time", str(seconds), "--repeats", str(repeats),
                   "--json", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"nbdist bench on {n} ranks failed (exit {proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr)[-4000:]}")
            for row in json.loads(out.read_text())["rows"]:
                for impl in impls:
                    if impl in row:  # gloo is left out where torch is missing
                        rows.append({"ranks": row["ranks"], "op": row["op"], "bytes": row["bytes"],
                                     "impl": impl, "time_us": row[impl]["time_us"],
                                     "algbw_GBps": row[impl]["algbw_GBps"],
                                     "busbw_GBps": row[impl]["busbw_GBps"]})
    return rows


if __name__ == "__main__":
    sys.exit(main())
