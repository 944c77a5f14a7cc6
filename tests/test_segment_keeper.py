"""The segment keeper a rank on another host leaves beside itself (nbdist.mpi.segment_keeper):
once the rank is killed, its /dev/shm segments go, and a segment a live process still maps stays."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

# A stand-in rank: maps its own segment and one it shares with a live peer, then waits to be killed.
RANK = """
import mmap, os, sys, time
maps = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
print("mapped", flush=True)
time.sleep(600)
"""


def test_keeper_removes_a_killed_ranks_segments_and_keeps_held_ones():
    tag = secrets.token_hex(4)
    own, shared = f"/dev/shm/nbdist-test-{tag}-own", f"/dev/shm/nbdist-test-{tag}-shared"
    peer = subprocess.Popen([sys.executable, "-c", RANK, shared], stdout=subprocess.PIPE, text=True)
    rank = subprocess.Popen([sys.executable, "-c", RANK, own, shared], stdout=subprocess.PIPE, text=True)
    keeper = None
    try:
        assert peer.stdout.readline().strip() == "mapped"
        assert rank.stdout.readline().strip() == "mapped"
        keeper = subprocess.Popen([sys.executable, "-m", "nbdist.mpi.segment_keeper", str(rank.pid),
                                   repr(time.time()), "--settle", "2"], start_new_session=True)
        time.sleep(1.0)  # its first look at the rank's maps
        assert keeper.poll() is None, "the keeper left while the rank still ran"
        rank.send_signal(signal.SIGKILL)
        rank.wait(10)
        peer_holds = os.path.exists(shared)
        keeper.wait(30)  # it waits (2 s here) for the shared one, which the peer still maps
        assert not os.path.exists(own), "the killed rank's segment was left behind"
        assert peer_holds and os.path.exists(shared), "a segment a live process maps was removed"
    finally:
        for proc in (rank, peer, keeper):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for path in (own, shared):
            if os.path.exists(path):
                os.unlink(path)
