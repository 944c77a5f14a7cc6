"""The notebook's cluster: one ipyparallel controller and N engines started by one mpiexec.

One `DistCluster` per notebook kernel owns the ipyparallel `Cluster`, its `Client`
and a `DirectView`; engine i is MPI rank i. It starts on demand, is reused while
N is unchanged, restarts when N changes or after a rank died, and stops at
%dist_stop, at kernel exit (atexit) and - via a watchdog process and an
engine-side kernel watch - when the kernel dies. Nothing is left running and
no MPI segment is left in /dev/shm.
"""
from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil

from ..common.config import KERNEL_PID_ENV
from ..common.world import ELASTIC_DIR_ENV, write_plan
from ..mpi import reaper
from ..mpi.deaths import DeathWatch
from ..mpi.hosts import (HostsError, address_toward, banner_deaths, check_slots, hosts_arg,
                         in_slurm_allocation, launcher_exec, lost_host_line, lost_hosts_in, parse_hosts, placement,
                         remote_death_line, ssh_hostname, LinkWatch)
from ..mpi.hydra import MpiexecNotFound, culprits, decode_wait_status, mpiexec_path, parse_exit_codes, venv_bin  # noqa: F401

LAUNCHERS = ("local", "mpi", "slurm", "ssh")
MAX_RANKS = 1024  # far beyond one notebook's reach; an absurd -n fails before anything starts
START_TIMEOUT_S = 120
EXIT_REPORT_GRACE_S = 5.0  # after mpiexec exited, how long its exit-code report may take to show
DEATH_PIPE_TIMEOUT_S = 30  # idle engines opening the death watch FIFOs (a loaded machine)


class ClusterError(RuntimeError):
    """The cluster could not be started or used."""


@dataclass
class RankInfo:
    """What an engine told us about itself at start-up."""
    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int = 0
    gpus: int = 0
    extra: dict = field(default_factory=dict)


class DistCluster:
    """Owns one ipyparallel MPI cluster for this kernel (see the module docstring)."""

    def __init__(self, notify=None):
        self._notify = notify or (lambda text, level="info": print(f"nbdist: {text}", file=sys.stderr))
        self.n: int | None = None
        self.launcher = "local"
        self.hosts: list[str] = []
        self.env: dict[str, str] = {}
        self.cluster = None
        self.client = None
        self.view = None
        self.ranks: dict[int, RankInfo] = {}  # rank -> info
        self._profile_dir: str | None = None
        self._started_at = 0.0
        self._watchdog: subprocess.Popen | None = None
        # Our own handles on mpiexec's output files: ipyparallel deletes a file the moment
        # it sees mpiexec exit, and an open handle still reads a deleted file.
        self._output_handles: list = []
        self._atexit_registered = False
        self._death_watch: DeathWatch | None = None
        self._remote_watches: list[DeathWatch] = []  # one per other host (several hosts only)
        self._links: LinkWatch | None = None  # hydra's ssh links to the hosts (several hosts only)
        self._lost_hosts: list[str] = []  # hosts whose ssh link ended while mpiexec still ran
        self._addresses: dict[str, str] = {}  # host -> the address ssh connects to
        self.last_start_s: float | None = None
        # Elastic (docs/elastic.md): a rank's death leaves its peers running, and the kernel
        # (nbdist.notebook.elastic) publishes the survivors' world in elastic_dir.
        self.elastic = False
        self.min_np = 1
        self.elastic_dir: str | None = None
        self.generation = 0
        self.engine_env: dict[str, str] = {}

    # ---- state -----------------------------------------------------------------------------

    @property
    def engine_ids(self) -> list[int]:
        """Engine ids in rank order."""
        return [self.ranks[r].engine_id for r in sorted(self.ranks)]

    def engine_of(self, rank: int) -> int:
        return self.ranks[rank].engine_id

    def rank_of(self, engine_id: int) -> int:
        for rank, info in self.ranks.items():
            if info.engine_id == engine_id:
                return rank
        return engine_id

    def _engine_sets(self):
        return list(self.cluster.engines.values()) if self.cluster is not None else []

    def _mpiexec_procs(self) -> list[psutil.Process]:
        procs = []
        for es in self._engine_sets():
            proc = getattr(es, "process", None)
            if proc is not None:
                procs.append(proc)
        return procs

    def engines_alive(self) -> bool:
        """True while every engine set's launcher process (mpiexec) runs and all engines are registered."""
        if self.cluster is None or self.client is None:
            return False
        if self.elastic:
            # A rank's death leaves its mpiexec (and the other ranks) running: ask the ranks.
            from ..common.world import pid_alive

            return bool(self.ranks) and all(pid_alive(info.pid) for info in self.ranks.values())
        for proc in self._mpiexec_procs():
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    return False
            except psutil.Error:
                return False
        if self._links is not None:
            # mpiexec runs (checked above), but a host's ssh link ended: ssh was killed, or
            # the host or the network went away. Its ranks are out of reach.
            self._lost_hosts = self._links.lost()
            if self._lost_hosts:
                return False
        return len(self.client.ids) >= (self.n or 0)

    def is_running(self) -> bool:
        ctl = getattr(self.cluster, "controller", None) if self.cluster is not None else None
        return ctl is not None and self.engines_alive()

    # ---- start / stop ----------------------------------------------------------------------

    def shape(self, n: int, launcher: str | None = None, hosts: list[str] | None = None,
              env: dict[str, str] | None = None) -> tuple[int, str, list[str], dict[str, str]]:
        """The cluster asked for: what is not given is as the cluster was started (launcher,
        hosts, env), so a plain %%distributed after `%dist_start --launcher ssh --hosts a b`
        keeps using ssh on a and b."""
        remembered = self.n is not None
        launcher = launcher or (self.launcher if remembered else "local")
        hosts = list(hosts) if hosts else (list(self.hosts) if remembered and launcher == self.launcher else [])
        env = dict(env) if env else (dict(self.env) if remembered else {})
        return n, launcher, hosts, env

    def plan(self, n: int, launcher: str | None = None, hosts: list[str] | None = None,
             env: dict[str, str] | None = None, elastic: bool | None = None) -> str:
        """What ensure() would do: 'reuse', 'start', 'grow' or 'restart' (the one reuse policy).

        An elastic cluster asked for more ranks than it has grows (its ranks keep their
        state); elastic=None keeps the cluster's kind.
        """
        wanted = self.shape(n, launcher, hosts, env)
        if self.cluster is None:
            return "start"
        same_kind = elastic is None or bool(elastic) == self.elastic
        if same_kind and wanted == (self.n, self.launcher, self.hosts, self.env) and self.is_running():
            return "reuse"
        if (same_kind and self.elastic and self.n is not None and n > self.n
                and wanted[1:] == (self.launcher, self.hosts, self.env) and self.is_running()):
            return "grow"
        return "restart"

    def ensure(self, n: int, launcher: str | None = None, hosts: list[str] | None = None,
               env: dict[str, str] | None = None, elastic: bool | None = None) -> str:
        """A running cluster of n ranks: 'reused', 'started', 'grown' or 'restarted' (state reset)."""
        how = self.plan(n, launcher, hosts, env, elastic)
        n, launcher, hosts, env = self.shape(n, launcher, hosts, env)
        elastic = self.elastic if elastic is None and self.cluster is not None else bool(elastic)
        if how == "reuse":
            return "reused"
        if how == "grow":
            from .elastic import grow

            grow(self, n - (self.n or 0))
            return "grown"
        if how == "restart":
            if (n, launcher, hosts, env) == (self.n, self.launcher, self.hosts, self.env):
                self._notify(f"the cluster of {self.n} ranks is no longer running; starting a fresh "
                             f"one the same way ({self.launcher} launcher) - engine state was reset",
                             "warning")
            else:
                change = f"{self.n} ranks -> {n} ranks" if n != self.n else "new launcher, hosts or env"
                self._notify(f"restarting: {change}; engine state (all names defined "
                             f"in earlier %%distributed cells) was reset", "warning")
            self.stop(quiet=True)
            self.start(n, launcher, hosts, env, elastic=elastic)
            return "restarted"
        self.start(n, launcher, hosts, env, elastic=elastic)
        return "started"

    def _config(self, launcher: str, hosts: list[str], n: int, address: str, elastic: bool = False):
        from traitlets.config import Config

        cfg = Config()
        mpi_args = ["-print-all-exitcodes"]
        if elastic:
            # A rank's death must not stop the others: hydra spares them when a rank exits
            # (not when it is killed), so each engine runs under nbdist.rank.survive.
            mpi_args.append("-disable-auto-cleanup")
            cfg.MPIEngineSetLauncher.engine_cmd = [sys.executable, "-m", "nbdist.rank.survive",
                                                   sys.executable, "-m", "ipyparallel.engine"]
        if hosts:
            try:
                slots = parse_hosts(hosts)
                check_slots(n, slots)
            except HostsError as exc:
                raise ClusterError(str(exc)) from None
            # One world across the hosts: hydra's ssh bootstrap; proxies call back to `address`.
            mpi_args += ["-launcher", "ssh", "-hosts", hosts_arg(slots), "-localhost", address]
        try:
            cfg.MPILauncher.mpi_cmd = [mpiexec_path()]
        except MpiexecNotFound as exc:
            raise ClusterError(str(exc)) from None
        cfg.MPIEngineSetLauncher.mpi_args = mpi_args
        # A kill must not leave a half-dead cluster behind for long.
        cfg.LocalProcessLauncher.stop_seconds_until_kill = 3
        if launcher == "slurm":
            # ipyparallel's sbatch job; inside it one mpiexec makes the world (hydra starts
            # its proxies with srun on the allocation's nodes), so exit codes read as locally.
            cfg.SlurmEngineSetLauncher.batch_template = (
                "#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=nbdist-engines-{cluster_id}\n"
                "#SBATCH --ntasks={n}\n#SBATCH --output={output_file}\n"
                f"{shlex.quote(mpiexec_path())} -print-all-exitcodes -n {{n}} {{program_and_args}}\n")
            # the job script and its output go to the private profile, not the notebook's folder
            cfg.SlurmEngineSetLauncher.batch_file_name = os.path.join(self._profile_dir or ".", "slurm_engine.sbatch")
        return cfg

    def _engines_kind(self, launcher: str, hosts: list[str]) -> str:
        """ipyparallel's engine launcher for ours: mpi (one mpiexec) everywhere but a new Slurm job."""
        if launcher not in LAUNCHERS:
            raise ClusterError(f"unknown launcher {launcher!r}: choose {', '.join(LAUNCHERS)}")
        if launcher == "ssh" and not hosts:
            raise ClusterError("--launcher ssh needs --hosts, e.g. --hosts h1:2,h2:2")
        if launcher == "slurm":
            if hosts:
                raise ClusterError("--launcher slurm takes its hosts from Slurm; drop --hosts")
            # Already inside salloc/sbatch: mpiexec spreads over the allocation by itself.
            return "mpi" if in_slurm_allocation() else "slurm"
        return "mpi"

    def start(self, n: int, launcher: str = "local", hosts: list[str] | None = None,
              env: dict[str, str] | None = None, elastic: bool = False) -> None:
        """Start a controller and n MPI engines, connect, and install the engine hooks."""
        import ipyparallel as ipp

        if not isinstance(n, int) or n < 1 or n > MAX_RANKS:
            raise ClusterError(f"-n must be between 1 and {MAX_RANKS}, got {n!r}")
        if elastic and (hosts or launcher not in ("local", "mpi")):
            raise ClusterError("an elastic cluster runs on this machine only (--launcher local, no "
                               "--hosts): its ranks rebuild their world through files in the "
                               "kernel's private folder")
        hosts = list(hosts or [])
        env = dict(env or {})
        engines = self._engines_kind(launcher, hosts)
        address = ""
        kwargs = {}
        if hosts:
            try:
                address = address_toward([h for h, _ in parse_hosts(hosts)])
            except HostsError as exc:
                raise ClusterError(str(exc)) from None
            # The controller listens where the hosts reach this machine, and says so in its
            # connection file, so remote engines connect back to a reachable address.
            kwargs["controller_ip"] = address
            kwargs["controller_location"] = address
        elif launcher == "slurm":
            kwargs["controller_ip"] = "*"  # engines on the allocation's nodes must reach the controller
        t0 = time.monotonic()
        self._started_at = time.time()
        self._profile_dir = tempfile.mkdtemp(prefix="nbdist-ipp-")  # 0700: connection files stay private
        config = self._config(launcher, hosts, n, address, elastic)
        engine_env = {KERNEL_PID_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1",
                      "PATH": f"{venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}", **env}
        self.elastic, self.generation = elastic, 0
        self.elastic_dir = os.path.join(self._profile_dir, "elastic") if elastic else None
        if self.elastic_dir:
            os.mkdir(self.elastic_dir, 0o700)
            engine_env[ELASTIC_DIR_ENV] = self.elastic_dir
        self.engine_env = engine_env
        self.cluster = ipp.Cluster(engines=engines, n=n, profile_dir=self._profile_dir,
                                   config=config, delay=0,
                                   engine_timeout=START_TIMEOUT_S, log_level=40, **kwargs)
        self.n, self.launcher, self.hosts, self.env = n, launcher, hosts, env
        self._register_exit_hooks()
        try:
            self.cluster.start_controller_sync()
            self.cluster.start_engines_sync(n, environment=engine_env)
            self._open_output_files()
            self._start_watchdog()
            self.client = self.cluster.connect_client_sync()
            self._wait_for_engines(n)
            self.view = self.client[:]
            self.view.block = False
            self._bootstrap()
            if self.elastic_dir:
                write_plan(self.elastic_dir, {"generation": 0, "pids": [self.ranks[r].pid for r in sorted(self.ranks)],
                                              "joiners": [], "abort": ""})
            if hosts:
                names = [h for h, _ in parse_hosts(hosts)]
                self._links = LinkWatch(self._mpiexec_procs()[0].pid, names)
                self._addresses = {h: ssh_hostname(h) for h in names}
        except BaseException:
            self.stop(quiet=True)
            raise
        self.last_start_s = time.monotonic() - t0

    def _wait_for_engines(self, n: int) -> None:
        """Wait for n registrations, failing early (with mpiexec's output) when the engines died."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.client.ids) < n:
            for proc in self._mpiexec_procs():
                try:
                    dead = not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    dead = True
                if dead:
                    raise ClusterError(f"the engines exited while starting:\n{self.engine_output()[-3000:]}")
            if time.monotonic() > deadline:
                raise ClusterError(f"only {len(self.client.ids)} of {n} engines registered within "
                                   f"{START_TIMEOUT_S} s:\n{self.engine_output()[-3000:]}")
            time.sleep(0.05)

    def _bootstrap(self) -> None:
        """Install the engine hooks and learn which engine is which rank."""
        view = self.client[:]
        code = ("import nbdist.rank.hooks as __nbdist_engine\n"
                f"__nbdist_info = __nbdist_engine.setup({os.getpid()}, {socket.gethostname()!r})\n")
        view.execute(code, block=True, silent=True)
        infos = view.pull("__nbdist_info", block=True)
        self.ranks = {}
        for engine_id, info in zip(view.targets, infos):
            self.ranks[info["rank"]] = RankInfo(rank=info["rank"], engine_id=engine_id, host=info["host"],
                                                pid=info["pid"], local_rank=info["local_rank"],
                                                gpus=info["gpus"], extra=info)
        view.execute("del __nbdist_info, __nbdist_engine", block=True, silent=True)
        if sorted(self.ranks) != list(range(len(self.ranks))):
            raise ClusterError(f"the engines are not one MPI world (ranks {sorted(self.ranks)}); "
                               f"the {self.launcher!r} launcher did not start them under one mpiexec")
        here = socket.gethostname()
        self._death_watch = DeathWatch({r: info.pid for r, info in self.ranks.items() if info.host == here},
                                       connect=self._hold_death_pipes)
        # Ranks on other hosts: the same watcher, started there over ssh (hydra's report
        # names only the host of a dead rank). A host whose watcher cannot start is skipped.
        self._remote_watches = []
        for host in sorted({info.host for info in self.ranks.values()} - {here}) if self.hosts else []:
            pids = {r: info.pid for r, info in self.ranks.items() if info.host == host}
            self._remote_watches.append(DeathWatch(pids, via=[launcher_exec(), host],
                                                   connect=self._hold_death_pipes))

    def _hold_death_pipes(self, paths_by_pid: dict[int, str]) -> None:
        """Each engine holds its death watch FIFO open (nbdist.mpi.deaths); engines are idle here."""
        code = ("import nbdist.rank.hooks as __nbdist_engine\n"
                f"__nbdist_engine.hold_death_pipe({paths_by_pid!r})\n"
                "del __nbdist_engine\n")
        self.client[:].execute(code, block=False, silent=True).get(timeout=DEATH_PIPE_TIMEOUT_S)

    def _watches(self) -> list[DeathWatch]:
        return ([self._death_watch] if self._death_watch is not None else []) + self._remote_watches

    def first_dead(self) -> set[int]:
        """The ranks seen dying first, on each host (see nbdist.mpi.deaths); empty if unknown.
        With several hosts this holds each host's first death: the one on the host hydra
        reports is the cause, the others are its follow-ons."""
        return set().union(*(w.first_dead() for w in self._watches()))

    def first_dead_statuses(self) -> dict[int, int]:
        """Wait statuses of the ranks seen dying first, read before MPI's report (may be empty)."""
        found: dict[int, int] = {}
        for watch in self._watches():
            found.update(watch.first_dead_statuses())
        return found

    def _start_watchdog(self) -> None:
        pids = [self.cluster.controller.process.pid] + [p.pid for p in self._mpiexec_procs()]
        watched = []
        for pid in pids:
            try:
                watched.append(reaper.watched_arg(psutil.Process(pid)))
            except psutil.Error:  # already gone: nothing of it to reap
                pass
        me = psutil.Process()
        cmd = [sys.executable, "-m", "nbdist.mpi.reaper", str(os.getpid()), repr(me.create_time()),
               str(self._profile_dir), repr(self._started_at), *watched]
        self._watchdog = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _register_exit_hooks(self) -> None:
        if self._atexit_registered:
            return
        self._atexit_registered = True
        atexit.register(self.stop, quiet=True)

    def _open_output_files(self) -> None:
        """Hold mpiexec's output files open, so their text outlives ipyparallel's clean-up."""
        self._close_output_files()
        for es in self._engine_sets():
            path = getattr(es, "output_file", "")
            try:
                self._output_handles.append(open(path, "rb") if path else None)
            except OSError:  # not a local file (ssh, batch systems): ask the launcher
                self._output_handles.append(None)

    def _close_output_files(self) -> None:
        for handle in self._output_handles:
            if handle is not None:
                try:
                    handle.close()
                except OSError:
                    pass
        self._output_handles = []

    def engine_output(self) -> str:
        """mpiexec's combined output (engine logs, MPI's termination report), read afresh."""
        parts = []
        for i, es in enumerate(self._engine_sets()):
            handle = self._output_handles[i] if i < len(self._output_handles) else None
            if handle is not None:
                try:
                    handle.seek(0)
                    parts.append(handle.read().decode("utf-8", "replace"))
                    continue
                except (OSError, ValueError):
                    pass
            try:
                # ipyparallel caches its first read, and removes the file once mpiexec exits
                # (keeping that last read): re-read only while the file is still there.
                path = getattr(es, "output_file", "")
                if path and os.path.isfile(path):
                    es._output = None
                parts.append(es.get_output())
            except Exception:
                pass
        return "\n".join(parts)

    def _mpiexec_exited(self) -> bool:
        for proc in self._mpiexec_procs():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.Error:
                pass
        return True

    def exit_statuses(self, wait_s: float = 5.0) -> dict[int, int]:
        """After a death: wait (at most wait_s) for mpiexec's exit-code report; each rank's wait status.

        mpiexec prints the report just before it exits; ranks it reports for are
        returned as soon as every rank has one, else whatever the report holds at the
        deadline (possibly nothing).
        """
        deadline = time.monotonic() + wait_s
        by_host: dict[str, list[int]] = {}
        for rank in sorted(self.ranks):
            by_host.setdefault(self.ranks[rank].host, []).append(rank)
        n = len(self.ranks) or (self.n or 0)
        exited_at = None
        while True:
            if exited_at is None and self._mpiexec_exited():
                exited_at = time.monotonic()
            statuses = parse_exit_codes(self.engine_output(), by_host)
            if n and len(statuses) >= n:
                return statuses
            now = time.monotonic()
            # Once mpiexec is gone its report is all there is (a partial one: several engine
            # sets or hosts); a moment's grace for the file, then give up rather than hang.
            if now >= deadline or (exited_at is not None and (statuses or now - exited_at > EXIT_REPORT_GRACE_S)):
                return statuses
            if exited_at is None:
                for proc in self._mpiexec_procs():
                    try:
                        proc.wait(timeout=max(0.0, min(0.2, deadline - now)))
                    except (psutil.TimeoutExpired, psutil.Error):
                        pass
            else:
                time.sleep(min(0.1, max(0.0, deadline - now)))

    def ranks_on(self, host: str) -> list[int]:
        """The ranks hydra placed on `host` of --hosts."""
        where = placement(parse_hosts(self.hosts), self.n or 0)
        return where.get(host) or sorted(r for r, info in self.ranks.items() if info.host == host)

    def host_failures(self, wait_s: float = 5.0) -> list[str]:
        """host_failures_now(), waiting (at most wait_s) for mpiexec to write its banner."""
        start = time.monotonic()
        deadline = start + wait_s
        exited_at = None
        while True:
            lines = self.host_failures_now()
            now = time.monotonic()
            if exited_at is None and self._mpiexec_exited():
                exited_at = now
            # a death named by host only may still get its rank from that host's death watch
            unnamed = any(line.startswith("a rank on ") for line in lines)
            if (lines and not (unnamed and now < start + 2.0)) or not self.hosts or now >= deadline or (
                    exited_at is not None and now - exited_at > 1.0 and not lines):
                return lines
            time.sleep(0.1)

    def host_failures_now(self) -> list[str]:
        """Failures on other hosts, one line each: hosts whose ssh link ended, and ranks that hydra's
        termination banner names (it prints no per-rank exit report when a remote rank dies)."""
        lines: list[str] = []
        if not self.hosts:
            return lines  # one host: mpiexec's exit-code report says it all
        output = self.engine_output()
        lost = list(self._lost_hosts) + [h for h in lost_hosts_in(output, self._addresses)
                                         if h not in self._lost_hosts]
        for host in lost:
            lines.append(lost_host_line(host, self.ranks_on(host)))
        for host, code in banner_deaths(output):
            if host in lost:
                continue
            there = self.ranks_on(host)
            seen = sorted(self.first_dead() & set(there))  # that host's death watch
            rank = there[0] if len(there) == 1 else seen[0] if len(seen) == 1 else None
            lines.append(remote_death_line(host, code, rank, there))
        return lines

    def stop(self, quiet: bool = False) -> bool:
        """Stop engines and controller, kill leftovers, remove segments and files. True if one ran."""
        if self.cluster is None:
            return False
        cluster, self.cluster = self.cluster, None
        pids = []
        try:
            if cluster.controller is not None and cluster.controller.process is not None:
                pids.append(cluster.controller.process.pid)
        except Exception:
            pass
        for es in cluster.engines.values():
            proc = getattr(es, "process", None)
            if proc is not None:
                pids.append(proc.pid)
        # Everything under the controller and mpiexec (engines, nannies, MPI proxies), taken
        # now: once ipyparallel has killed mpiexec, its children are orphans we can't find.
        tree = reaper.process_trees(pids)
        segments = reaper.segments_of(tree)  # the ranks' own MPI segments, whatever their age
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:
                pass
        try:
            cluster.stop_cluster_sync()
        except Exception as exc:
            if not quiet:
                self._notify(f"ipyparallel could not stop the cluster cleanly ({exc!r}); killing it", "warning")
        reaper.kill_procs([p for p in tree if reaper._alive(p.pid)], grace_s=2.0)
        self._close_output_files()
        reaper.remove_orphan_segments(self._started_at, known=segments, settle_s=reaper.SETTLE_S)
        if self._watchdog is not None:
            try:
                self._watchdog.kill()
                self._watchdog.wait(5)
            except Exception:
                pass
            self._watchdog = None
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None
        self.client = self.view = None
        self.ranks = {}
        for watch in self._watches():
            watch.stop()
        self._death_watch, self._remote_watches = None, []
        self._links, self._lost_hosts, self._addresses = None, [], {}
        return True

    def restart(self) -> None:
        """Stop and start again with the same shape (after a fatal fault)."""
        n, launcher, hosts, env = self.n, self.launcher, self.hosts, self.env
        assert n is not None, "restart() of a cluster that never started"
        elastic = self.elastic
        self.stop(quiet=True)
        self.start(n, launcher, hosts, env, elastic=elastic)

    # ---- signals ---------------------------------------------------------------------------

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """SIGINT the given ranks (default all) through their nannies; fall back to mpiexec's relay."""
        targets = [self.engine_of(r) for r in (ranks if ranks is not None else sorted(self.ranks))
                   if r in self.ranks]
        if not targets or self.client is None:
            return
        try:
            self.client.send_signal(signal.SIGINT, targets=targets, block=False)
        except Exception:
            if self.cluster is not None:
                try:
                    self.cluster.signal_engines_sync(signal.SIGINT)
                except Exception:
                    pass

    # ---- status ----------------------------------------------------------------------------

    def status_rows(self, busy_engines: set[int] | None = None) -> list[dict]:
        """One row per rank for %dist_status, refreshed from the engines when they are idle."""
        rows = []
        fresh = {}
        if self.client is not None and not busy_engines:
            try:
                view = self.client[self.engine_ids]
                ar = view.apply_async(_describe_on_engine)
                if ar.wait(5):
                    fresh = {info["rank"]: info for info in ar.get()}
            except Exception:
                fresh = {}
        queue: dict = {}
        try:
            queue = self.client.queue_status() if self.client is not None else {}
        except Exception:
            pass
        for rank in sorted(self.ranks):
            info = self.ranks[rank]
            desc = fresh.get(rank, info.extra)
            q = queue.get(info.engine_id, {}) if isinstance(queue, dict) else {}
            busy = bool(q.get("queue")) or bool(q.get("tasks")) or (
                busy_engines is not None and info.engine_id in busy_engines)
            rows.append({"rank": rank, "engine": info.engine_id, "host": info.host, "pid": info.pid,
                         "gpus": desc.get("gpus", 0), "transports": desc.get("transports", ""),
                         "runtime": desc.get("runtime", ""), "state": "busy" if busy else "idle"})
        return rows


def _describe_on_engine():
    import nbdist.rank.hooks

    return nbdist.rank.hooks.describe()
