"""Running one cell on every rank and turning what happened into output or one clear error.

The wait loop polls the cell's AsyncResult every POLL_S: it streams each rank's
new output, drives the progress view, and
watches for the fault paths:
  - a rank raised: its peers get ERROR_GRACE_S to fail by themselves (the
    engine-side hook calls the runtime's abort), then the stragglers get SIGINT;
  - a rank died: MPI stops the others; the cluster is restarted, saying so;
  - --timeout or a notebook interrupt: every rank gets SIGINT;
and if ranks ignore SIGINT for INTERRUPT_GRACE_S (stuck in C code) the cluster
is restarted, saying so. The notebook is never left waiting for ever.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ..failure import FailureReport, RankError, blame, died_headline, primary_cause, raised_headline
from ..mpi.hydra import decode_wait_status
from . import display, progress_view

POLL_S = 0.1
ERROR_GRACE_S = 1.0
INTERRUPT_GRACE_S = 5.0
OUTPUT_WAIT_S = 2.0
REMOTE_DEATH_WAIT_S = 0.5  # hydra writes no report for a remote death; a lost host's mpiexec runs on
DEATH_WAIT_S = 15.0  # mpiexec needs a moment to collect every rank's exit status
SEEN_DEATH_WAIT_S = 5.0  # ... unless the cluster's death watch already read the cause's status
FINISHING_GRACE_S = 4.0  # a failed rank's abort may take the runtime's own wait



@dataclass
class CellOptions:
    timeout: float | None = None
    targets: list[int] | None = None  # ranks; None = all
    output: str = "all"
    widgets: bool = True
    cell_number: int | None = None  # the notebook's In[n], shown in the ranks' tracebacks
    header: str | None = None  # the cell's magic line (the code starts on the next line)
    elastic: bool = False  # a lost rank shrinks the world (nbdist.notebook.elastic), down to min_np
    min_np: int = 1
    max_np: int | None = None  # elastic: below this many ranks, start new ones (they join the run)


class _RankResult:
    """Rank 0's last-expression value, displayed with its own MIME bundle."""

    def __init__(self, content: dict, rank: int):
        self.data = content.get("data", {})
        self.metadata = content.get("metadata", {})
        self.rank = rank

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data, self.metadata

    def __repr__(self):
        return self.data.get("text/plain", "")


def _progress_view(ar, ranks: list[int], widgets: bool):
    """The cell's progress view (widget or text line); None if it cannot be drawn."""
    try:
        return progress_view.attach(ar, n_ranks=len(ranks), widgets=widgets, ranks=ranks)
    except Exception as exc:  # a broken widget must never break the cell
        display.notice(f"progress view unavailable: {exc!r}", "warning")
        return None


class _Streamer:
    """Feeds each rank's new stdout/stderr/display data (from ipyparallel metadata) to RankOutput."""

    def __init__(self, ar, ranks: list[int], out: display.RankOutput):
        self.children = list(zip(ranks, ar._children))
        self.out = out
        self.offsets = {(r, s): 0 for r in ranks for s in ("stdout", "stderr")}
        self.n_outputs = {r: 0 for r in ranks}

    def add(self, rank: int, child) -> None:
        """Stream one more engine's output (a rank that joined an elastic run)."""
        self.children.append((rank, child))
        self.out.add_rank(rank)
        self.offsets.update({(rank, "stdout"): 0, (rank, "stderr"): 0})
        self.n_outputs[rank] = 0

    def pump(self) -> None:
        for rank, child in self.children:
            md = child.output.metadata
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                start = self.offsets[(rank, name)]
                if len(text) > start:
                    self.offsets[(rank, name)] = len(text)
                    self.out.add_stream(rank, name, text[start:])
            outputs = md.get("outputs") or []
            while self.n_outputs[rank] < len(outputs):
                self.out.add_display(rank, outputs[self.n_outputs[rank]])
                self.n_outputs[rank] += 1
        self.out.flush()


def _child_error(child):
    """The child's error (a RemoteError / EngineError) or None while pending or successful."""
    if not child.done():
        return None
    try:
        res = child.result()
    except Exception as exc:
        return exc
    return res if isinstance(res, BaseException) else None


def _rank_error(rank: int, err, interrupted: bool, child) -> RankError:
    """What one rank's reply says, handed to the failure module (which unwraps and classifies)."""
    ename = getattr(err, "ename", type(err).__name__)
    evalue = str(getattr(err, "evalue", err))
    tb = getattr(err, "traceback", None)
    if isinstance(tb, (list, tuple)):  # execute replies carry IPython's structured traceback
        lines = [line for chunk in tb for line in str(chunk).splitlines()]
    else:
        lines = tb.splitlines() if isinstance(tb, str) and tb else []
    md = child.output.metadata
    finished = md.get("completed") or md.get("received")
    when = finished.timestamp() if hasattr(finished, "timestamp") else None
    return RankError.collect(rank, ename, evalue, lines, interrupted_by_watcher=interrupted, time=when)


def _is_death(err) -> bool:
    return getattr(err, "ename", type(err).__name__) == "EngineError"


def _as_in_notebook(code: str, opts: CellOptions) -> str:
    """The code as the engines should run it so that tracebacks point into the notebook:
    `Cell In[n], line L` with the notebook's n and the line the user sees.

    The engine names a cell after its own execution counter, so the counter is set to the
    notebook's first (a silent request, queued before the cell on the same channel: no
    extra round trip); the magic line, as a comment, keeps the user's line numbers (IPython
    drops leading blank lines, so a blank line would not).
    """
    if opts.header is None or code.lstrip().startswith("%%"):  # a cell magic must come first
        return code
    return "# " + opts.header.replace("\n", " ") + "\n" + code


def run(cluster, code: str, opts: CellOptions):
    """Run code on the chosen ranks; return rank 0's result object or raise a display error."""
    ranks = opts.targets if opts.targets is not None else sorted(cluster.ranks)
    view = cluster.client[[cluster.engine_of(r) for r in ranks]]
    if opts.cell_number is not None:
        view.execute(f"get_ipython().execution_count = {int(opts.cell_number)}", silent=True, block=False)
    out = display.RankOutput(ranks, mode=opts.output)
    ar = view.execute(_as_in_notebook(code, opts), silent=False, block=False)
    streamer = _Streamer(ar, ranks, out)
    progress = _progress_view(ar, ranks, opts.widgets)
    engines = [cluster.engine_of(r) for r in ranks]
    watch = None
    if opts.elastic:
        from .elastic import ElasticWatch

        watch = ElasticWatch(cluster, opts.min_np, progress,
                             {e: (r, i) for i, (r, e) in enumerate(zip(ranks, engines))},
                             max_np=opts.max_np)

        def run_on_joiners(engine_ids: list[int]) -> None:
            """New engines run this cell too: their hvd.init() joins the running world."""
            joined = cluster.client[engine_ids].execute(_as_in_notebook(code, opts), silent=False,
                                                        block=False)
            for eid, child in zip(engine_ids, joined._children):
                label = max(r for r, _ in streamer.children) + 1  # a number no rank of the cell had
                streamer.add(label, child)
                engines.append(eid)
                watch.labels[eid] = (label, len(engines) - 1)

        watch.on_join = run_on_joiners

    t0 = time.monotonic()
    first_error_at = None
    interrupted_at = None
    signalled: set[int] = set()  # ranks this loop sent SIGINT
    cause = None  # 'error' | 'timeout' | 'interrupt' | 'died' | 'stuck'
    died = False
    try:
        while True:
            try:
                done = ar.wait(POLL_S)
                if watch is not None:
                    # the lost engines' replies may come late (ipyparallel's heartbeat), and
                    # engines that joined have replies of their own: the cell is done when
                    # every engine in the world is
                    done = all(c.done() for e, (_, c) in zip(engines, streamer.children)
                               if not watch.ignores(e))
                    if not done and watch.joining:
                        watch.joined()
                        if watch.joining and all(c.done() for e, (_, c) in zip(engines, streamer.children)
                                                 if not watch.ignores(e) and e not in watch.joining):
                            watch.call_off_join()  # the run ended before its next commit
                streamer.pump()
                if progress is not None:
                    try:
                        progress.poll()
                    except Exception:
                        progress = None
                if done:
                    break
                now = time.monotonic()
                errors = [(r, _child_error(c)) for r, c in streamer.children]
                if watch is not None:
                    if not watch.poll():  # below --min-np: the run cannot go on
                        died = True
                        break
                    errors = [(r, e) for (r, e), eid in zip(errors, engines) if not watch.ignores(eid)]
                elif any(e is not None and _is_death(e) for _, e in errors) or not cluster.engines_alive():
                    died = True
                    break
                if first_error_at is None and (any(e is not None for _, e in errors) or any(
                        c.output.metadata.get("error") for _, c in streamer.children)):
                    first_error_at = now
                if (interrupted_at is None and first_error_at is not None
                        and now - first_error_at > ERROR_GRACE_S):
                    # A rank that already showed its error is finishing (releasing its peers),
                    # not stuck: interrupt only those that neither finished nor failed.
                    pending = [r for r, c in streamer.children
                               if not c.done() and not c.output.metadata.get("error")]
                    if pending:
                        cluster.interrupt(pending)
                        signalled.update(pending)
                    interrupted_at, cause = now, cause or "error"
                if interrupted_at is None and opts.timeout and now - t0 > opts.timeout:
                    cluster.interrupt(ranks)
                    signalled.update(ranks)
                    interrupted_at, cause = now, "timeout"
                if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE_S + (
                        FINISHING_GRACE_S if cause == "error" else 0.0):
                    cause = cause + "+stuck" if cause else "stuck"
                    break
            except KeyboardInterrupt:
                if cause is None or not cause.startswith("interrupt"):
                    cluster.interrupt(ranks)
                    signalled.update(ranks)
                    interrupted_at, cause = time.monotonic(), "interrupt"
                else:  # a second Ctrl-C: stop waiting for the ranks
                    cause = "interrupt+stuck"
                    break
    finally:
        if watch is not None:
            watch.finish()
        # Output travels on IOPub, the reply on another socket: wait briefly for the stragglers.
        if ar.ready():
            try:
                ar.wait_for_output(OUTPUT_WAIT_S)
            except Exception:
                pass
        streamer.pump()
        out.finish()

    errors = [(r, _child_error(c)) for r, c in streamer.children]
    if watch is not None:
        errors = [(r, e) for (r, e), eid in zip(errors, engines) if not watch.ignores(eid)]
    if died and watch is not None and watch.failure is not None:
        report = watch.failure
        try:
            _restart(cluster)
            report.notes.append(f"the cluster was restarted with {cluster.n} fresh ranks: names "
                                f"defined in earlier %%distributed cells are gone")
        except Exception as exc:
            report.notes.append(f"restarting the cluster failed: {exc}; run %dist_start -n {cluster.n}")
        _finish(progress, "failed", report)
        raise display.RankDied(report)
    if not died:
        died = any(e is not None and _is_death(e) for _, e in errors)
    if died:
        state = "failed"
        report = _death_report(cluster, ranks, errors)
        _finish(progress, state, report)
        raise display.RankDied(report)

    failed = [(r, e) for r, e in errors if e is not None]
    stuck = cause is not None and cause.endswith("stuck")
    if not failed and not stuck and cause is None:
        _finish(progress, "done", None)
        lead = streamer.children[0][1] if streamer.children else None
        if watch is not None and watch.lost_engines and 0 in cluster.ranks:
            # after a resize the cell's value is the new rank 0's
            lead = dict(zip(engines, (c for _, c in streamer.children))).get(cluster.engine_of(0), lead)
        lead_md = lead.output.metadata if lead is not None else {}
        result = lead_md.get("execute_result")
        return _RankResult(result, ranks[0]) if result else None

    child_of = dict(streamer.children)
    # A KeyboardInterrupt is a follow-on only on a rank we signalled; raised by the user's
    # code on a rank nobody interrupted, it is the cause.
    rank_errors = [_rank_error(r, e, r in signalled, child_of[r]) for r, e in failed]
    primary = primary_cause(rank_errors)
    others = [e for e in rank_errors if e is not primary]
    notes = []
    if stuck:
        silent = [r for r, c in streamer.children if not c.done()]
        notes.append(f"rank{'s' if len(silent) != 1 else ''} {display.rank_ranges(silent)} did not respond to "
                     f"the interrupt within {INTERRUPT_GRACE_S:.0f} s (stuck outside Python?); the cluster "
                     f"was restarted - names defined in earlier cells are gone")
        _restart(cluster)
    base = cause.split("+")[0] if cause else "error"
    if base == "timeout":
        headline = f"the cell ran longer than --timeout {opts.timeout:g} s; every rank was interrupted"
        if primary is not None and primary.ename != "KeyboardInterrupt":
            headline += f" ({raised_headline(primary)})"
        report = FailureReport(headline, primary, others, notes)
        _finish(progress, "timeout", report)
        raise display.DistributedTimeout(report)
    if base == "interrupt":
        report = FailureReport("interrupted: every rank got KeyboardInterrupt", None,
                               [e for e in rank_errors], notes)
        _finish(progress, "interrupted", report)
        raise display.DistributedInterrupt(report)
    if primary is None:
        headline = "the cell failed on every rank with follow-on errors only"
    else:
        headline = raised_headline(primary)
    if first_error_at is not None and interrupted_at is not None and not stuck:
        notes.append(f"ranks still running {ERROR_GRACE_S:g} s after the error were interrupted")
    report = FailureReport(headline.rstrip(": "), primary, others, notes)
    _finish(progress, "failed", report)
    raise display.DistributedError(report)


def _finish(progress, state: str, report: FailureReport | None) -> None:
    if progress is None:
        return
    failed_rank = report.primary.rank if report is not None and report.primary is not None else None
    try:
        progress.finish(state, failed_rank=failed_rank)
    except Exception:
        pass


def _restart(cluster) -> None:
    ind = display.StartIndicator(cluster.n, "restarting")
    cluster.restart()
    ind.done(f"cluster restarted: {cluster.n} fresh ranks (engine state was reset)", "warning")


def _death_report(cluster, ranks: list[int], errors) -> FailureReport:
    """Who died and how (hydra's exit codes), then restart the cluster cleanly."""
    # Across hosts hydra names only the host of a dead rank (its banner, no exit report), and
    # a lost host leaves mpiexec running: waiting for the report would only delay the cell.
    remote = cluster.host_failures()
    seen = cluster.first_dead_statuses()  # the first death, read from /proc at once
    # hydra's report still tells how the others ended; with the cause known, wait less for it
    statuses = cluster.exit_statuses(
        wait_s=REMOTE_DEATH_WAIT_S if remote else SEEN_DEATH_WAIT_S if seen else DEATH_WAIT_S)
    # The watch names the rank that went first, by the kernel's order of events (see
    # nbdist.mpi.deaths); its thread may deliver after `seen` was read, so ask again here.
    seen = seen or cluster.first_dead_statuses()
    first = cluster.first_dead() or set(seen)
    if len(statuses) < len(seen) or not statuses:
        statuses = {**statuses, **seen}
    dead = blame(statuses, first)
    if remote:  # names the host too; each host's death watch saw only its own first death
        who, dead = "; ".join(remote), {}
    elif dead:
        who = died_headline({r: decode_wait_status(s) for r, s in dead.items()})
    elif first:  # the watch saw who went first, but not how (reaped before it looked)
        who = died_headline({r: "exit status not reported in time" for r in first})
    else:
        # mpiexec did not report in time: every engine is gone, but which one went first is unknown
        who = "a rank died and MPI stopped the others (mpiexec reported no exit statuses in time)"
    notes = []
    fatal = _fatal_error_excerpt(cluster.engine_output())
    if fatal:
        notes.append("engine log:\n" + fatal)
    culprits = set() if remote else set(dead) or first
    others = [r for r in ranks if r not in culprits]
    if others and culprits:
        notes.append(f"MPI stopped the other rank{'s' if len(others) != 1 else ''} ({display.rank_ranges(others)}) "
                     f"when rank {min(culprits)} died")
    try:
        _restart(cluster)
        notes.append(f"the cluster was restarted with {cluster.n} fresh ranks: names defined in earlier "
                     f"%%distributed cells are gone")
    except Exception as exc:
        notes.append(f"restarting the cluster failed: {exc}; run %dist_start -n {cluster.n}")
    return FailureReport(who, None, [], notes)


_FAULTHANDLER_LINE = re.compile(r"^(Fatal Python error|Current thread|Thread 0x|Stack \(most recent|  File |"
                                r"  <no Python frame>|  Garbage-collecting|Python runtime state|\s*$)")


# An engine's own log record, e.g. "2026-12-06 22:53:02.240 [IPEngine.0.0] Handling ...". The
# ranks share mpiexec's output, and faulthandler writes its report in several pieces: another
# rank's record can land inside it, even mid-line ("Fatal Python error: 2026-12-06 ...").
_ENGINE_LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[IPEngine[^\]\n]*\][^\n]*\n")


def _fatal_error_excerpt(log: str) -> str:
    """faulthandler's 'Fatal Python error' block from the engine log, if a rank crashed in Python."""
    idx = log.find("Fatal Python error")
    if idx < 0:
        return ""
    lines = []
    for line in _ENGINE_LOG_RECORD.sub("", log[idx:]).splitlines()[:60]:
        # faulthandler's report: the error, then each thread's frames (blank lines between)
        if not _FAULTHANDLER_LINE.match(line):
            break
        lines.append(line)
    return "\n".join(lines).strip()
