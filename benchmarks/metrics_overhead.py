"""What nbdist.report() costs a training loop, beside its peers, in one run.

    .venv/bin/python benchmarks/metrics_overhead.py [--json out.json] [--no-engine]

Measured where report() really runs: in this process (the text-line sink of `nbdist run`) and
inside a real ipyparallel MPI engine (the datapub sink of a %%distributed cell). Per place:
  - a bare Python call with the same arguments (the floor any API pays),
  - report(loss=...) between publishes (the hot path: the rate limiter says "not yet"),
  - report(..., flush=True) (one publish: numbers, pickle, IOPub send),
  - tqdm.update() on a disabled-output bar (the peer users know), when tqdm is installed,
and the overhead on a 5 ms training step: per-call cost + publish cost x publishes per step
(at most 10 publishes a second = 1 every 20 steps of 5 ms), as a percentage, plus the same
measured directly on a loop of 5 ms CPU-work steps, in process CPU time (noisier: a few
tenths of a percent of jitter on a shared machine). Target: < 1 %.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys


def measure(calls: int = 200_000, publishes: int = 2_000, steps: int = 200, step_s: float = 0.005,
            rounds: int = 7) -> dict:
    """Time report() and its peers here; returns seconds per call and loop overheads."""
    import os
    import time

    import nbdist.rank.report as m

    perf = time.perf_counter
    reporter = m.get_reporter()

    def noop(step=None, total=None, **metrics):
        return False

    def per_call(fn, n):
        best = float("inf")
        for _ in range(3):
            t0 = perf()
            for _ in range(n):
                fn()
            best = min(best, (perf() - t0) / n)
        return best

    result = {"sink": type(reporter.sink).__name__, "interval_s": reporter.interval}
    result["bare_call_s"] = per_call(lambda: noop(loss=0.5), calls)
    before = reporter.publishes
    result["report_s"] = per_call(lambda: m.report(loss=0.5), calls)
    result["publishes_in_hot_loop"] = reporter.publishes - before
    result["publish_s"] = per_call(lambda: m.report(loss=0.5, flush=True), publishes)
    try:
        import tqdm

        bar = tqdm.tqdm(total=None, disable=False, file=open(os.devnull, "w"), mininterval=0.1)
        result["tqdm_update_s"] = per_call(lambda: bar.update(1), calls)
        bar.close()
    except ImportError:
        result["tqdm_update_s"] = None

    publishes_per_step = step_s / reporter.interval if reporter.interval else 1.0
    cost = result["report_s"] + result["publish_s"] * min(1.0, publishes_per_step)
    result["computed_overhead_pct"] = 100.0 * cost / step_s

    # The direct check: 5 ms of CPU work per step, timed in CPU seconds of the whole process
    # (so the engine's IOPub thread is counted, and a busy shared machine's preemption is not).
    cpu = time.process_time

    def work(n):
        total = 0
        for i in range(n):
            total += i
        return total

    n_work = 20_000
    while True:  # calibrate: n_work loop iterations = one 5 ms step
        t0 = cpu()
        work(n_work)
        took = cpu() - t0
        if took > 0.002:
            n_work = int(n_work * step_s / took)
            break
        n_work *= 2

    def loop(with_report):
        t0 = cpu()
        for i in range(steps):
            work(n_work)
            if with_report:
                m.report(step=i + 1, total=steps, loss=1.0 / (i + 1))
        return cpu() - t0

    plain, control, reported = float("inf"), float("inf"), float("inf")
    for _ in range(rounds):  # interleaved, best of each: drift hits all three alike
        plain = min(plain, loop(False))
        reported = min(reported, loop(True))
        control = min(control, loop(False))
    result["loop_plain_s"], result["loop_report_s"] = plain, reported
    result["measured_overhead_pct"] = 100.0 * (reported - plain) / plain
    # The same loop twice without report(): the noise floor of the measured figure.
    result["noise_pct"] = 100.0 * abs(control - plain) / plain
    return result


def run_here() -> dict:
    """In this process: the text-line sink, writing to /dev/null so the terminal stays quiet."""
    saved = sys.stderr
    sys.stderr = open(os.devnull, "w")
    try:
        return measure()
    finally:
        sys.stderr.close()
        sys.stderr = saved


def run_on_engine() -> dict:
    """Inside one real ipyparallel MPI engine: the datapub sink of a %%distributed cell."""
    import ipyparallel as ipp

    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    cluster = ipp.Cluster(engines="mpi", n=1, log_level=40)
    client = cluster.start_and_connect_sync(activate=False)
    try:
        view = client[:]
        code = inspect.getsource(measure) + "\n__nbdist_bench = measure()\n"
        view.execute(code, block=True)
        return view.pull("__nbdist_bench", block=True)[0]
    finally:
        client.close()
        cluster.stop_cluster_sync()


def table(rows: dict[str, dict]) -> str:
    us = lambda s: "-" if s is None else f"{s * 1e6:8.3f} us"  # noqa: E731
    lines = [f"{'where':<22}{'bare call':>12}{'report()':>12}{'publish':>12}{'tqdm.update':>13}"
             f"{'report/bare':>13}{'report/tqdm':>13}{'5ms step %':>12}{'measured %':>12}{'noise %':>10}"]
    for where, r in rows.items():
        vs_tqdm = f"{r['report_s'] / r['tqdm_update_s']:.2f}x" if r.get("tqdm_update_s") else "-"
        lines.append(f"{where:<22}{us(r['bare_call_s']):>12}{us(r['report_s']):>12}"
                     f"{us(r['publish_s']):>12}{us(r['tqdm_update_s']):>13}"
                     f"{r['report_s'] / r['bare_call_s']:>12.2f}x{vs_tqdm:>13}"
                     f"{r['computed_overhead_pct']:>11.3f}%{r['measured_overhead_pct']:>11.2f}%"
                     f"{r['noise_pct']:>9.2f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--no-engine", action="store_true", help="skip the ipyparallel engine run")
    args = parser.parse_args(argv)
    rows = {"nbdist run (text)": run_here()}
    if not args.no_engine:
        rows["ipyparallel engine"] = run_on_engine()
    print(table(rows))
    print("5ms step %: (report() + publish x publishes per 5 ms step) / 5 ms; target < 1 %.")
    print("measured %: CPU time of 200 steps of 5 ms work with vs without report(), best of 7;")
    print("noise %: the same loop without report() against itself (the measured figure's floor).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
