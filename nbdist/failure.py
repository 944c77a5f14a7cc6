"""One failure model for the notebook's cell loop and `nbdist run`: which rank caused a failure,
which errors merely followed from it, and the report the user reads (cause first).

No IPython and no ipyparallel here: the cell loop and the batch launcher collect each
rank's error and hand them to this module; ranks use it to decide whether to abort peers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes."""
    return _ANSI.sub("", text)


# Errors that are consequences of another rank's failure, not causes: aborting again for
# them would only replace the real reason in the peers' messages, and a report lists them
# after the cause. A KeyboardInterrupt is one too when the watcher itself interrupted the
# rank (a --timeout, a notebook interrupt, stragglers after an error).
FOLLOW_ON_ERRORS = frozenset({"AbortedError", "CollectiveTimeoutError"})

# The runtime's own errors (nbdist.common.errors), by name: what an unwrapped cause may be.
NBDIST_ERRORS = frozenset({"NbdistError", "NotInitializedError", "CollectiveError", "MismatchError",
                           "CollectiveTimeoutError", "AbortedError", "RuntimeBrokenError"})

# TensorFlow reports a Python exception raised inside a graph op (our numpy_function bridge)
# as UnknownError/InvalidArgumentError whose message embeds "nbdist.common.errors.X: text".
_WRAPPED = re.compile(r"^(?:nbdist\.common\.errors\.)(?P<ename>[A-Za-z]+Error): (?P<evalue>.*)$", re.M)

ABORT_WAIT_S = 6.0  # how long a failing rank waits for its abort to go round (bounded)


def rank_ranges(ranks: list[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def unwrap(ename: str, evalue: str) -> tuple[str, str]:
    """The nbdist error inside a framework's wrapper, else (ename, evalue) unchanged.

    TF's UnknownError('Graph execution error: ... MismatchError: ...') becomes
    ('MismatchError', '...'), so a headline names the root cause, not the wrapper.
    """
    if ename in NBDIST_ERRORS or not evalue:
        return ename, evalue
    found = [m for m in _WRAPPED.finditer(evalue) if m.group("ename") in NBDIST_ERRORS]
    if not found:
        return ename, evalue
    last = found[-1]  # the innermost: TF prints the op's traceback, ending in the error line
    return last.group("ename"), last.group("evalue").strip()


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """(name, message) of the root cause of an exception object: the nbdist error it was
    raised from (torch's and Keras' wrappers chain it), or the one embedded in its text."""
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ in NBDIST_ERRORS and type(cur).__module__.startswith("nbdist"):
            return type(cur).__name__, str(cur)
        cur = cur.__cause__ or cur.__context__
    return unwrap(type(exc).__name__, str(exc))


def is_follow_on(ename: str, evalue: str = "", interrupted_by_watcher: bool = False) -> bool:
    """True when this error follows from another rank's failure (or from our own interrupt)."""
    name, _ = unwrap(ename, evalue)
    if name == "KeyboardInterrupt":
        return interrupted_by_watcher
    return name in FOLLOW_ON_ERRORS


def abort_reason(rank: int | None, ename: str, evalue: str) -> str:
    """What the peers' AbortedError says: 'rank 1 raised ValueError: corrupt batch'."""
    first = evalue.splitlines()[0] if evalue else ""
    return f"rank {rank} raised {ename}" + (f": {first}" if first else "")


def abort_peers(rank: int | None, exc: BaseException, wait_s: float = ABORT_WAIT_S) -> bool:
    """Release the peers of a rank whose code raised: fail every in-flight collective on every
    rank (nbdist.common.abort). Bounded, so a broken runtime can't hang the failing rank.

    Not for follow-on errors (the peers were released already, and aborting again would replace
    the real reason) nor for KeyboardInterrupt (an interrupted collective aborts by itself, and a
    notebook interrupt reaches every rank). True if an abort was sent.
    """
    import sys
    import threading

    if isinstance(exc, KeyboardInterrupt):
        return False
    ename, evalue = describe_exception(exc)
    if ename in FOLLOW_ON_ERRORS:
        return False
    common = sys.modules.get("nbdist.common")
    if common is None:
        return False
    try:
        if not common.is_initialized():
            return False
    except Exception:
        return False
    done = threading.Event()

    def _call():
        try:
            common.abort(abort_reason(rank, ename, evalue)[:500])
        except Exception as err:  # the rank's own error is what the user must see
            print(f"nbdist: abort failed on this rank: {err!r}", file=sys.stderr)
        finally:
            done.set()

    threading.Thread(target=_call, name="nbdist-abort", daemon=True).start()
    # The runtime waits (bounded) until the abort went round, so this rank's next ops
    # start in the new epoch; waiting here too keeps the next cell clean.
    done.wait(wait_s)
    return True


@dataclass
class RankError:
    """One rank's error in a failed cell or run (ename/evalue: the unwrapped root cause)."""
    rank: int
    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)
    follow_on: bool = False
    time: float | None = None  # when the rank failed (wall clock), if known
    wrapper: str | None = None  # the framework's exception around it (UnknownError ...)

    @classmethod
    def collect(cls, rank: int, ename: str, evalue: str, traceback: list[str] | None = None,
                interrupted_by_watcher: bool = False, time: float | None = None) -> "RankError":
        """A rank's error as reported (names and text), unwrapped and classified."""
        root, text = unwrap(ename, evalue)
        return cls(rank=rank, ename=root, evalue=text, traceback=list(traceback or []),
                   follow_on=is_follow_on(root, text, interrupted_by_watcher), time=time,
                   wrapper=ename if root != ename else None)

    def summary(self) -> str:
        """'ValueError: corrupt batch' (first line of the message)."""
        first = self.evalue.splitlines()[0] if self.evalue else ""
        return f"{self.ename}: {first}" if first else self.ename


def primary_cause(errors: list[RankError]) -> RankError | None:
    """The cause: the earliest failing rank whose error is not a follow-on (ties: lowest rank)."""
    causes = [e for e in errors if not e.follow_on]
    if not causes:
        return None
    return min(causes, key=lambda e: (e.time is None, e.time or 0.0, e.rank))


def raised_headline(primary: RankError) -> str:
    """'rank 1 raised MismatchError: ...' (the root cause, whatever wrapped it)."""
    return f"rank {primary.rank} raised {primary.summary()}"


def blame(statuses: dict[int, int], first_dead: set[int] | None = None) -> dict[int, int]:
    """The ranks that died by themselves, from mpiexec's wait statuses.

    MPI kills the other ranks with SIGKILL after the first death, so a rank with any other
    status is a cause. When every status is SIGKILL (a rank was killed with -9 itself, e.g. by
    the OOM killer), the ranks seen dying first (nbdist.mpi.deaths) are the cause.
    """
    from .mpi.hydra import culprits

    dead = culprits(statuses)
    if first_dead and len(dead) > 1 and set(first_dead) <= set(dead):
        return {r: s for r, s in dead.items() if r in first_dead}
    return dead


def died_headline(dead: dict[int, str], stopped: list[int] | None = None) -> str:
    """'rank 1 died (killed by signal 9)'; names the ranks MPI stopped because of it."""
    who = "; ".join(f"rank {r} died ({how})" for r, how in sorted(dead.items()))
    if stopped:
        who += (f"; MPI then stopped rank{'s' if len(stopped) != 1 else ''} {rank_ranges(stopped)}")
    return who


@dataclass
class FailureReport:
    """The whole story of a failed cell: the cause first, then what followed."""
    headline: str
    primary: RankError | None = None
    others: list[RankError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self, color: bool = True) -> list[str]:
        red, bold, dim, reset = ("\x1b[1;31m", "\x1b[1m", "\x1b[2m", "\x1b[0m") if color else ("",) * 4
        out = [f"{red}nbdist: {self.headline}{reset}"]
        if self.primary is not None:
            out.append(f"{bold}--- traceback of rank {self.primary.rank} ---{reset}")
            tb = self.primary.traceback or [f"{self.primary.ename}: {self.primary.evalue}"]
            out.extend(tb if color else [strip_ansi(line) for line in tb])
        if self.others:
            out.append(f"{bold}--- {'the other ranks' if self.primary is not None else 'the ranks'} ---{reset}")
            groups: dict[tuple[str, str], list[int]] = {}
            for err in self.others:
                first = err.evalue.splitlines()[0] if err.evalue else ""
                groups.setdefault((err.ename, first[:300]), []).append(err.rank)
            for (ename, evalue), ranks in groups.items():
                label = "rank" if len(ranks) == 1 else "ranks"
                out.append(f"{label} {rank_ranges(ranks)}: {ename}: {evalue}" if evalue else
                           f"{label} {rank_ranges(ranks)}: {ename}")
        for note in self.notes:
            out.append(f"{dim}{note}{reset}" if color else note)
        return out

    def text(self) -> str:
        return "\n".join(self.lines(color=False))
