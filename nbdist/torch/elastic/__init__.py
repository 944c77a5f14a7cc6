"""Horovod's elastic API for PyTorch: `hvd.elastic.run`, `TorchState`, `ElasticSampler`.

See nbdist.common.elastic for the retry loop and docs/elastic.md for the notebook side
(`%%distributed -n 4 --elastic --min-np 2`).
"""
from __future__ import annotations

from nbdist.common.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                                   reset_world, run_fn)

from .sampler import ElasticSampler
from .state import TorchState


def run(func):
    """Run `func(state, ...)` elastically: after a lost rank or new ranks, restore or keep the
    last commit, rebuild the world, sync the state from rank 0 and call `func` again.

    Collectives must happen inside `func` (or in state.sync()): a rank that joins later runs
    the cell from the top, and its peers meet it only at the sync.
    """
    return run_fn(func, reset_world)


__all__ = ["run", "TorchState", "ObjectState", "State", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]
