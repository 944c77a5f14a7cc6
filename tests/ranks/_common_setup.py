"""Shared set-up of the nbdist.common rank tests: the runtime started once per module."""
import pytest

import nbdist.common as hvd


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.barrier()


def R():
    return hvd.rank()


def N():
    return hvd.size()
