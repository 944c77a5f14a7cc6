"""Several hosts: the `horovodrun -H` host list, hydra's command line across hosts, the
address the hosts reach this machine on, and what a dead rank or a lost host looks like.

One MPI world across hosts comes from MPICH's own ssh bootstrap: `mpiexec -launcher ssh
-hosts h1:2,h2:2` starts one hydra proxy per host over ssh, and the proxies start the
ranks. The ssh command is hydra's: `ssh`, or $HYDRA_LAUNCHER_EXEC (e.g. a wrapper
adding `-F config` or `-i key`). Both the notebook's cluster and `nbdist run` use this.
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess

import psutil

from ..common.config import env_path

CONTROLLER_ADDRESS_ENV = "NBDIST_CONTROLLER_ADDRESS"


class HostsError(ValueError):
    """A host list that cannot work (the message says why)."""


def parse_hosts(spec) -> list[tuple[str, int]]:
    """'h1:2,h2:2' (or a list of such items) -> [('h1', 2), ('h2', 2)]; a host without ':N' has 1 slot."""
    items = [spec] if isinstance(spec, str) else list(spec or [])
    hosts: list[tuple[str, int]] = []
    for item in items:
        for entry in str(item).split(","):
            entry = entry.strip()
            if not entry:
                continue
            name, sep, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
            if not name or not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+", name):
                raise HostsError(f"--hosts: {entry!r} is not host or host:slots")
            if not slots.isdigit() or int(slots) < 1:
                raise HostsError(f"--hosts: {entry!r}: slots must be a positive whole number")
            if any(h == name for h, _ in hosts):
                raise HostsError(f"--hosts: {name} appears twice")
            hosts.append((name, int(slots)))
    return hosts


def hosts_arg(hosts: list[tuple[str, int]]) -> str:
    """The host list as hydra and horovodrun write it: 'h1:2,h2:2'."""
    return ",".join(f"{h}:{s}" for h, s in hosts)


def check_slots(n: int, hosts: list[tuple[str, int]]) -> None:
    """n ranks must fit the slots (as horovodrun -np/-H); more would oversubscribe hosts silently."""
    total = sum(s for _, s in hosts)
    if n > total:
        raise HostsError(f"-n {n} needs {n} slots, but --hosts {hosts_arg(hosts)} gives {total}")


def placement(hosts: list[tuple[str, int]], n: int) -> dict[str, list[int]]:
    """Which ranks hydra puts on each host: it fills each host's slots in list order."""
    where: dict[str, list[int]] = {}
    start = 0
    for name, slots in hosts:
        where[name] = list(range(start, min(start + slots, n)))
        start += slots
    return where


def launcher_exec() -> str:
    """The ssh hydra will run (its own HYDRA_LAUNCHER_EXEC setting, else ssh)."""
    return os.environ.get("HYDRA_LAUNCHER_EXEC") or "ssh"


def ssh_hostname(host: str) -> str:
    """The address ssh would connect to for `host` (`ssh -G` applies ssh_config; nothing is sent)."""
    try:
        out = subprocess.run([launcher_exec(), "-G", host], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return host


def address_toward(hosts: list[str]) -> str:
    """This machine's address on the route to the hosts: where engines and hydra proxies connect back.

    $NBDIST_CONTROLLER_ADDRESS overrides. Otherwise the kernel picks the source address
    of a UDP socket "connected" to the first host that resolves: a UDP connect sends no
    packet, it only chooses the route. Hosts that are this machine give the loopback.
    """
    override = (env_path(CONTROLLER_ADDRESS_ENV.removeprefix("NBDIST_")) or "").strip()
    if override:
        return override
    for host in hosts:
        target = ssh_hostname(host)
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(target, 22, type=socket.SOCK_DGRAM)[0]
        except (socket.gaierror, IndexError):
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
            except OSError:
                continue
            return s.getsockname()[0]
    raise HostsError(f"none of the hosts {', '.join(hosts)} resolves to an address (not in DNS, "
                     f"/etc/hosts or the ssh config); set {CONTROLLER_ADDRESS_ENV} to this machine's "
                     f"address as the hosts see it")


def hydra_ssh_args(hosts: list[tuple[str, int]]) -> list[str]:
    """mpiexec options for one world across hosts through hydra's ssh bootstrap."""
    address = address_toward([h for h, _ in hosts])
    # -localhost: the address the remote proxies connect back to (hydra would use this
    # machine's hostname, which the hosts may not resolve to a reachable address).
    return ["-launcher", "ssh", "-hosts", hosts_arg(hosts), "-localhost", address]


def in_slurm_allocation() -> bool:
    """Inside salloc/sbatch: hydra then starts its proxies with srun on the allocation's nodes."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


# ---- failures seen from mpiexec's side -------------------------------------------------------

# hydra's banner when a rank dies on a host it reached over ssh (there is no per-rank exit
# report then). Its PID is the host's first rank, whichever died (seen every time), and
# ipyparallel's nannies race hydra's clean-up kill, so only the host and the code are
# known: a rank is named only when it is its host's only one.
_BANNER_RE = re.compile(r"PID \d+ RUNNING AT (?P<host>\S+)\s*\n\s*=\s*EXIT CODE: (?P<code>\d+)")
# ssh's own words when the host vanished under it (e.g. every process on it died)
_SSH_LOST_RE = re.compile(r"Connection to (?P<addr>\S+) closed by remote host|"
                          r"ssh: connect to host (?P<addr2>\S+) port \d+:")


def banner_deaths(output: str) -> list[tuple[str, int]]:
    """(host, exit code) for each death hydra's termination banner reports."""
    return [(m["host"], int(m["code"])) for m in _BANNER_RE.finditer(output)]


def lost_hosts_in(output: str, addresses: dict[str, str]) -> list[str]:
    """Hosts ssh says it lost; `addresses` maps host -> the address ssh connected to."""
    by_address = {a: h for h, a in addresses.items()}
    lost = []
    for m in _SSH_LOST_RE.finditer(output):
        addr = (m["addr"] or m["addr2"]).rstrip(".")
        host = by_address.get(addr, addr if addr in addresses else None)
        if host and host not in lost:
            lost.append(host)
    return lost


def ssh_links(mpiexec_pids: list[int], hosts: list[str]) -> dict[str, list[psutil.Process]]:
    """The ssh processes hydra runs to each host (its bootstrap links), by host name."""
    links: dict[str, list[psutil.Process]] = {}
    wanted = set(hosts)
    for pid in mpiexec_pids:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if not any("hydra_pmi_proxy" in a for a in argv):
                continue
            host = next((a for a in argv if a in wanted), None)
            if host is not None:
                links.setdefault(host, []).append(child)
    return links


LINK_GRACE_S = 1.0  # an ended link counts as a lost host only if mpiexec still runs this long after


class LinkWatch:
    """Watches hydra's ssh links to the hosts: lost() names the hosts whose link ended while
    mpiexec kept running (at a normal end or a rank's death, mpiexec exits right after)."""

    def __init__(self, mpiexec_pid: int, hosts: list[str]):
        self.mpiexec_pid, self.hosts = mpiexec_pid, list(hosts)
        self.links: dict[str, list[psutil.Process]] = {}
        self._ended_at: float | None = None

    def lost(self) -> list[str]:
        import time

        if len(self.links) < len(self.hosts):  # links appear while hydra starts its proxies
            self.links.update(ssh_links([self.mpiexec_pid], self.hosts))
        ended = lost_links(self.links) if self.links else []
        if not ended:
            self._ended_at = None
            return []
        now = time.monotonic()
        if self._ended_at is None:
            self._ended_at = now
        try:
            mpiexec = psutil.Process(self.mpiexec_pid)
            running = mpiexec.is_running() and mpiexec.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            running = False
        return ended if running and now - self._ended_at >= LINK_GRACE_S else []


def lost_links(links: dict[str, list[psutil.Process]]) -> list[str]:
    """Hosts whose ssh link has ended: ssh was killed, or the host or the network went away."""
    lost = []
    for host, procs in links.items():
        alive = False
        for proc in procs:
            try:
                alive = alive or (proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
            except psutil.Error:
                pass
        if not alive:
            lost.append(host)
    return lost


def _ranks_text(ranks: list[int]) -> str:
    from ..failure import rank_ranges

    return f"rank{'s' if len(ranks) != 1 else ''} {rank_ranges(ranks)}" if ranks else "its ranks"


def lost_host_line(host: str, ranks: list[int]) -> str:
    """The one message for a lost host (notebook and nbdist run)."""
    verb = "are" if len(ranks) != 1 else "is"
    return (f"host {host} was lost (hydra's ssh connection to it ended): "
            f"{_ranks_text(ranks)} on {host} {verb} out of reach")


def remote_death_line(host: str, code: int, rank: int | None, ranks: list[int]) -> str:
    """The one message for a rank that died on another host, as hydra's banner reports it."""
    how = "killed by signal 9 (SIGKILL)" if code == 9 else f"exit code {code}"
    if rank is not None:
        return f"rank {rank} on {host} died ({how}, as hydra reports it)"
    return (f"a rank on {host} died ({how}, as hydra reports it; {_ranks_text(ranks)} ran there, "
            f"and hydra does not say which)")
