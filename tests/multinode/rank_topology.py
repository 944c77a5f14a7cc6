"""Topology and transport choice on simulated hosts (run on every rank under
`mpiexec -launcher ssh -hosts ...` by tests/test_multinode.py).

NBDIST_TEST_PLACEMENT lists each rank's expected host in rank order, e.g.
"h1,h1,h2,h2" (2x2), "h1,h1,h1,h2" (3+1) or "h1,h2,h1,h2" (round robin).
"""
import os
import socket

import numpy as np
import pytest
from mpi4py import MPI

import nbdist.common as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
PLACEMENT = os.environ["NBDIST_TEST_PLACEMENT"].split(",")
HOSTS = list(dict.fromkeys(PLACEMENT))  # in order of first rank


def expected():
    """Horovod's definitions: local = ranks on my host; cross = ranks with my local rank."""
    mine = PLACEMENT[RANK]
    on_host = [r for r, h in enumerate(PLACEMENT) if h == mine]
    local_rank = on_host.index(RANK)
    peers = [r for r, h in enumerate(PLACEMENT)
             if [q for q, g in enumerate(PLACEMENT) if g == h].index(r) == local_rank]
    return {"local_rank": local_rank, "local_size": len(on_host),
            "cross_rank": peers.index(RANK), "cross_size": len(peers)}


def test_placement_is_the_host_list():
    assert SIZE == len(PLACEMENT)
    assert socket.gethostname() == PLACEMENT[RANK]
    assert MPI.Get_processor_name() == PLACEMENT[RANK]


def test_topology_values():
    want = expected()
    got = {"local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
           "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size()}
    assert got == want, f"rank {RANK} on {PLACEMENT[RANK]}"
    topo = hvd.basics.topology()
    assert topo.hostname == PLACEMENT[RANK]
    assert topo.hosts == PLACEMENT


def test_transport_per_level():
    ts = hvd.basics.engine().transports
    assert ts.multi_node
    for kind in ("allreduce", "allgather", "broadcast", "reducescatter"):
        assert ts.for_op("cpu", kind).name == "hierarchical", kind
    assert ts.for_op("cpu", "alltoall").name == "mpi"
    hier = ts.hierarchical
    assert hier.nodes == [[r for r, h in enumerate(PLACEMENT) if h == host] for host in HOSTS]
    # shared memory inside a host only where the host has more than one rank
    assert (ts.shm is not None) == (hvd.local_size() > 1)


def test_allreduce_values_through_the_runtime():
    x = np.arange(10, dtype=np.float32) + RANK
    out = hvd.allreduce(x, op=hvd.Sum, name="mn.sum")
    np.testing.assert_array_equal(out, np.arange(10, dtype=np.float32) * SIZE + SIZE * (SIZE - 1) / 2)
    names = hvd.allgather_object(socket.gethostname())
    assert names == PLACEMENT


@pytest.mark.parametrize("root", range(4))
def test_broadcast_from_every_host(root):
    if root >= SIZE:
        pytest.skip("fewer ranks")
    x = np.full(7, RANK, np.int64)
    out = hvd.broadcast(x, root, name=f"mn.bcast.{root}")
    np.testing.assert_array_equal(out, np.full(7, root))
