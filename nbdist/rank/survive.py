"""`python -m nbdist.rank.survive CMD ...`: run one rank of an elastic world so that its death
does not stop its peers.

hydra (MPICH's mpiexec) kills every rank when one is killed by a signal, even with
-disable-auto-cleanup, which spares the others only when a rank *exits*. So an elastic
cluster starts each engine under this small parent: it runs CMD as its child, forwards
the signals mpiexec relays (interrupt, terminate), and when the child dies it exits
normally with the shell's code for it (128 + signal), which hydra reports and survives.
The child keeps the parent's environment and file descriptors (MPI's PMI connection).
"""
from __future__ import annotations

import os
import signal
import sys

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# hydra signals SIGUSR1 to the remaining ranks when one fails (MPICH's fault notification);
# nbdist learns of deaths by itself, and Python's default for SIGUSR1 would end the rank.
IGNORED = (signal.SIGUSR1,)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m nbdist.rank.survive CMD [ARGS...]", file=sys.stderr)
        return 2
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    for signum in IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 1
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
