"""mpiexec (MPICH's hydra): the one way nbdist finds it and reads its exit-code report."""
from __future__ import annotations

import re
import shutil
import signal
import sys
from pathlib import Path


class MpiexecNotFound(RuntimeError):
    """No mpiexec in this environment nor on PATH."""


def venv_bin() -> Path:
    """The bin directory of the running Python: the MPI (mpich wheel) installed beside it."""
    return Path(sys.executable).parent


def mpiexec_path() -> str:
    """The mpiexec that belongs to this environment's mpi4py (the mpich wheel), else the PATH one."""
    candidate = venv_bin() / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if not found:
        raise MpiexecNotFound("no mpiexec found: install the mpich wheel (pip install mpich) or a system MPI")
    return found


def decode_wait_status(status: int) -> str:
    """Hydra reports raw wait statuses: exit code << 8, or the signal in the low bits."""
    if status == 0:
        return "exit status 0"
    if status & 0x7F:
        sig = status & 0x7F
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by signal {sig} ({name})"
    return f"exit status {status >> 8}"


# "[mpiexec@x] Exit codes: [h1] 0,0" and, with several hosts, one more line per host: "[h2] 0,9"
_EXIT_CODES_RE = re.compile(r"Exit codes: (?P<block>\[[^\]]+\] [0-9,]+(?:\n\[[^\]]+\] [0-9,]+)*)")
_HOST_CODES_RE = re.compile(r"\[(?P<host>[^\]]+)\] (?P<codes>[0-9,]+)")


def parse_exit_codes(output: str, ranks_by_host: dict[str, list[int]] | None = None) -> dict[int, int]:
    """Per-rank wait statuses from `mpiexec -print-all-exitcodes` output (ranks in order per host)."""
    result: dict[int, int] = {}
    next_rank = 0
    for block in _EXIT_CODES_RE.finditer(output):
        for match in _HOST_CODES_RE.finditer(block.group("block")):
            codes = [int(c) for c in match.group("codes").split(",") if c]
            host = match.group("host")
            ranks = (ranks_by_host or {}).get(host) or list(range(next_rank, next_rank + len(codes)))
            for rank, code in zip(ranks, codes):
                result[rank] = code
            next_rank += len(codes)
    return result


def culprits(codes: dict[int, int]) -> dict[int, int]:
    """The ranks that died by themselves: MPI kills the others with SIGKILL (9) after the first death."""
    nonzero = {r: c for r, c in codes.items() if c}
    own = {r: c for r, c in nonzero.items() if c != 9}
    return own or nonzero
