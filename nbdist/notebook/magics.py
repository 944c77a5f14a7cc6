"""The IPython magics: %%distributed, %dist_start, %dist_stop, %dist_status, %dist_pull,
%dist_push and %dist_run.

Arguments are parsed by IPython.core.magic_arguments, so `%%distributed?` shows
the help. All validation happens before anything starts: a bad -n, an unknown
flag, an empty cell or a cell while another one runs is a clear UsageError and
the running cluster (and its state) is untouched.
"""
from __future__ import annotations

import difflib
import os
import shlex
import threading
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import cell as cell_mod
from . import display
from ..common.config import env_str
from ..mpi.hosts import HostsError
from ..mpi.hosts import parse_hosts as parse_host_slots
from .cluster import LAUNCHERS, MAX_RANKS, ClusterError, DistCluster

DEFAULT_N = 2
# Oversubscribing one machine past this many ranks per core only makes everything crawl.
MAX_LOCAL_RANKS_PER_CORE = 16


def max_local_ranks() -> int:
    return max(64, MAX_LOCAL_RANKS_PER_CORE * (os.cpu_count() or 1))


def _ranks_count(value, option: str) -> int:
    """The number of ranks an option names, or a UsageError that names the option."""
    try:
        return int(str(value).strip())
    except ValueError:
        raise UsageError(f"{option} expects a whole number of ranks, got {value!r}") from None


def parse_magic_line(magic, line: str):
    """parse_argstring, with a "did you mean" for a misspelt option (Python 3.11's argparse
    has none): `--timout 3` -> unrecognized arguments: --timout 3 (did you mean --timeout?)."""
    try:
        return parse_argstring(magic, line)
    except UsageError as exc:
        message = str(exc)
        if "unrecognized arguments:" not in message:
            raise
        known = list(magic.parser._option_string_actions)
        hints = []
        for word in message.split("unrecognized arguments:", 1)[1].split():
            option = word.split("=", 1)[0]
            close = difflib.get_close_matches(option, known, n=1, cutoff=0.7) if option.startswith("-") else []
            if close:
                hints.append(f"{option} -> {close[0]}")
        if not hints:
            raise
        raise UsageError(f"{message} (did you mean: {', '.join(hints)}?)") from None


def parse_n(value: str | int | None, launcher: str = "local") -> int:
    """-n N: a positive whole number within reach of the launcher."""
    if value is None:
        raise UsageError("-n is required")
    n = _ranks_count(value, "-n")
    if n < 1:
        raise UsageError(f"-n must be at least 1, got {n}")
    limit = max_local_ranks() if launcher == "local" else MAX_RANKS
    if n > limit:
        where = f"this machine ({os.cpu_count()} cores)" if launcher == "local" else "nbdist"
        raise UsageError(f"-n {n} is more ranks than {where} can run (at most {limit}); "
                         f"use --launcher slurm/ssh/mpi with --hosts for more")
    return n


def parse_targets(spec: str | None, n: int) -> list[int] | None:
    """--targets '0,2-3' -> [0, 2, 3], each within 0..n-1."""
    if spec is None:
        return None
    ranks: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else (part, "")
                lo_i, hi_i = int(lo), int(hi)
                if lo_i > hi_i:
                    raise ValueError
                ranks.update(range(lo_i, hi_i + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise UsageError(f"--targets expects ranks like 0,2-3, got {spec!r}") from None
    if not ranks:
        raise UsageError(f"--targets selected no ranks: {spec!r}")
    bad = sorted(r for r in ranks if r < 0 or r >= n)
    if bad:
        raise UsageError(f"--targets {spec!r}: rank{'s' if len(bad) != 1 else ''} {bad} outside 0..{n - 1}")
    return sorted(ranks)


def parse_timeout(value) -> float | None:
    if value is None:
        return None
    try:
        t = float(value)
    except ValueError:
        raise UsageError(f"--timeout expects seconds, got {value!r}") from None
    if not t > 0:
        raise UsageError(f"--timeout must be positive, got {value!r}")
    return t


def parse_env(items: list[str] | None) -> dict[str, str]:
    env = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum():
            raise UsageError(f"--env expects K=V, got {item!r}")
        env[key] = val
    return env


def parse_hosts(items: list[str] | None) -> list[str]:
    """--hosts h1:2,h2:2 (or h1:2 h2:2; a host without :N has one slot) -> ['h1:2', 'h2:2']."""
    try:
        return [f"{h}:{s}" for h, s in parse_host_slots(items or [])]
    except HostsError as exc:
        raise UsageError(str(exc)) from None


def _on_hosts(rows: list[dict]) -> str:
    """' on h1 (ranks 0-1), h2 (ranks 2-3)' when the ranks span several hosts, else ''."""
    by_host: dict[str, list[int]] = {}
    for row in rows:
        by_host.setdefault(row["host"], []).append(row["rank"])
    if len(by_host) < 2:
        return ""
    return " on " + ", ".join(f"{h} (rank{'s' if len(r) > 1 else ''} {display.rank_ranges(r)})"
                              for h, r in by_host.items())


def elastic_args(func):
    """--elastic and --min-np, shared by %%distributed and %dist_start (declared once)."""
    shared = [
        argument("--elastic", action="store_true",
                 help="an elastic cluster (this machine only): when a rank dies the others go "
                      "on in a smaller world, and hvd.elastic.run resumes from the last commit "
                      "in the same cell (docs/elastic.md); kept until %%dist_stop"),
        argument("--min-np", dest="min_np", default=None, metavar="N",
                 help="elastic: the fewest ranks the run may go on with (default 1); below it "
                      "the cell fails naming the ranks lost"),
    ]
    for deco in reversed(shared):
        func = deco(func)
    return func


def parse_min_np(value, n: int, elastic: bool) -> int | None:
    """--min-np N: a whole number in 1..n, and only for an elastic cluster."""
    if value is None:
        return None
    if not elastic:
        raise UsageError("--min-np applies to an elastic cluster: add --elastic")
    m = _ranks_count(value, "--min-np")
    if m < 1 or m > n:
        raise UsageError(f"--min-np must be between 1 and -n ({n}), got {m}")
    return m


def parse_max_np(value, min_np: int, elastic: bool) -> int | None:
    """--max-np N: a whole number of ranks >= --min-np, and only for an elastic cluster."""
    if value is None:
        return None
    if not elastic:
        raise UsageError("--max-np applies to an elastic cluster: add --elastic")
    m = _ranks_count(value, "--max-np")
    if m < max(min_np, 1) or m > max_local_ranks():
        raise UsageError(f"--max-np must be between --min-np ({min_np}) and {max_local_ranks()}, got {m}")
    return m


def run_args(func):
    """The options of everything that runs code on the ranks (%%distributed, %dist_run), declared once."""
    shared = [
        argument("-n", "--np", dest="n", default=None,
                 help=f"number of MPI ranks (default: the running cluster's, else {DEFAULT_N}); "
                      "a different number restarts the cluster and resets engine state"),
        argument("--timeout", default=None, metavar="S",
                 help="fail after S seconds: every rank is interrupted, the cluster stays usable"),
        argument("--output", default="all", choices=["all", "0", "none"],
                 help="all: rank 0 inline and the others grouped (default); 0: rank 0 only; none: no output"),
        argument("--no-widgets", action="store_true", help="text progress instead of the progress widget"),
    ]
    for deco in reversed(shared):  # decorators apply bottom-up; keep the source order in --help
        func = deco(func)
    return func


@magics_class
class DistributedMagics(Magics):
    """Magics that run cells on an ipyparallel cluster of MPI ranks."""

    def __init__(self, shell):
        super().__init__(shell)
        self.cluster = DistCluster(notify=display.notice)
        self._busy = threading.Lock()

    # -- helpers ----------------------------------------------------------------------------

    def _ensure(self, n: int, launcher: str | None = None, hosts=None, env=None,
                elastic: bool | None = None) -> None:
        """A running cluster of n ranks; what is not given is as the cluster was started."""
        c = self.cluster
        if c.plan(n, launcher, hosts, env, elastic) == "reuse":
            return
        indicator = display.StartIndicator(n, "growing" if c.plan(n, launcher, hosts, env, elastic) == "grow"
                                           else "starting")
        try:
            how = c.ensure(n, launcher, hosts, env, elastic)
        except ClusterError as exc:
            indicator.done(f"could not start {n} ranks: {exc}", "error")
            raise UsageError(f"could not start {n} ranks: {exc}") from None
        except KeyboardInterrupt:
            indicator.done("start interrupted; nothing left running", "warning")
            raise
        if how == "grown":
            indicator.done(f"grew the elastic world to {n} ranks (the new ranks get the state at "
                           "the next hvd.elastic.run sync)")
            return
        indicator.done(f"{n} rank{'s' if n != 1 else ''} ready in {c.last_start_s:.1f} s"
                       + (" (fresh engines: earlier state was reset)" if how == "restarted" else ""))

    def _claim(self):
        if not self._busy.acquire(blocking=False):
            raise UsageError("another %%distributed cell is still running in this kernel; wait for it "
                             "(or interrupt it) before starting a new one")

    def _run_code(self, code: str, args, n: int, header: str | None = None) -> object:
        elastic = True if getattr(args, "elastic", False) else None  # None: the cluster's kind
        min_np = parse_min_np(getattr(args, "min_np", None), n,
                              bool(elastic) or (self.cluster.elastic and self.cluster.cluster is not None))
        opts = cell_mod.CellOptions(timeout=parse_timeout(args.timeout),
                                    targets=parse_targets(args.targets, n),
                                    output=args.output, widgets=not args.no_widgets,
                                    cell_number=self._cell_number(), header=header)
        self._claim()
        try:
            self._ensure(n, elastic=elastic)
            if min_np is not None:
                self.cluster.min_np = min_np
            opts.elastic, opts.min_np = self.cluster.elastic, self.cluster.min_np
            opts.max_np = parse_max_np(getattr(args, "max_np", None), opts.min_np, opts.elastic)
            if opts.elastic and opts.targets is not None:
                raise UsageError("--targets cannot be used on an elastic cluster: an elastic run "
                                 "needs every rank")
            if args.gpus:
                self._pin_gpus()
            return cell_mod.run(self.cluster, code, opts)
        finally:
            self._busy.release()

    def _cell_number(self) -> int | None:
        """The running notebook cell's In[n]: IPython counts the next cell while one runs."""
        count = getattr(self.shell, "execution_count", None)
        return count - 1 if isinstance(count, int) and count > 1 else None

    def _pin_gpus(self) -> None:
        view = self.cluster.client[self.cluster.engine_ids]
        ar = view.execute("import nbdist.rank.hooks as __e; __e.pin_gpu(); del __e", block=False)
        ar.wait(30)
        try:
            ar.get(0)
        except Exception as exc:
            msg = getattr(exc, "evalue", None) or str(exc)
            if hasattr(exc, "elist") and exc.elist:
                msg = exc.elist[0][1]
            raise UsageError(f"--gpus: {msg}") from None

    def _default_n(self, given) -> int:
        if given is not None:
            return parse_n(given, self.cluster.launcher if self.cluster.n else "local")
        if self.cluster.cluster is not None and self.cluster.n:
            return self.cluster.n
        return DEFAULT_N

    # -- %%distributed ----------------------------------------------------------------------

    # The usage line reads "%%distributed" (IPython prefixes the parser's name with one %).
    @magic_arguments("%distributed")
    @run_args
    @elastic_args
    @argument("--max-np", dest="max_np", default=None, metavar="N",
              help="elastic, this cell: while the world has fewer than N ranks, start new ones; "
                   "they run the cell and join the elastic run at its next commit()")
    @argument("--targets", default=None, metavar="RANKS",
              help="run on these ranks only, e.g. 0 or 0,2-3 (collectives need every rank!)")
    @argument("--gpus", action="store_true", help="give each rank one GPU (its local rank) before the cell runs")
    @cell_magic
    def distributed(self, line, cell):
        """Run this cell on every MPI rank of the notebook's cluster (starting it if needed).

        Names defined in the cell live on in the engines for later cells. Rank 0's
        output is shown inline, the other ranks' grouped below it; rank 0's last
        expression is the cell's value. When a rank raises, the cell fails with
        that rank's traceback first (peers waiting in a collective are released);
        when a rank dies the cluster is restarted and the cell says so.
        """
        args = parse_magic_line(self.distributed, line)
        if not cell or not cell.strip():
            raise UsageError("%%distributed: the cell is empty - nothing to run")
        n = self._default_n(args.n)
        return self._run_code(cell, args, n, header=f"%%distributed {line}".rstrip())

    # -- cluster management -----------------------------------------------------------------

    @magic_arguments()
    @argument("-n", "--np", dest="n", default=None, help="number of MPI ranks")
    @argument("--launcher", default=None, choices=list(LAUNCHERS),
              help="local (mpiexec on this machine; the default for a first cluster), ssh (one MPI "
                   "world across --hosts through hydra's ssh bootstrap; mpi is the same), slurm "
                   "(ipyparallel's Slurm launcher, or mpiexec inside the current allocation); "
                   "default: as the cluster was started")
    @argument("--hosts", nargs="+", default=None,
              help="host:slots list as horovodrun -H: h1:2,h2:2 (implies --launcher ssh)")
    @argument("--env", nargs="+", default=None, metavar="K=V", help="environment variables for every rank")
    @elastic_args
    @line_magic
    def dist_start(self, line):
        """Start (or restart) the cluster of N MPI ranks used by %%distributed."""
        args = parse_magic_line(self.dist_start, line)
        n = parse_n(args.n, args.launcher or self.cluster.launcher) if args.n is not None else None
        if n is None:
            raise UsageError("%dist_start needs -n N")
        env, hosts = parse_env(args.env), parse_hosts(args.hosts)
        launcher = "ssh" if hosts and args.launcher in (None, "local") else args.launcher
        min_np = parse_min_np(args.min_np, n, args.elastic)
        if args.elastic and (hosts or launcher not in (None, "local", "mpi")):
            raise UsageError("--elastic runs on this machine only: drop --hosts/--launcher")
        self._claim()
        try:
            self._ensure(n, launcher, hosts, env, elastic=True if args.elastic else None)
            self.cluster.min_np = min_np or 1 if args.elastic else self.cluster.min_np
        finally:
            self._busy.release()

    @magic_arguments()
    @argument("-n", "--np", dest="n", default=None, help="the number of ranks to grow to")
    @line_magic
    def dist_scale(self, line):
        """Grow an elastic cluster to N ranks: new engines join the running ranks' world (the
        ranks keep their state; the new ones get it at the next hvd.elastic.run sync)."""
        args = parse_magic_line(self.dist_scale, line)
        c = self._require_cluster()
        if not c.elastic:
            raise UsageError("%dist_scale needs an elastic cluster: %dist_start -n N --elastic")
        n = parse_n(args.n, c.launcher)
        if n < (c.n or 0):
            raise UsageError(f"%dist_scale -n {n}: the world has {c.n} ranks; it grows only "
                             "(a smaller world comes from ranks leaving)")
        if n == c.n:
            display.notice(f"the elastic world already has {n} ranks")
            return
        self._claim()
        try:
            self._ensure(n)
        finally:
            self._busy.release()

    @line_magic
    def dist_stop(self, line):
        """Stop the cluster: engines, controller and MPI; nothing is left running."""
        if line.strip():
            raise UsageError(f"%dist_stop takes no arguments, got {line.strip()!r}")
        n = self.cluster.n
        if self.cluster.stop():
            display.notice(f"stopped the cluster of {n} ranks")
        else:
            display.notice("no cluster is running")

    @line_magic
    def dist_status(self, line):
        """Ranks, hosts, pids, GPUs, transports, busy or idle."""
        if line.strip():
            raise UsageError(f"%dist_status takes no arguments, got {line.strip()!r}")
        c = self.cluster
        if c.cluster is None:
            display.notice("no cluster is running (a %%distributed cell or %dist_start -n N starts one)")
            return
        busy = self._busy.locked()
        alive = c.is_running()
        rows = c.status_rows(busy_engines=set(c.engine_ids) if busy else None) if alive else []
        head = (f"{c.n} ranks ({c.launcher} launcher){_on_hosts(rows)}, "
                f"{'running a cell' if busy else 'idle'}" if alive
                else f"the cluster of {c.n} ranks is not running (the next cell restarts it)")
        display.show(display.status_table(rows, head))

    @magic_arguments()
    @argument("name", help="the variable to fetch")
    @argument("--rank", type=int, default=0, help="the rank to fetch it from (default 0)")
    @line_magic
    def dist_pull(self, line):
        """Copy a variable from one rank into the notebook (also returned)."""
        args = parse_magic_line(self.dist_pull, line)
        c = self._require_cluster()
        if args.rank not in c.ranks:
            raise UsageError(f"--rank {args.rank}: the cluster has ranks 0..{c.n - 1}")
        self._claim()
        try:
            try:
                value = c.client[c.engine_of(args.rank)].pull(args.name, block=True)
            except Exception as exc:
                raise UsageError(f"%dist_pull {args.name}: rank {args.rank} says "
                                 f"{getattr(exc, 'ename', type(exc).__name__)}: "
                                 f"{getattr(exc, 'evalue', exc)}") from None
        finally:
            self._busy.release()
        self.shell.user_ns[args.name] = value
        return value

    @magic_arguments()
    @argument("names", nargs="+", help="notebook variables to send to every rank")
    @line_magic
    def dist_push(self, line):
        """Copy notebook variables to every rank."""
        args = parse_magic_line(self.dist_push, line)
        c = self._require_cluster()
        missing = [name for name in args.names if name not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%dist_push: not defined in the notebook: {', '.join(missing)}")
        values = {name: self.shell.user_ns[name] for name in args.names}
        self._claim()
        try:
            c.client[c.engine_ids].push(values, block=True)
        finally:
            self._busy.release()
        display.notice(f"pushed {', '.join(args.names)} to {c.n} ranks")

    @magic_arguments()
    @run_args
    @argument("file", help="the Python script to run on every rank")
    @line_magic
    def dist_run(self, line):
        """Run a script on every rank (like %run, in the engines' namespace)."""
        args = parse_magic_line(self.dist_run, line)
        path = Path(os.path.expanduser(args.file)).resolve()
        if not path.is_file():
            raise UsageError(f"%dist_run: no such file: {args.file}")
        args.targets, args.gpus = None, False
        n = self._default_n(args.n)
        return self._run_code(f"%run {shlex.quote(str(path))}", args, n)

    @magic_arguments()
    @argument("path", nargs="?", default=None,
              help="the path given to hvd.start_timeline (default: $NBDIST_TIMELINE or "
                   "$HOROVOD_TIMELINE)")
    @line_magic
    def dist_timeline(self, line):
        """Plot a timeline the ranks wrote (hvd.start_timeline): a row per rank, a colour
        per phase (negotiation, queue, fusion copies, the transport's collective)."""
        args = parse_magic_line(self.dist_timeline, line)
        path = args.path or env_str("TIMELINE")
        if not path:
            raise UsageError("%dist_timeline: give the timeline's path (as passed to "
                             "hvd.start_timeline in the cell), e.g. %dist_timeline /tmp/tl.json")
        from nbdist.common import timeline

        try:
            return timeline.plot(os.path.expanduser(path))
        except FileNotFoundError as exc:
            raise UsageError(f"%dist_timeline: {exc}") from None

    def _require_cluster(self) -> DistCluster:
        c = self.cluster
        if c.cluster is None or not c.is_running():
            raise UsageError("no cluster is running: run a %%distributed cell or %dist_start -n N first")
        return c


_loaded: dict[int, DistributedMagics] = {}


def load_ipython_extension(ipython) -> None:
    """Register the magics (once per shell) and stop the cluster when the shell exits."""
    if id(ipython) in _loaded:
        return
    magics = DistributedMagics(ipython)
    ipython.register_magics(magics)
    _loaded[id(ipython)] = magics


def unload_ipython_extension(ipython) -> None:
    """Stop the cluster and remove the magics."""
    magics = _loaded.pop(id(ipython), None)
    if magics is None:
        return
    magics.cluster.stop(quiet=True)
    for kind in ("line", "cell"):
        for name in list(magics.magics[kind]):
            ipython.magics_manager.magics[kind].pop(name, None)
