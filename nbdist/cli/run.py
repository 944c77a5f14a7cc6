"""`nbdist run -n N script.py [args]`: the batch twin of a %%distributed cell.

The same code on the same MPI (this environment's mpiexec), with the notebook's error
reporting: every rank's output streamed live and tagged by rank, and on failure the
raising rank's traceback first (peers released through the runtime's abort), the
others summarised, a dead rank named with its exit status, and a nonzero exit status.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..failure import FailureReport, RankError, blame, died_headline, primary_cause, raised_headline, rank_ranges
from ..mpi.hydra import decode_wait_status, mpiexec_path, parse_exit_codes
from ..mpi.reaper import remove_orphan_segments
from ..wire import REPORT_DIR_ENV, read_error_records

TIMEOUT_EXIT = 124
KILL_GRACE_S = 5.0
PUMP_WAIT_S = 5.0  # after mpiexec exited, for the rest of its output to be read
PUMP_EXTRA_WAIT_S = 10.0  # more, only while its exit-code report is still missing

# hydra's own lines, which we replace by our summary.
_HYDRA_NOISE = ("=====", "=   ", "YOUR APPLICATION TERMINATED", "This typically refers to a problem",
                "Please see the FAQ page", "[mpiexec@")


def _env_dict(env) -> dict[str, str]:
    if env is None:
        return {}
    if isinstance(env, dict):
        return {str(k): str(v) for k, v in env.items()}
    out = {}
    for item in env:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env expects K=V, got {item!r}")
        out[key] = val
    return out


def _pump(stream, sink, captured: list[str]) -> None:
    """Forward rank output line by line; keep hydra's report for parsing instead of printing it."""
    blank = []  # blank lines are held back: hydra's banner starts with some
    for line in iter(stream.readline, ""):
        captured.append(line)
        if not line.strip():
            blank.append(line)
            continue
        if line.startswith(_HYDRA_NOISE):
            blank.clear()
            continue
        sink.write("".join(blank) + line)
        blank.clear()
        sink.flush()


def run_script(script: str, args: list[str] | None = None, n: int = 1, timeout: float | None = None,
               env=None) -> int:
    """Run script on n ranks under mpiexec; print a failure report; return the exit status."""
    args = list(args or [])
    if n < 1:
        print(f"nbdist run: -n must be at least 1, got {n}", file=sys.stderr)
        return 2
    if not Path(script).is_file():
        print(f"nbdist run: no such script: {script}", file=sys.stderr)
        return 2
    try:
        extra = _env_dict(env)
    except ValueError as exc:
        print(f"nbdist run: {exc}", file=sys.stderr)
        return 2
    report_dir = tempfile.mkdtemp(prefix="nbdist-run-")
    run_env = {**os.environ, **extra, REPORT_DIR_ENV: report_dir}
    cmd = [mpiexec_path(), "-print-all-exitcodes", "-n", str(n)]
    if n > 1:
        cmd.append("-prepend-rank")
    cmd += [sys.executable, "-m", "nbdist.rank.batch", script, *args]
    captured: list[str] = []
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=run_env, start_new_session=True, bufsize=1)
    pump = threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, captured), daemon=True)
    pump.start()
    timed_out = interrupted = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    except KeyboardInterrupt:
        interrupted = True
        _stop(proc)
    pump.join(PUMP_WAIT_S)
    if pump.is_alive() and not any("Exit codes:" in line for line in list(captured)):
        # A loaded machine: mpiexec's exit-code report may still sit in the pipe.
        pump.join(PUMP_EXTRA_WAIT_S)
    # Ranks that MPI killed never unlinked their segments; remove the ones nobody maps.
    remove_orphan_segments(started)
    try:
        return _summarise(proc.returncode, "".join(captured), report_dir, n, timeout, timed_out,
                          interrupted, started)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """Interrupt the ranks, then kill the whole process group if they linger."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(KILL_GRACE_S if sig != signal.SIGKILL else 10)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_reports(report_dir: str, interrupted_by_us: bool) -> list[RankError]:
    """Each failed rank's record, unwrapped and classified by the failure module."""
    errors = []
    for rec in read_error_records(report_dir):
        tb = [line for chunk in rec.get("traceback", []) for line in chunk.rstrip("\n").split("\n")]
        errors.append(RankError.collect(rec["rank"], rec["ename"], rec["evalue"], tb,
                                        interrupted_by_watcher=interrupted_by_us, time=rec.get("time")))
    return errors


def _summarise(rc: int, output: str, report_dir: str, n: int, timeout, timed_out: bool,
               interrupted: bool, started: float) -> int:
    errors = _read_reports(report_dir, interrupted_by_us=timed_out or interrupted)
    statuses = parse_exit_codes(output)
    reported = {e.rank for e in errors}
    primary = primary_cause(errors)
    others = sorted((e for e in errors if e is not primary), key=lambda e: e.rank)
    dead = {r: s for r, s in blame(statuses).items() if r not in reported}
    notes = []
    if timed_out:
        headline = f"the run took longer than --timeout {timeout:g} s; every rank was stopped"
        code = TIMEOUT_EXIT
    elif interrupted:
        headline = "interrupted: every rank was stopped"
        code = 130
    elif primary is not None:
        headline = raised_headline(primary)
        code = 1
    elif dead:
        headline = died_headline({r: decode_wait_status(s) for r, s in dead.items()})
        first_status = dead[min(dead)]
        code = 128 + (first_status & 0x7F) if first_status & 0x7F else (first_status >> 8) or 1
        dead = {}
    elif errors:
        headline = "every failing rank failed with follow-on errors only"
        code = rc or 1
    elif rc != 0:
        headline = f"mpiexec exited with status {rc}"
        code = rc
    else:
        return 0
    for r, s in sorted(dead.items()):
        notes.append(f"rank {r} died ({decode_wait_status(s)})")
    stopped = sorted(r for r in range(n) if r not in reported and r not in dead and statuses.get(r, 0))
    if stopped and not timed_out:
        notes.append(f"rank{'s' if len(stopped) != 1 else ''} {rank_ranges(stopped)} "
                     f"{'were' if len(stopped) != 1 else 'was'} stopped by MPI after the failure")
    report = FailureReport(headline, primary, others, notes)
    color = sys.stderr.isatty()
    print("\n".join(report.lines(color=color)), file=sys.stderr, flush=True)
    return code
