"""A one-node Slurm cluster for tests: a private munged, slurmctld and slurmd (Debian's
slurm-wlm), all on loopback (127.0.0.1) with free ports, state in a temporary
directory, torn down in stop() with every job cancelled. Clients find it through
SLURM_CONF (env()); nothing in /etc is touched.

The node claims 8 CPUs (SlurmdParameters=config_overrides) so that a 2-engine job
and a batch job fit side by side on a 2-core machine.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class Unavailable(RuntimeError):
    """Slurm cannot be started here (the reason is the message)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimSlurm:
    """slurmctld + slurmd for one node (this machine), reachable via SLURM_CONF."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="nbdist-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self._procs: dict[str, subprocess.Popen] = {}

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> "SimSlurm":
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scancel"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                raise Unavailable(f"{tool} is not installed (apt-get install slurm-wlm)")
        if os.geteuid() != 0:
            raise Unavailable("the test cluster's slurmd runs jobs as root; not root here")
        try:
            self._start_munge()
            self._write_conf()
            self._start("slurmctld")
            self._start("slurmd")
            self._wait_idle()
        except Unavailable:
            self.stop()
            raise
        except Exception as exc:
            self.stop()
            raise Unavailable(f"slurm did not start: {exc}") from exc
        return self

    def _start_munge(self) -> None:
        m = self.dir / "munge"
        m.mkdir(mode=0o700)
        key = m / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        self.munge_socket = m / "sock"
        proc = subprocess.run(
            [shutil.which("munged") or "/usr/sbin/munged", "--force", "-S", str(self.munge_socket),
             "--key-file", str(key), "--pid-file", str(m / "pid"), "--log-file", str(m / "log"),
             "--seed-file", str(m / "seed")], capture_output=True, text=True, timeout=20)
        if proc.returncode != 0:
            raise Unavailable(f"munged failed: {proc.stderr.strip()}")

    def _write_conf(self) -> None:
        d = self.dir
        (d / "state").mkdir()
        (d / "spool").mkdir()
        self.conf.write_text("\n".join([
            "ClusterName=nbdisttest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            # no cgroups in a container: track job processes by parent pid
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/backfill",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "SwitchType=switch/none", "InactiveLimit=0", "KillWait=3", "MinJobAge=5",
            "SlurmdParameters=config_overrides",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            ""]))

    def _start(self, daemon: str) -> None:
        exe = shutil.which(daemon) or f"/usr/sbin/{daemon}"
        log = open(self.dir / f"{daemon}.out", "wb")
        self._procs[daemon] = subprocess.Popen(
            [exe, "-D", "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, **self.env()}, start_new_session=True)
        log.close()

    def _wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise Unavailable(f"{name} exited: {self.log_tail(name)}")
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                 env={**os.environ, **self.env()}, timeout=10)
            state = out.stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return
            time.sleep(0.3)
        raise Unavailable(f"the node did not become idle (state {state!r}): {self.log_tail('slurmctld')}")

    def log_tail(self, daemon: str, chars: int = 800) -> str:
        try:
            return (self.dir / f"{daemon}.out").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True,
                             env={**os.environ, **self.env()}, timeout=10)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def stop(self) -> None:
        env = {**os.environ, **self.env()}
        if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True,
                           timeout=10)
            deadline = time.monotonic() + 10
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in ("slurmd", "slurmctld"):
            proc = self._procs.pop(name, None)
            if proc is None:
                continue
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        pid_file = self.dir / "munge" / "pid"
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
