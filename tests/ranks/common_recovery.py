"""After an abort, the next collectives work on every rank, also on a rank that was idle.

The stuck-cluster defect: rank 0 was interrupted in a collective while rank 1 never
reached it (asleep). Rank 1 learned of the abort only when it sent its next op, which
rank 0 then dropped as stale and rank 1 failed with the old reason - every later cell
failed the same way. The abort now names the ops it fails; the rest are sent again.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

import nbdist.common as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()


def _interrupt_me_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _check_works(tag: str) -> None:
    got = hvd.allreduce(np.ones(3) * (R + 1), op=hvd.Sum, name=f"works-{tag}")
    assert got.tolist() == [N * (N + 1) / 2] * 3


@pytest.mark.parametrize("round_", range(3))
def test_interrupted_rank_while_peers_are_elsewhere(round_):
    """Rank 0 is interrupted inside a collective the others never reach (they sleep)."""
    if R == 0:
        _interrupt_me_in(1.0)
        with pytest.raises(KeyboardInterrupt):
            hvd.allreduce(np.ones(3), name=f"asym-{round_}")
    else:
        time.sleep(1.5)  # idle: its engine hears of the abort only with its next op
    _check_works(f"asym-{round_}")
    _check_works(f"asym-{round_}-again")


def test_interrupted_in_a_cached_op_while_peers_are_elsewhere():
    """As above with an op the response cache knows: rank 0's synchronous call goes the
    express way (Engine.express_allreduce), finds no peer, and waits as a queued op."""
    hvd.allreduce(np.ones(3), name="asym-cached")
    if R == 0:
        _interrupt_me_in(1.0)
        with pytest.raises(KeyboardInterrupt):
            hvd.allreduce(np.ones(3), name="asym-cached")
    else:
        time.sleep(1.5)
    _check_works("asym-cached")
    got = hvd.allreduce(np.ones(3), op=hvd.Sum, name="asym-cached")
    assert got.tolist() == [N] * 3


def test_raise_while_one_rank_is_idle():
    """The last rank raises and aborts while rank 0 waits in a collective; the middle
    ranks sleep through it. Then everyone's next collectives work."""
    if R == N - 1:
        time.sleep(0.5)
        hvd.abort(f"rank {R} raised ValueError: corrupt batch (test)")
    elif R == 0:
        with pytest.raises(hvd.AbortedError, match="corrupt batch"):
            hvd.allreduce(np.ones(2), name="waiting")
    else:
        time.sleep(1.5)
    _check_works("after-raise")
    hvd.barrier()
