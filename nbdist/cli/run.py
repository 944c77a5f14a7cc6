"""`nbdist run -n N script.py [args]`: the batch twin of a %%distributed cell.

The same code on the same MPI (this environment's mpiexec), with the notebook's error
reporting: every rank's output streamed live and tagged by rank, and on failure the
raising rank's traceback first (peers released through the runtime's abort), the
others summarised, a dead rank named with its exit status, and a nonzero exit status.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..failure import FailureReport, RankError, blame, died_headline, primary_cause, raised_headline, rank_ranges
from ..mpi.hosts import (HostsError, LinkWatch, banner_deaths, check_slots, hydra_ssh_args,
                         in_slurm_allocation, lost_host_line, parse_hosts, placement, remote_death_line)
from ..mpi.exits import RankExits
from ..mpi.hydra import decode_wait_status, mpiexec_path, parse_exit_codes
from ..mpi.reaper import remove_orphan_segments
from ..wire import LAUNCH_HOST_ENV, REPORT_DIR_ENV, read_death_records, read_error_records

TIMEOUT_EXIT = 124
KILL_GRACE_S = 5.0
PUMP_WAIT_S = 5.0  # after mpiexec exited, for the rest of its output to be read
PUMP_EXTRA_WAIT_S = 10.0  # more, only while its exit-code report is still missing
DEATH_RECORD_WAIT_S = 3.0  # for a remote host's segment keepers to record which rank exited first

# hydra's own lines, which we replace by our summary.
_HYDRA_NOISE = ("=====", "=   ", "YOUR APPLICATION TERMINATED", "This typically refers to a problem",
                "Please see the FAQ page", "[mpiexec@", "[proxy:")


_REPORT_LINE = re.compile(r"^\[[^\]]+\] [0-9,]+\s*$")


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
    in_report = False  # inside hydra's exit-code report (one "[host] codes" line per host)
    for line in iter(stream.readline, ""):
        captured.append(line)
        if not line.strip():
            blank.append(line)
            continue
        if line.startswith(_HYDRA_NOISE) or (in_report and _REPORT_LINE.match(line)):
            in_report = in_report or "Exit codes:" in line
            blank.clear()
            continue
        in_report = False
        sink.write("".join(blank) + line)
        blank.clear()
        sink.flush()


def run_script(script: str, args: list[str] | None = None, n: int = 1, timeout: float | None = None,
               env=None, hosts=None, launcher: str | None = None) -> int:
    """Run script on n ranks under mpiexec; print a failure report; return the exit status.

    hosts ('h1:2,h2:2', as horovodrun -H) runs one MPI world across them through hydra's
    ssh bootstrap; launcher 'slurm' runs inside the current allocation, or asks for one
    with salloc.
    """
    args = list(args or [])
    launcher = launcher or ("ssh" if hosts else "local")
    try:
        slots = parse_hosts(hosts or [])
        if slots:
            check_slots(n, slots)
        if launcher == "ssh" and not slots:
            raise HostsError("--launcher ssh needs --hosts, e.g. --hosts h1:2,h2:2")
        if launcher == "slurm" and slots:
            raise HostsError("--launcher slurm takes its hosts from Slurm; drop --hosts")
        spread = hydra_ssh_args(slots) if slots else []
    except HostsError as exc:
        print(f"nbdist run: {exc}", file=sys.stderr)
        return 2
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
    # Ranks on other hosts write their error records here too: with hosts, in the working
    # directory (hydra starts every rank there; a cluster shares it), not this machine's /tmp.
    report_dir = tempfile.mkdtemp(prefix=".nbdist-run-", dir=os.getcwd() if slots else None)
    run_env = {**os.environ, **extra, REPORT_DIR_ENV: report_dir, LAUNCH_HOST_ENV: socket.gethostname()}
    cmd = [mpiexec_path(), "-print-all-exitcodes", "-n", str(n), *spread]
    if launcher == "slurm" and not in_slurm_allocation():
        if shutil.which("salloc") is None:
            print("nbdist run: --launcher slurm needs Slurm's salloc (or run inside salloc/sbatch)",
                  file=sys.stderr)
            shutil.rmtree(report_dir, ignore_errors=True)
            return 2
        # an allocation of n tasks; inside it hydra starts its proxies with srun
        cmd = ["salloc", "--quiet", "-n", str(n), "--job-name=nbdist-run", *cmd]
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
    watch = LinkWatch(proc.pid, [h for h, _ in slots]) if slots else None
    exits = RankExits(report_dir, run_env[LAUNCH_HOST_ENV], n)
    lost: list[str] = []
    unreported: dict[int, int | None] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            step = 0.5  # how often to look at the ranks' ends and the ssh links
            if deadline is not None:
                step = min(step, max(0.0, deadline - time.monotonic()))
            try:
                proc.wait(timeout=step)
                break
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                _stop(proc)
                break
            lost = watch.lost() if watch is not None else []
            if lost:  # a host's ssh link ended while mpiexec runs: its ranks are gone
                _stop(proc)
                break
            unreported = exits.unexplained()
            if unreported:  # a rank died and mpiexec did not act on it: its peers may wait for ever
                _stop(proc)
                break
    except KeyboardInterrupt:
        interrupted = True
        _stop(proc)
    finally:
        exits.stop(kill=timed_out or interrupted or bool(lost) or bool(unreported))
    pump.join(PUMP_WAIT_S)
    if pump.is_alive() and not any("Exit codes:" in line for line in list(captured)):
        # A loaded machine: mpiexec's exit-code report may still sit in the pipe.
        pump.join(PUMP_EXTRA_WAIT_S)
    # Ranks that MPI killed never unlinked their segments; remove the ones nobody maps.
    remove_orphan_segments(started)
    try:
        return _summarise(proc.returncode, "".join(captured), report_dir, n, timeout, timed_out,
                          interrupted, started, slots, lost, unreported)
    finally:
        _remove_report_dir(report_dir, remote=bool(slots))


def _remove_report_dir(report_dir: str, remote: bool) -> None:
    """Remove the run's report folder. With ranks on other hosts, a segment keeper may still be
    writing its death record there for a moment after mpiexec has exited, so look again."""
    for _ in range(10 if remote else 1):
        shutil.rmtree(report_dir, ignore_errors=True)
        if not os.path.exists(report_dir):
            time.sleep(0.2)
            if not os.path.exists(report_dir):
                return
        time.sleep(0.2)


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


def _first_exits(report_dir: str, where: dict[str, list[int]]) -> dict[str, int]:
    """host -> the rank that died first there: the one whose segment keeper, when it saw the
    rank gone, saw every other rank of the host still running. A host is left out when no
    record says so (the keepers came after the others died too): never a guessed rank."""
    first = {}
    for rec in read_death_records(report_dir):
        host, rank = str(rec.get("host")), int(rec.get("rank", -1))
        others = set(where.get(host, [])) - {rank}
        if others and others <= set(rec.get("alive", [])):
            first[host] = rank
    return first


def _exit_code(status: int) -> int:
    """This launcher's exit status for a rank's wait status, as a shell gives it: 128 + signal."""
    return 128 + (status & 0x7F) if status & 0x7F else (status >> 8) or 1


def _summarise(rc: int, output: str, report_dir: str, n: int, timeout, timed_out: bool,
               interrupted: bool, started: float, slots=(), lost=(), unreported=None) -> int:
    unreported = unreported or {}
    errors = _read_reports(report_dir, interrupted_by_us=timed_out or interrupted or bool(lost))
    statuses = parse_exit_codes(output, placement(list(slots), n) if slots else None)
    reported = {e.rank for e in errors}
    primary = primary_cause(errors)
    others = sorted((e for e in errors if e is not primary), key=lambda e: e.rank)
    dead = {r: s for r, s in blame(statuses).items() if r not in reported}
    banners = banner_deaths(output) if slots else []
    if banners and all(s == 9 for s in dead.values()):
        # Across hosts hydra reports exit codes only for this host's ranks, and those it
        # SIGKILLed in its clean-up after the remote death that its banner names: not causes.
        dead = {}
    notes = []
    named: set[int] = set()  # the ranks the headline names as dead
    if timed_out:
        headline = f"the run took longer than --timeout {timeout:g} s; every rank was stopped"
        code = TIMEOUT_EXIT
    elif interrupted:
        headline = "interrupted: every rank was stopped"
        code = 130
    elif lost:  # we stopped the ranks: their errors are follow-ons of the lost host
        where = placement(list(slots), n)
        headline = "; ".join(lost_host_line(h, where.get(h, [])) for h in lost)
        code, primary, others = 255, None, []
    elif primary is not None:
        headline = raised_headline(primary)
        code = 1
    elif unreported:  # ranks this launcher saw end while mpiexec ran on; it stopped the rest
        status = {r: s if s is not None else statuses.get(r) for r, s in unreported.items()}
        headline = died_headline({r: decode_wait_status(s) if s is not None else
                                  "mpiexec did not report its exit status" for r, s in status.items()})
        code = _exit_code(status[next(iter(status))] or 0x100)  # unknown: exit status 1
        named, dead = set(unreported), {}
    elif dead:
        headline = died_headline({r: decode_wait_status(s) for r, s in dead.items()})
        code = _exit_code(dead[min(dead)])
        named, dead = set(dead), {}
    elif banners:
        # across hosts hydra prints no exit-code report for a remote death: its banner names the
        # host, and the first exit its ranks' segment keepers recorded there names the rank
        where = placement(list(slots), n)
        first = _first_exits(report_dir, where)
        deadline = time.monotonic() + DEATH_RECORD_WAIT_S
        while any(h not in first for h, _ in banners) and time.monotonic() < deadline:
            time.sleep(0.05)  # the keepers write as the ranks exit, mpiexec may exit as soon
            first = _first_exits(report_dir, where)
        headline = "; ".join(remote_death_line(h, c, first.get(h), where.get(h, [])) for h, c in banners)
        code = rc or 1
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
    # the others: stopped by MPI (a nonzero status in its report), or by us after an unreported death
    stopped = sorted(r for r in range(n) if r not in reported and r not in dead and r not in named
                     and (statuses.get(r, 0) or unreported))
    if stopped and not timed_out:
        notes.append(f"rank{'s' if len(stopped) != 1 else ''} {rank_ranges(stopped)} "
                     f"{'were' if len(stopped) != 1 else 'was'} stopped by {'nbdist run' if unreported else 'MPI'}"
                     " after the failure")
    report = FailureReport(headline, primary, others, notes)
    color = sys.stderr.isatty()
    print("\n".join(report.lines(color=color)), file=sys.stderr, flush=True)
    return code
