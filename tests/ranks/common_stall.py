"""Stall warning and timeout (run with NBDIST_STALL_WARNING_S=1 NBDIST_TIMEOUT_S=3)."""
import time

import numpy as np
import pytest

import nbdist.common as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def test_op_missing_on_some_ranks_warns_then_times_out(capfd):
    if RANK == 0:
        start = time.monotonic()
        with pytest.raises(hvd.CollectiveTimeoutError) as info:
            hvd.allreduce(np.ones(2), name="lonely")
        elapsed = time.monotonic() - start
        assert 2.5 < elapsed < 15
        missing = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}"
        assert "lonely" in str(info.value) and missing in str(info.value)
        err = capfd.readouterr().err
        assert "stall" in err and "lonely" in err and missing in err
    else:
        time.sleep(3.5)  # let rank 0's op time out before the next op starts its clock
    got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.timeout")
    np.testing.assert_array_equal(got, np.full(2, SIZE))


def test_late_rank_gets_the_timeout_too():
    if RANK != 0:
        with pytest.raises(hvd.CollectiveTimeoutError):
            hvd.allreduce(np.ones(2), name="lonely")
    hvd.barrier()


def test_cached_op_missing_on_some_ranks_warns_then_times_out(capfd):
    # An op the response cache knows goes the express way on rank 0; the others do not
    # come, so it waits as a queued op and gets the same stall warning and timeout.
    hvd.allreduce(np.ones(2), name="cached.lonely")
    if RANK == 0:
        with pytest.raises(hvd.CollectiveTimeoutError, match="cached.lonely"):
            hvd.allreduce(np.ones(2), name="cached.lonely")
        err = capfd.readouterr().err
        assert "stall" in err and "cached.lonely" in err
    else:
        time.sleep(3.5)
    got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.cached.timeout")
    np.testing.assert_array_equal(got, np.full(2, SIZE))
