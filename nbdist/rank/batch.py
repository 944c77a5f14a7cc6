"""Per-rank wrapper of `nbdist run`: run the script as __main__, report a failure, release peers.

A rank whose script raises writes its error (rank, type, message, traceback, time)
to $NBDIST_REPORT_DIR for the launcher, which prints the cause first; it then calls
the runtime's abort so peers waiting in a collective fail at once, and exits without
MPI_Finalize (which could wait for ever on peers stuck in plain MPI calls): mpiexec
then stops whatever is still running. It also records its pid at start and that its script
returned at the end, so the launcher can tell a rank that died from one that finished
(nbdist.mpi.exits).
"""
from __future__ import annotations

import faulthandler
import os
import runpy
import socket
import sys
import time
import traceback

from .. import failure
from ..common.config import env_path, env_str
from ..mpi.ranks import env_rank
from ..mpi.segment_keeper import start_if_remote
from ..wire import LAUNCH_HOST_ENV, REPORT_DIR_ENV, write_done_record, write_error_record, write_start_record


def _report(folder: str | None, rank: int, exc: BaseException, tb_lines: list[str]) -> None:
    if not folder:
        sys.stderr.write("".join(tb_lines))
        return
    ename, evalue = failure.describe_exception(exc)  # the root cause, not a framework's wrapper
    record = {"rank": rank, "ename": ename, "evalue": evalue, "traceback": tb_lines, "time": time.time()}
    write_error_record(folder, record)


def _user_frames(exc: BaseException) -> list[str]:
    """The traceback without this wrapper's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return traceback.format_exception(type(exc), exc, tb)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m nbdist.rank.batch SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    rank = env_rank() or 0
    folder = env_path(REPORT_DIR_ENV.removeprefix("NBDIST_"))
    faulthandler.enable()  # a segfault prints this rank's Python frames (tagged by mpiexec)
    start_if_remote(env_str(LAUNCH_HOST_ENV.removeprefix("NBDIST_")), folder, rank)
    if folder:
        try:
            write_start_record(folder, rank, os.getpid(), socket.gethostname())
        except OSError:  # no watch of this rank's end: hydra's report still names it
            pass
    # One write per line: mpiexec tags each write with the rank, so a print must not be split.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            _done(folder, rank)
            return 0
        code = exc.code if isinstance(exc.code, int) else 1
        _report(folder, rank, exc, [f"SystemExit: {exc.code}\n"])
        _finish(rank, exc, code)
    except BaseException as exc:
        _report(folder, rank, exc, _user_frames(exc))
        _finish(rank, exc, 130 if isinstance(exc, KeyboardInterrupt) else 1)
    _done(folder, rank)
    return 0


def _done(folder: str | None, rank: int) -> None:
    """The script returned: what ends this process now (MPI_Finalize, exit) is not a death."""
    if folder:
        try:
            write_done_record(folder, rank)
        except OSError:  # the launcher's folder is gone (it stopped the run): nothing to tell
            pass


def _finish(rank: int, exc: BaseException, code: int) -> None:
    if failure.abort_peers(rank, exc):
        time.sleep(0.5)  # let the released peers write their own (follow-on) reports
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
