"""Simulated hosts for multinode tests: one network namespace per host, each with its
own address, hostname, /dev/shm and a real sshd, all on one bridge in the root namespace.

    root namespace (the test, the notebook kernel, mpiexec, the ipyparallel controller)
        bridge nbdb<tag>  198.18.<k>.1/24
          ├─ veth ── netns nbd-<tag>-h1   eth0 198.18.<k>.11  hostname h1  sshd :22
          └─ veth ── netns nbd-<tag>-h2   eth0 198.18.<k>.12  hostname h2  sshd :22

Addresses come from 198.18.0.0/15, the block RFC 2544 reserves for benchmarking
tests (never routed on the Internet); the namespaces have no default route, so no
packet can leave this machine. A free /24 is picked per run, so two runs at once
do not collide. The hostnames exist only in the ssh config this harness writes
(`Host h1 → HostName 198.18.k.11`) and in each namespace's UTS namespace, so
hydra (`mpiexec -launcher ssh -hosts h1:2,h2:2`) and nbdist use them exactly as
they would real host names. Everything is torn down in stop(): processes in each
namespace, sshd, the namespaces, the bridge and the files.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), `ip`, `unshare` and /usr/sbin/sshd;
start() raises Unavailable with the reason when any is missing.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
BLOCK = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: reserved for benchmark tests


class Unavailable(RuntimeError):
    """Simulated hosts cannot be made here (the reason is the message)."""


def _run(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _used_subnets() -> set[str]:
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    used = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            net = ipaddress.ip_interface(parts[parts.index("inet") + 1]).network
            used.add(str(net))
    return used


class SimHosts:
    """N simulated hosts reachable over ssh as h1..hN from the root namespace."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.tag = secrets.token_hex(2)
        self.dir = Path(tempfile.mkdtemp(prefix=f"nbdist-simhosts-{self.tag}-"))
        self.bridge = f"nbdb{self.tag}"
        self.netns = {name: f"nbd-{self.tag}-{name}" for name in self.names}
        self.address: dict[str, str] = {}
        self.controller_address = ""
        self._sshd: dict[str, subprocess.Popen] = {}
        self._made_bridge = False
        self._made_ns: list[str] = []

    # ---- paths the tests hand to nbdist / mpiexec ---------------------------------------
    @property
    def ssh(self) -> str:
        """An ssh wrapper with this harness's config (HYDRA_LAUNCHER_EXEC points here)."""
        return str(self.dir / "ssh")

    def env(self) -> dict[str, str]:
        """Environment for anything that launches onto the hosts (nbdist, mpiexec)."""
        return {"HYDRA_LAUNCHER_EXEC": self.ssh}

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> "SimHosts":
        for tool in ("ip", "unshare", "nsenter", "ssh-keygen", "ssh"):
            if shutil.which(tool) is None:
                raise Unavailable(f"{tool} is not installed")
        if not os.path.exists(SSHD):
            raise Unavailable(f"{SSHD} is missing (apt-get install openssh-server)")
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        try:
            self._make_network()
            self._make_ssh()
            for name in self.names:
                self._start_sshd(name)
            self._wait_for_sshd()
        except Unavailable:
            self.stop()
            raise
        except Exception as exc:
            self.stop()
            raise Unavailable(f"could not make simulated hosts: {exc}") from exc
        return self

    def _make_network(self) -> None:
        used = _used_subnets()
        subnets = [s for s in BLOCK.subnets(new_prefix=24) if str(s) not in used]
        if not subnets:
            raise Unavailable("no free /24 in 198.18.0.0/15")
        subnet = subnets[secrets.randbelow(len(subnets))]
        hosts = list(subnet.hosts())
        self.controller_address = str(hosts[0])
        probe = _run("ip", "link", "add", self.bridge, "type", "bridge", check=False)
        if probe.returncode != 0:
            raise Unavailable(f"cannot create a bridge: {probe.stderr.strip()}")
        self._made_bridge = True
        _run("ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns = self.netns[name]
            made = _run("ip", "netns", "add", ns, check=False)
            if made.returncode != 0:
                raise Unavailable(f"ip netns add failed: {made.stderr.strip()}")
            self._made_ns.append(ns)
            veth = f"nbdv{self.tag}{i}"
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            self.address[name] = str(hosts[10 + i])
            _run("ip", "-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _make_ssh(self) -> None:
        d = self.dir
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "hostkey"))
        shutil.copy(d / "id.pub", d / "authorized_keys")
        os.chmod(d / "authorized_keys", 0o600)
        lines = []
        for name in self.names:
            lines += [f"Host {name}", f"  HostName {self.address[name]}"]
        lines += ["Host *", f"  IdentityFile {d / 'id'}", "  IdentitiesOnly yes",
                  "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null",
                  "  BatchMode yes", "  LogLevel ERROR", "  ConnectTimeout 10",
                  # a lost host must be noticed (the ssh-cut test), not waited on for ever
                  "  ServerAliveInterval 2", "  ServerAliveCountMax 3"]
        (d / "ssh_config").write_text("\n".join(lines) + "\n")
        (d / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {d / 'ssh_config'} \"$@\"\n")
        os.chmod(d / "ssh", 0o755)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory

    def _start_sshd(self, name: str) -> None:
        d = self.dir
        conf = d / f"sshd-{name}.conf"
        conf.write_text("\n".join([
            f"ListenAddress {self.address[name]}", "Port 22", f"HostKey {d / 'hostkey'}",
            f"AuthorizedKeysFile {d / 'authorized_keys'}", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            "StrictModes no", f"PidFile {d / f'sshd-{name}.pid'}", "MaxStartups 100",
            "MaxSessions 100", ""]))
        log = open(d / f"sshd-{name}.log", "wb")
        # unshare --uts: the host's own hostname, inherited by everything sshd starts;
        # --mount with a tmpfs on /dev/shm: the host's own shared memory, as on a real host,
        # so a segment left there is not swept by accident from the root namespace.
        self._sshd[name] = subprocess.Popen(
            ["ip", "netns", "exec", self.netns[name], "unshare", "--uts", "--mount", "sh", "-c",
             f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname {name} && exec {SSHD} -D -e -f {conf}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _wait_for_sshd(self, timeout: float = 20) -> None:
        for name in self.names:
            deadline = time.monotonic() + timeout
            while True:
                proc = subprocess.run([self.ssh, name, "hostname"], capture_output=True, text=True,
                                      timeout=30, stdin=subprocess.DEVNULL)
                if proc.returncode == 0 and proc.stdout.strip() == name:
                    break
                if self._sshd[name].poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / f"sshd-{name}.log").read_text(errors="replace")
                    raise Unavailable(f"sshd on simulated host {name} did not answer: "
                                      f"{proc.stderr.strip()} {log[-500:]}")
                time.sleep(0.2)

    # ---- inspection and faults -------------------------------------------------------------
    def pids(self, name: str) -> list[int]:
        """Every process in the host's network namespace (sshd included)."""
        out = _run("ip", "netns", "pids", self.netns[name], check=False).stdout
        return [int(p) for p in out.split()]

    def leftovers(self, name: str) -> list[str]:
        """Processes on the host other than its sshd listener: what a test must not leave."""
        sshd = self._sshd.get(name)
        keep = set()
        if sshd is not None:
            keep.add(sshd.pid)
            try:
                keep.add(int((self.dir / f"sshd-{name}.pid").read_text()))
            except (OSError, ValueError):
                pass
        found = []
        for pid in self.pids(name):
            if pid in keep:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmd.startswith(SSHD) and "-D" in cmd:
                continue
            found.append(f"{pid}: {cmd[:200]}")
        return found

    def segments(self, name: str) -> list[str]:
        """The files in the host's own /dev/shm (MPI's and nbdist's segments)."""
        sshd = self._sshd.get(name)
        if sshd is None or sshd.poll() is not None:
            return []
        out = _run("nsenter", "-t", str(sshd.pid), "-m", "ls", "-A", "/dev/shm", check=False).stdout
        return sorted(out.split())

    def wait_no_segments(self, timeout: float = 30) -> dict[str, list[str]]:
        """Wait until no host's /dev/shm holds a segment; what is still there at the deadline."""
        return self._wait_until_none(self.segments, timeout)

    def wait_clean(self, timeout: float = 15) -> dict[str, list[str]]:
        """Wait until no host has leftovers; what is still there at the deadline."""
        return self._wait_until_none(self.leftovers, timeout)

    def _wait_until_none(self, found, timeout: float) -> dict[str, list[str]]:
        """Ask found(host) of every host until none answers anything, or the deadline passes."""
        deadline = time.monotonic() + timeout
        while True:
            left = {n: v for n in self.names if (v := found(n))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.25)

    def cut(self, name: str) -> None:
        """The host is lost: every process on it dies at once (sshd included), as at a power cut."""
        for pid in self.pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ssh_clients(self, name: str) -> list[int]:
        """The ssh processes in this (root) namespace connected to the host through our config."""
        import psutil

        found = []
        config = str(self.dir / "ssh_config")
        for proc in psutil.process_iter(["pid", "cmdline"]):
            argv = proc.info.get("cmdline") or []
            if argv and argv[0].endswith("ssh") and config in argv and name in argv:
                found.append(proc.info["pid"])
        return found

    def cut_ssh(self, name: str) -> list[int]:
        """Kill the ssh connections to the host (the link a launcher holds); the pids killed."""
        pids = self.ssh_clients(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def root_leftovers(self) -> list[str]:
        """Processes in the root namespace still tied to these hosts (mpiexec, ssh, controller)."""
        import psutil

        found = []
        marks = (str(self.dir), self.controller_address)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(proc.info.get("cmdline") or [])
            if "-D -e -f" in cmd:  # the hosts' own sshd listeners
                continue
            if any(m and m in cmd for m in marks) and proc.info["pid"] != os.getpid():
                found.append(f"{proc.info['pid']}: {cmd[:200]}")
        return found

    def kill_all(self, name: str) -> None:
        """Kill every process in the host's namespace (clean-up)."""
        for _ in range(3):
            pids = self.pids(name)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def stop(self) -> None:
        """Tear everything down; safe to call twice and after a failed start."""
        for name in self.names:
            if self.netns[name] in self._made_ns:
                self.kill_all(name)
        for proc in self._sshd.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._sshd.clear()
        for ns in self._made_ns:
            _run("ip", "netns", "del", ns, check=False)  # removes its end of the veth pair too
        self._made_ns.clear()
        if self._made_bridge:
            _run("ip", "link", "del", self.bridge, check=False)
            self._made_bridge = False
        shutil.rmtree(self.dir, ignore_errors=True)
