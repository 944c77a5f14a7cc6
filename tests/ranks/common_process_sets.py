"""Process sets (run under mpiexec): collectives over a subset of ranks, each set with
its own engine, and the errors a user gets for a set that cannot run an op."""
import numpy as np
import pytest

import nbdist.common as hvd
from _common_setup import N, R, runtime  # noqa: F401 (the autouse fixture starts nbdist)


@pytest.fixture()
def even_odd():
    even = hvd.add_process_set([r for r in range(N()) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(N()) if r % 2 == 1]) if N() > 1 else None
    yield even, odd
    hvd.remove_process_set(even)
    if odd is not None:
        hvd.remove_process_set(odd)


def test_ops_stay_inside_the_set(even_odd):
    even, odd = even_odd
    mine = even if R() % 2 == 0 else odd
    members = mine.ranks
    assert mine.included() and mine.size() == len(members) and mine.rank() == members.index(R())
    x = np.full(3, float(R()), np.float32)
    assert np.allclose(hvd.allreduce(x, op=hvd.Sum, process_set=mine), sum(members))
    gathered = hvd.allgather(x[:1], process_set=mine)
    assert gathered.tolist() == [float(r) for r in members]
    root = members[-1]  # a global rank, as in Horovod
    assert hvd.broadcast(x, root, process_set=mine).tolist() == [float(root)] * 3
    assert hvd.broadcast_object({"r": R()}, root, process_set=mine) == {"r": root}
    assert hvd.allgather_object(R(), process_set=mine) == members
    rs = hvd.reducescatter(np.ones((2 * len(members), 2), np.float32), op=hvd.Sum,
                           process_set=mine)
    assert rs.shape == (2, 2) and np.all(rs == len(members))
    out, splits = hvd.alltoall(np.arange(len(members), dtype=np.float32), process_set=mine)
    assert out.tolist() == [float(mine.rank())] * len(members)
    hvd.barrier(process_set=mine)
    # the global set still works beside them, with the same op name
    assert np.allclose(hvd.allreduce(x, op=hvd.Sum, name="ps.same"), sum(range(N())))
    assert np.allclose(hvd.allreduce(x, op=hvd.Sum, name="ps.same", process_set=mine),
                       sum(members))


def test_errors_name_the_problem(even_odd):
    even, odd = even_odd
    other = odd if R() % 2 == 0 else even
    if other is not None:
        with pytest.raises(ValueError, match=f"rank {R()} is not in"):
            hvd.allreduce(np.ones(2), process_set=other)
    mine = even if R() % 2 == 0 else odd
    outsider = next((r for r in range(N()) if r not in mine.ranks), None)
    if outsider is not None:
        with pytest.raises(ValueError, match="not in the process set"):
            hvd.broadcast(np.ones(2), outsider, process_set=mine)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(np.ones(2), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="exists already"):
        hvd.add_process_set(even.ranks)
    assert hvd.global_process_set.size() == N() and hvd.global_process_set.included()


def test_remove_then_add_again():
    ps = hvd.add_process_set(list(range(N())))
    assert ps.process_set_id and ps.size() == N()
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=ps)[0] == N()
    assert hvd.remove_process_set(ps) and ps.process_set_id is None
    assert not hvd.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(np.ones(1), process_set=ps)
    again = hvd.add_process_set(list(range(N())))
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=again)[0] == N()
    hvd.remove_process_set(again)


def test_a_set_of_one_rank_runs_alone():
    solo = [hvd.add_process_set([r]) for r in range(N())]
    mine = solo[R()]
    assert hvd.allreduce(np.full(2, 7.0), process_set=mine).tolist() == [7.0, 7.0]
    for ps in solo:
        hvd.remove_process_set(ps)
