"""Two ranks on one GPU (run by tests/test_gpu_nccl.py with CUDA_VISIBLE_DEVICES set to
one device): NCCL refuses that, and every rank must get nbdist's error naming the cause,
promptly, through the transport and through nbdist.torch; a fresh init() then works."""
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import nbdist.torch as hvd
from nbdist import common
from nbdist.common.config import Config
from nbdist.common.ops_base import ReduceOp
from nbdist.common.topology import Topology
from nbdist.common.transport import TransportError
from nbdist.common.transports.select import TransportSet

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def expect_cause(message: str) -> None:
    assert f"rank {RANK}: ranks 0 and 1 both use GPU" in message, message
    assert "Duplicate GPU detected" in message and "one rank per GPU" in message, message


def test_the_transport_names_the_shared_gpu():
    assert SIZE == 2 and torch.cuda.device_count() == 1
    torch.cuda.set_device(0)
    topology = Topology.from_mpi(COMM)
    ts = TransportSet(Config.from_environment(), topology, should_stop=None)
    try:
        buf = torch.ones(1000, device="cuda")
        start = time.monotonic()
        with pytest.raises(TransportError) as info:
            ts.for_op("cuda:0", "allreduce").allreduce(buf, ReduceOp.Sum)
        assert time.monotonic() - start < 30
        expect_cause(str(info.value))
    finally:
        ts.close()
        topology.free()


def test_nbdist_torch_names_the_shared_gpu_and_init_again_works():
    hvd.init()
    torch.cuda.set_device(0)
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        hvd.allreduce(torch.ones(1000, device="cuda"), op=hvd.Sum, name="shared")
    assert time.monotonic() - start < 60
    expect_cause(str(info.value))
    hvd.shutdown()
    hvd.init()  # the runtime starts again; CPU collectives are unaffected
    try:
        out = common.allreduce(np.full(10, RANK + 1.0), op=common.Sum, name="cpu.after")
        assert np.all(out == 3.0)
    finally:
        hvd.shutdown()
