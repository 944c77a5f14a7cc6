"""The wire format between a rank and the side that watches it (notebook kernel or `nbdist run`).

Both sides import this module and nothing else of each other, so the batch path never
pulls in the notebook side and a key is spelled in one place.

- Progress: a rank publishes dicts through ipyparallel's datapub (`AsyncResult.data` on the
  notebook side): STATE_KEY holds the rank's latest state, HISTORY_PREFIX + index one point
  of rank 0's metric history.
- Errors under `nbdist run`: a failing rank writes one JSON record per rank into the folder
  named by REPORT_DIR_ENV; the launcher reads them back after mpiexec exits. Every rank
  also writes a start record (its pid and host) and, once its script returns, a done record:
  the launcher watches its host's ranks with them (nbdist.mpi.exits).
- Hosts: LAUNCH_HOST_ENV names the launcher's host; a rank on another host has a segment
  keeper (nbdist.mpi.segment_keeper) that writes a death record when the rank exits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

STATE_KEY = "nbdist.progress"  # the rank's latest state, replaced on every publish
HISTORY_PREFIX = "nbdist.h."  # + index: one history point of rank 0; new keys, so none is lost

REPORT_DIR_ENV = "NBDIST_REPORT_DIR"
# The host `nbdist run` runs on: a rank on any other host spawns a segment keeper there.
LAUNCH_HOST_ENV = "NBDIST_LAUNCH_HOST"


def write_error_record(folder: str, record: dict) -> None:
    """Write one rank's error record atomically (the launcher never reads half a file)."""
    _write_atomic(folder, f"rank-{record['rank']}.json", record)


def read_error_records(folder: str) -> list[dict]:
    """Every complete error record in the folder, in file-name order."""
    return _read_all(folder, "rank-*.json")


def write_death_record(folder: str, rank: int, host: str, alive: list[int]) -> None:
    """A rank on another host was seen gone (by its segment keeper) while the ranks `alive` of
    that host still ran: hydra's banner names only the host; a rank seen gone while every
    other rank there still ran is the one that died first."""
    _write_atomic(folder, f"death-{rank}.json", {"rank": rank, "host": host, "alive": sorted(alive)})


def read_death_records(folder: str) -> list[dict]:
    """Every death record in the folder."""
    return _read_all(folder, "death-*.json")


def write_start_record(folder: str, rank: int, pid: int, host: str) -> None:
    """A rank of `nbdist run` started as process `pid` on `host` (see nbdist.mpi.exits)."""
    _write_atomic(folder, f"pid-{rank}.json", {"rank": rank, "pid": pid, "host": host})


def read_start_records(folder: str) -> list[dict]:
    """Every start record in the folder."""
    return _read_all(folder, "pid-*.json")


def write_done_record(folder: str, rank: int) -> None:
    """A rank's script returned: its process may now end without a word to anyone."""
    _write_atomic(folder, f"done-{rank}.json", {"rank": rank})


def read_done_ranks(folder: str) -> set[int]:
    """The ranks whose script returned."""
    return {int(rec["rank"]) for rec in _read_all(folder, "done-*.json")}


def _write_atomic(folder: str, name: str, record: dict) -> None:
    tmp = os.path.join(folder, f".{name}")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(folder, name))


def _read_all(folder: str, pattern: str) -> list[dict]:
    records = []
    for path in sorted(Path(folder).glob(pattern)):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records
