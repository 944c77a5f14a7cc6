"""Behaviours Horovod's own torch suite checks, pinned in our words (run under mpiexec).

Each test here is one that nbdist once got wrong against Horovod's test_torch.py: the
values of scaled reductions, the gradients of reducescatter, join() semantics, the
errors users catch, and helpers Horovod code calls.
"""
import numpy as np
import pytest
import torch

import nbdist.torch as hvd
from _torch_setup import N, R, runtime  # noqa: F401 (fixture)


def horovod_scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """What Horovod's CPU ops give for tensor * factor: integers in float64 (truncated
    back), float16 in float32, other floats in their own dtype."""
    if not tensor.dtype.is_floating_point:
        work = torch.float64
    elif tensor.dtype == torch.float16:
        work = torch.float32
    else:
        work = tensor.dtype
    return (tensor.to(work) * torch.tensor(factor, dtype=torch.float64).to(work)).to(tensor.dtype)


SCALE_DTYPES = [torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_allreduce_prescale_and_postscale_match_horovod(dtype):
    torch.manual_seed(7)
    factor = 0.6139  # rounding it to float16 would change the results
    x = torch.randint(-100, 100, (17, 3)).to(dtype)
    pre = hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor)
    assert torch.equal(pre, horovod_scaled(x, factor) * N())
    post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor)
    wide = (x.double() * N()) if not dtype.is_floating_point else (x * N())
    assert torch.equal(post, horovod_scaled(wide, factor).to(dtype))


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
def test_reducescatter_prescale_and_postscale_match_horovod(dtype):
    torch.manual_seed(8)
    factor = 0.4137
    x = torch.randint(-100, 100, (N() * 4, 5)).to(dtype)
    mine = slice(R() * 4, (R() + 1) * 4)
    pre = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=factor)
    assert torch.equal(pre, horovod_scaled(x, factor)[mine] * N())
    grouped = hvd.grouped_reducescatter([x, x], op=hvd.Sum, postscale_factor=factor)
    wide = (x.double() * N()) if not dtype.is_floating_point else (x * N())
    for out in grouped:
        assert torch.equal(out, horovod_scaled(wide, factor).to(dtype)[mine])


def test_integer_average_rounds_toward_zero():
    x = torch.tensor([-3, -1, 1, 3], dtype=torch.int32) if R() == 0 else torch.zeros(4, dtype=torch.int32)
    got = hvd.allreduce(x, op=hvd.Average)
    assert torch.equal(got, torch.div(torch.tensor([-3, -1, 1, 3], dtype=torch.int32), N(),
                                      rounding_mode="trunc").int())


@pytest.mark.parametrize("op, expect", [(hvd.Sum, "size"), (hvd.Average, "one")])
def test_reducescatter_gradient_is_horovods(op, expect):
    x = torch.ones(N() * 2, 3, requires_grad=True)
    hvd.reducescatter(x, op=op).backward(torch.ones(2, 3))
    want = float(N()) if expect == "size" else 1.0
    assert torch.equal(x.grad, torch.full((N() * 2, 3), want))
    ys = [torch.ones(N() * 2, requires_grad=True) for _ in range(2)]
    for out in hvd.grouped_reducescatter(ys, op=op):
        out.backward(torch.ones(2))
    for y in ys:
        assert torch.equal(y.grad, torch.full((N() * 2,), want))


def test_grouped_allgather_gradient():
    rows = R() + 1
    xs = [torch.full((rows, 2), float(R()), requires_grad=True) for _ in range(3)]
    gathered = hvd.grouped_allgather(xs)
    total = N() * (N() + 1) // 2
    assert all(g.shape == (total, 2) for g in gathered)
    # every rank sends the same gradient, r in rank r's rows: each rank gets its own back
    grad = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N())])
    for g in gathered:
        g.backward(grad)
    for x in xs:
        assert torch.equal(x.grad, torch.full((rows, 2), float(R())))


def test_join_others_reduce_with_zeros_and_full_divisor():
    for first in range(N()):
        x = torch.full((5,), 6.0)
        if R() == first:
            last = hvd.join()
        else:
            out = hvd.allreduce(x)  # unnamed: the joined rank does not count it
            assert torch.equal(out, torch.full((5,), 6.0 * (N() - 1) / N()))
            last = hvd.join()
        assert last != first or N() == 1
        assert hvd.allgather_object(last) == [last] * N()
        assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(N())))


@pytest.mark.parametrize("kind", ["allgather", "broadcast"])
def test_allgather_and_broadcast_raise_while_a_rank_joined(kind):
    if N() == 1:
        pytest.skip("needs two ranks")
    for first in range(N()):
        if R() == first:
            last = hvd.join()
        else:
            with pytest.raises(RuntimeError, match="joined"):
                # unnamed, as Horovod's test: the joined rank skips them, and the
                # numbering of unnamed ops must still agree once everyone joined
                if kind == "allgather":
                    hvd.allgather(torch.ones(3))
                else:
                    hvd.broadcast(torch.ones(3), (first + 1) % N())
            last = hvd.join()
        assert last != first


def test_broadcast_async_duplicate_pending_name_raises_value_error():
    if R() == 0:
        hvd.broadcast_async(torch.ones(4), 0, name="compat.dup.bcast")
        with pytest.raises(ValueError, match="in flight"):
            hvd.broadcast_async(torch.ones(4), 0, name="compat.dup.bcast")
    hvd.barrier()


def test_broadcast_optimizer_state_with_frozen_parameter():
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                            requires_grad=False)
            self.weight = torch.nn.Parameter(torch.rand(4))

    model = Frozen()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.index.grad is None
    grad = model.weight.grad
    assert isinstance(grad, torch.Tensor) and torch.equal(grad, torch.zeros(4))
    assert torch.equal(hvd.broadcast(model.weight.detach(), 0), model.weight.detach())


def test_sparse_allreduce_async_matches_dense_allreduce():
    torch.manual_seed(100 + R())
    dense = torch.rand(9, 4)
    dense[dense < 0.7] = 0
    if R() == 0:
        dense.zero_()  # a rank with no entries at all
    want = hvd.allreduce(dense)
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="compat.sparse", op=hvd.Average)
    got = handle()
    assert got.is_sparse
    assert torch.allclose(got.to_dense(), want, atol=1e-6)
    summed = hvd.synchronize(hvd.sparse_allreduce_async(dense.to_sparse(), name="compat.sparse2",
                                                        op=hvd.Sum))
    assert torch.allclose(summed.to_dense(), want * N(), atol=1e-6)


def test_alltoall_with_empty_sends_and_receives():
    # rank 0 sends nothing at all; every rank sends nothing to rank 0
    splits = [0] + [0 if R() == 0 else 2] * (N() - 1)
    x = torch.arange(sum(splits) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * R()
    out, received = hvd.alltoall(x, splits=torch.tensor(splits))
    expect_rows = 0 if R() == 0 else 2 * (N() - 1)
    assert out.shape == (expect_rows, 3)
    assert received.tolist() == [0] + [0 if R() == 0 else 2] * (N() - 1)
    if R() > 0:
        senders = [s for s in range(1, N())]
        mine = (R() - 1) * 2  # my rows in each sender's buffer
        want = torch.cat([torch.arange(sum([0] + [2] * (N() - 1)) * 3, dtype=torch.float32)
                          .reshape(-1, 3)[mine:mine + 2] + 100 * s for s in senders])
        assert torch.equal(out, want)


def test_grouped_allgather_matches_horovod_layout():
    xs = [torch.full((3, 2), float(R()), dtype=torch.float16) for _ in range(4)]
    for g in hvd.grouped_allgather(xs):
        assert g.shape == (3 * N(), 2)
        for r in range(N()):
            assert torch.all(g[3 * r:3 * (r + 1)] == r)


def test_numpy_reference_of_scaling_helper():
    # the reference itself: int truncation toward zero, as Horovod's float64 math
    assert horovod_scaled(torch.tensor([-7, 7]), 0.5).tolist() == [-3, 3]
    assert np.isclose(horovod_scaled(torch.tensor([3.0], dtype=torch.float16), 0.1).item(),
                      np.float16(np.float32(3.0) * np.float32(0.1)))


def test_distributed_optimizer_on_a_process_set():
    """Members average over their set; a rank outside it trains alone (Horovod)."""
    even = hvd.add_process_set([r for r in range(N()) if r % 2 == 0])
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(),
                                       process_set=even)
        if even.included():
            hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=even)
        before = model.weight.detach().clone()
        model(torch.full((1, 3), float(R() + 1))).sum().backward()
        opt.step()
        step = before - model.weight.detach()
        if even.included():
            members = even.ranks
            want = sum(r + 1 for r in members) / len(members)
        else:
            want = R() + 1.0
        assert torch.allclose(step, torch.full((1, 3), want))
        weights = hvd.allgather_object(model.weight.detach().tolist())
        if even.included():
            assert all(weights[r] == weights[0] for r in even.ranks)
    finally:
        hvd.remove_process_set(even)


def test_sparse_as_dense_hands_sparse_gradients_back():
    """SparseAdam takes only sparse gradients: sparse_as_dense reduces dense, returns sparse."""
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                       named_parameters=embedding.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        rows = torch.tensor([[1, 2, 4]]) if R() == 0 else torch.tensor([[4, 7]])
        embedding(rows).sum().backward()
        opt.step()
        assert embedding.weight.grad.is_sparse
        weights = hvd.allgather_object(embedding.weight.detach().tolist())
        assert all(w == weights[0] for w in weights)
        opt.remove_hooks()


def test_reducescatter_refuses_adasum_with_a_runtime_error():
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.reducescatter(torch.ones(N() * 2), op=hvd.Adasum)
