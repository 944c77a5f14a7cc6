"""The coordinator's bookkeeping alone (no MPI): readiness, validation, fusion, cache, stalls."""
from nbdist.common.negotiation import Coordinator, describe_by_rank, rank_list
from nbdist.common.requests import ALLREDUCE, BROADCAST, JOIN, signature
from nbdist.common.ops_base import Sum

import numpy as np


def sig(shape=(4,), dtype=np.float32, kind=ALLREDUCE, **kw):
    return signature(kind, np.empty(shape, dtype), **kw)


def make(size=3, **kw):
    clock = {"t": 0.0}
    warnings = []
    coord = Coordinator(size, kw.pop("fusion", 1 << 20), kw.pop("cache", 16),
                        kw.pop("stall", 10.0), kw.pop("timeout", 20.0),
                        warn=warnings.append, clock=lambda: clock["t"])
    return coord, clock, warnings


def test_ready_only_when_every_rank_submitted_in_any_order():
    coord, _, _ = make()
    coord.add(2, ("b", sig(), True))
    coord.add(0, ("a", sig(), True))
    coord.add(1, ("a", sig(), True))
    assert not coord.has_ready() or coord.ready == []
    coord.add(2, ("a", sig(), True))
    coord.add(0, ("b", sig(), True))
    coord.add(1, ("b", sig(), True))
    units = coord.take_units()
    names = [coord._response_of(e).names[0] for u in units for e in u]
    assert sorted(names) == ["a", "b"]
    assert len(units) == 1  # same dtype and op: fused


def test_fusion_respects_threshold_and_keys():
    coord, _, _ = make(size=2, fusion=64)
    for r in range(2):
        coord.add(r, ("x", sig((8,)), True))  # 32 bytes
        coord.add(r, ("y", sig((8,)), True))  # 32 bytes: fits with x
        coord.add(r, ("z", sig((8,)), True))  # would exceed 64
        coord.add(r, ("w", sig((8,), np.float64), True))  # another dtype
    units = coord.take_units()
    assert [len(u) for u in units] == [2, 1, 1]


def test_mismatch_names_each_rank():
    coord, _, _ = make()
    coord.add(0, ("m", sig((3,)), True))
    coord.add(1, ("m", sig((3,)), True))
    coord.add(2, ("m", sig((4,)), True))
    (unit,) = coord.take_units()
    resp = unit[0]
    assert resp.error[0] == "MismatchError"
    assert "ranks 0-1: (3,)" in resp.error[1] and "rank 2: (4,)" in resp.error[1]


def test_cache_turns_repeats_into_ids():
    coord, _, _ = make(size=2)
    for r in range(2):
        coord.add(r, ("g", sig(op=Sum), True))
    (unit,) = coord.take_units()
    cid = unit[0].cache_id
    assert cid >= 0
    for r in range(2):
        coord.add(r, cid)
    (unit,) = coord.take_units()
    assert unit == [cid]  # travels as a bare id


def test_unnamed_ops_are_not_cached():
    coord, _, _ = make(size=2)
    for r in range(2):
        coord.add(r, ("allreduce.noname.0.1", sig(), False))
    (unit,) = coord.take_units()
    assert unit[0].cache_id == -1
    assert coord.cache_by_id == {}


def test_unnamed_ops_become_templates_for_the_shm_agreement():
    # With cache_unnamed (the shm agreement's replicas) the first unnamed op of a signature
    # becomes a template each rank finds by its own signature; no name leads to it.
    coord, _, _ = make(size=2)
    coord.cache_unnamed = True
    gather = {0: sig((1, 2), kind="allgather"), 1: sig((3, 2), kind="allgather")}
    for n, per_rank in enumerate([{0: sig(), 1: sig()}, gather, {0: sig(), 1: sig()}]):
        for r in range(2):
            coord.add(r, (f"x.noname.0.0.{n}", per_rank[r], False, True))
        (unit,) = coord.take_units()
        assert unit[0].cache_id == -1  # (run as it is: the ranks rename the template)
    assert len(coord.unnamed_cids) == 2  # the third repeated the first's signature
    cid = coord.unnamed_cid(0, sig())
    assert cid is not None and coord.unnamed_cid(1, sig()) == cid
    assert coord.cache_by_id[cid].unnamed and coord.cache_by_name == {}
    assert coord.unnamed_cid(1, gather[1]) == coord.unnamed_cid(0, gather[0]) != cid
    assert coord.unnamed_cid(0, gather[1]) is None  # rank 0 never sent that shape
    assert coord.unnamed_cid(0, sig((5,))) is None
    # A signature that one rank shares with a template but another does not would leave a
    # rank two templates to choose from: it is not made one.
    for r, s in {0: gather[0], 1: sig((5, 2), kind="allgather")}.items():
        coord.add(r, ("x.noname.0.0.9", s, False, True))
    (unit,) = coord.take_units()
    assert unit[0].error is None and len(coord.unnamed_cids) == 2


def test_stall_warning_then_timeout_then_tombstone():
    coord, clock, warnings = make(size=4)
    coord.add(0, ("s", sig(), True))
    coord.add(2, ("s", sig(), True))
    clock["t"] = 11
    assert coord.check_stalls() == []
    assert "ranks 0, 2" in warnings[0] and "ranks 1, 3" in warnings[0]
    clock["t"] = 21
    (failed,) = coord.check_stalls()
    assert failed.error[0] == "CollectiveTimeoutError" and failed.targets == (0, 2)
    late = coord.add(1, ("s", sig(), True))
    assert late[0].targets == (1,) and late[0].error[0] == "CollectiveTimeoutError"


def test_overdue_then_fail_stalled_as_the_shm_agreement_uses_them():
    """Rank 0's replica names the overdue ops; every replica fails them the same way."""
    replicas = [make(size=4) for _ in range(2)]
    for coord, _clock, _ in replicas:
        coord.add(0, ("s", sig(), True))
        coord.add(2, ("s", sig(), True))
    coord0, clock0, warnings0 = replicas[0]
    clock0["t"] = 11
    assert coord0.overdue() == [] and "missing on ranks 1, 3" in warnings0[0]
    clock0["t"] = 21
    ((name, age),) = coord0.overdue()
    assert name == "s" and coord0.pending  # overdue() decides, it does not fail
    failed = [coord.fail_stalled(name, age)[0] for coord, _, _ in replicas]
    assert failed[0] == failed[1] and failed[0].targets == (0, 2)
    assert "ranks 1, 3 never submitted it" in failed[0].error[1]
    assert all(coord.fail_stalled(name, age) == [] for coord, _, _ in replicas)
    late = replicas[1][0].add(3, ("s", sig(), True))
    assert late[0].targets == (3,) and late[0].error[0] == "CollectiveTimeoutError"


def test_join_lets_the_others_go_on():
    coord, _, _ = make(size=3)
    coord.add(0, ("__nbdist.join__", signature(JOIN, None), False))
    coord.add(1, ("r", sig(), True))
    coord.add(2, ("r", sig(), True))
    (unit,) = coord.take_units()
    assert unit[0].joined == (0,) and unit[0].error is None
    coord.add(1, ("__nbdist.join__", signature(JOIN, None), False))
    coord.add(2, ("__nbdist.join__", signature(JOIN, None), False))
    (unit,) = coord.take_units()
    assert unit[0].kind == JOIN and unit[0].last_joined == 2


def test_broadcast_root_mismatch():
    coord, _, _ = make(size=2)
    coord.add(0, ("b", sig(kind=BROADCAST, root=0), True))
    coord.add(1, ("b", sig(kind=BROADCAST, root=1), True))
    (unit,) = coord.take_units()
    assert "root rank" in unit[0].error[1]


def test_rank_lists_stay_short():
    assert rank_list([0, 1, 2, 3, 7]) == "ranks 0-3, 7"
    assert rank_list([5]) == "rank 5"
    assert describe_by_rank({0: "a", 1: "b", 2: "a"}) == "ranks 0, 2: a; rank 1: b"
