"""`nbdist bench`: the collective benchmarks of benchmarks/collectives.py, started under mpiexec.

    nbdist bench -n 4 --sizes 4K,4M,64M --json out.json --plot out.png

With -n (default 2) it starts `mpiexec -n N` itself; run under mpiexec already, it
measures in this process. The other options go to benchmarks/collectives.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
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
    under_mpi = under_mpi_launcher()
    if under_mpi or ours.help:
        spec = importlib.util.spec_from_file_location("nbdist_bench_collectives", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print("usage: nbdist bench [-n N] [options below]") if ours.help else None
        try:
            return module.run(rest)
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
    cmd = [mpiexec_path(), "-n", str(ours.n or 2), sys.executable, str(SCRIPT), *rest]
    print("running: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
