"""The `nbdist` command: run (batch twin of a cell), bench, doctor.

Each subcommand lives in its own module; this file only dispatches, so the
command's start-up stays fast and a broken extra does not break the others.
"""
from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nbdist", description="Notebook-first distributed training: batch runs, benchmarks, diagnostics.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a script on N MPI ranks (the batch twin of a %%distributed cell)")
    run.add_argument("-n", "--np", dest="n", type=int, default=1, help="number of ranks (default 1)")
    run.add_argument("--timeout", type=float, default=None, help="fail the run after this many seconds")
    run.add_argument("--env", action="append", default=[], metavar="K=V", help="set K=V on every rank")
    run.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                     help="run across hosts, as horovodrun -H: h1:2,h2:2 (one MPI world over ssh)")
    run.add_argument("--launcher", choices=["local", "ssh", "slurm"], default=None,
                     help="local (default), ssh (with --hosts), slurm (inside salloc/sbatch, or asks salloc)")
    run.add_argument("--elastic", action="store_true",
                     help="a rank that dies leaves the others running: hvd.elastic.run goes on from "
                          "the last commit on the survivors (this machine only; docs/elastic.md)")
    run.add_argument("--min-np", dest="min_np", type=int, default=None,
                     help="with --elastic: the fewest ranks the run goes on with (default 1)")
    run.add_argument("script", help="the Python script to run on every rank")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    bench = sub.add_parser("bench", help="collective benchmarks, nbdist beside mpi4py and gloo")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of the benchmark (see --help)")

    sub.add_parser("doctor", help="what this machine has: MPI, shared memory, NCCL, GPUs, frameworks")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nbdist` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its options (-n, --sizes ...) belong to the benchmark's parser
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "run" and (args.elastic or args.min_np is not None):
        if not args.elastic:
            print("nbdist run: --min-np needs --elastic", file=sys.stderr)
            return 2
        if args.hosts or args.launcher not in (None, "local"):
            print("nbdist run: --elastic runs on this machine only (no --hosts/--launcher)", file=sys.stderr)
            return 2
        from .elastic_run import run_elastic

        return run_elastic(args.script, args.args, n=args.n, min_np=args.min_np or 1,
                           timeout=args.timeout, env=args.env)
    if args.command == "run":
        from .run import run_script

        return run_script(args.script, args.args, n=args.n, timeout=args.timeout, env=args.env,
                          hosts=args.hosts, launcher=args.launcher)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(args.bench_args)
    if args.command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
