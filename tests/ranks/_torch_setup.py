"""Shared set-up of the torch rank tests: one thread per rank, nbdist started per module."""
import pytest
import torch

import nbdist.torch as hvd

# 4 ranks share 2 cores: one thread each keeps the runs from thrashing.
torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.barrier()


def R():
    return hvd.rank()


def N():
    return hvd.size()
