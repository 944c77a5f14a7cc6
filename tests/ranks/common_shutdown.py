"""A rank that finishes the last op and shuts down at once must not fail that op on the
peers that are still finishing it (run by test_common.py under mpiexec -n 2 and -n 4).

A broadcast's root returns once it has written the data, and a non-root once it has read
it; a slower peer may still be between the agreement and its copy, its waiting thread
driving the cycle. The first rank's shutdown aborts the agreement segment (to release
peers that wait for it in a cycle): its engine thread then failed every op in flight,
that one included, so `nbdist run -n 4 examples/demo.py` failed about one run in four.
"""
import numpy as np
import pytest

import nbdist.common as hvd


@pytest.mark.parametrize("round_", range(24))
def test_the_last_op_completes_on_every_rank_when_a_peer_shuts_down_at_once(round_):
    hvd.init()
    try:
        rank, size = hvd.rank(), hvd.size()
        ranks = hvd.allgather(np.array([rank], np.int64), name=f"last.gather.{round_}")
        assert ranks.tolist() == list(range(size))
        seed = hvd.broadcast(np.array([1234 + rank]), root_rank=0, name=f"last.bcast.{round_}")
        assert int(seed[0]) == 1234
    finally:
        hvd.shutdown()  # (at once: the peers may still be finishing the broadcast)
