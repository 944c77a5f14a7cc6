"""Gradients of nbdist.torch's differentiable collectives on N ranks (Horovod's definitions).

Each rank r weights the op's output with its own tensor w_r, so loss_r = sum(out * w_r),
and every rank can compute the expected gradient from all ranks' weights.
"""
import pytest
import torch

import nbdist.torch as hvd

from _torch_setup import N, R, runtime  # noqa: F401 (the autouse fixture starts nbdist)


def weight(rank, shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(shape, generator=g, dtype=dtype)


def weights(shape, dtype=torch.float64):
    return [weight(r, shape, dtype) for r in range(N())]


@pytest.mark.parametrize("op", ["Average", "Sum"])
def test_allreduce_gradient(op):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = hvd.allreduce(x, op=getattr(hvd, op))
    (out * weight(R(), (3, 4))).sum().backward()
    w = torch.stack(weights((3, 4)))
    expect = w.mean(0) if op == "Average" else w.sum(0)  # the same allreduce of the gradients
    assert torch.allclose(x.grad, expect)


def test_ops_record_a_gradient_only_where_autograd_would():
    # allreduce, allgather and broadcast skip autograd.Function when no gradient is
    # recorded; the results must still look as apply() makes them.
    x = torch.ones(4, requires_grad=True)
    plain = torch.ones(4)
    ops = {"allreduce": lambda t: hvd.allreduce(t, op=hvd.Sum),
           "allgather": lambda t: hvd.allgather(t),
           "broadcast": lambda t: hvd.broadcast(t, 0)}
    for what, op in ops.items():
        recorded = op(x)
        assert recorded.requires_grad and recorded.grad_fn is not None, what
        with torch.no_grad():
            off = op(x)
        assert not off.requires_grad and off.grad_fn is None, what
        out = op(plain)
        assert not out.requires_grad and out.grad_fn is None, what
        assert torch.equal(out, off) and torch.equal(out, recorded.detach()), what
    assert torch.equal(hvd.allreduce(plain, op=hvd.Sum), torch.full((4,), float(N())))
    neg = torch._neg_view(torch.ones(3))  # a lazily negated view: resolved before sending
    assert torch.equal(hvd.allreduce(neg, op=hvd.Sum), torch.full((3,), -float(N())))


def test_allreduce_gradient_with_scale_factors():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
    (out * weight(R(), (5,))).sum().backward()
    assert torch.allclose(x.grad, 6.0 * torch.stack(weights((5,))).sum(0))


def test_allreduce_gradient_fp16_compression():
    x = torch.randn(6, dtype=torch.float32, requires_grad=True)
    out = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    (out * weight(R(), (6,), torch.float32)).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.allclose(x.grad, torch.stack(weights((6,), torch.float32)).mean(0), atol=1e-2)


def test_grouped_allreduce_gradient():
    xs = [torch.randn(2, dtype=torch.float64, requires_grad=True),
          torch.randn(3, 2, dtype=torch.float64, requires_grad=True)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    loss = (outs[0] * weight(R(), (2,))).sum() + (outs[1] * weight(R() + 50, (3, 2))).sum()
    loss.backward()
    assert torch.allclose(xs[0].grad, torch.stack(weights((2,))).sum(0))
    assert torch.allclose(xs[1].grad, torch.stack([weight(r + 50, (3, 2)) for r in range(N())]).sum(0))


def test_allgather_gradient():
    rows = [r + 1 for r in range(N())]
    x = torch.randn(rows[R()], 3, dtype=torch.float64, requires_grad=True)
    out = hvd.allgather(x)
    total = sum(rows)
    (out * weight(R(), (total, 3))).sum().backward()
    offset = sum(rows[:R()])
    # Horovod: this rank's rows of the *averaged* gradient
    expect = torch.stack(weights((total, 3))).mean(0)[offset:offset + rows[R()]]
    assert torch.allclose(x.grad, expect)


@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_gradient(root):
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = hvd.broadcast(x, root)
    (out * weight(R(), (4,))).sum().backward()
    # Horovod: the averaged gradient on the root, zero on the other ranks
    expect = torch.stack(weights((4,))).mean(0) if R() == root else torch.zeros(4, dtype=torch.float64)
    assert torch.allclose(x.grad, expect)


def splits_of(rank):
    return [(rank + 2 * p) % 3 + 1 for p in range(N())]


def test_alltoall_gradient():
    x = torch.randn(sum(splits_of(R())), 2, dtype=torch.float64, requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits_of(R()))
    assert received.tolist() == [splits_of(s)[R()] for s in range(N())]
    recv_rows = [sum(splits_of(s)[p] for s in range(N())) for p in range(N())]
    (out * weight(R(), (recv_rows[R()], 2))).sum().backward()
    # the rows this rank sent to rank p come back from p's weight, at p's receive offset
    expect = []
    for p in range(N()):
        w_p = weight(p, (recv_rows[p], 2))
        offset = sum(splits_of(s)[p] for s in range(R()))
        expect.append(w_p[offset:offset + splits_of(R())[p]])
    assert torch.allclose(x.grad, torch.cat(expect))


def test_alltoall_gradient_without_splits():
    x = torch.randn(2 * N(), dtype=torch.float64, requires_grad=True)
    out = hvd.alltoall(x)
    (out * weight(R(), (2 * N(),))).sum().backward()
    expect = torch.cat([weight(p, (2 * N(),))[2 * R():2 * R() + 2] for p in range(N())])
    assert torch.allclose(x.grad, expect)


@pytest.mark.parametrize("op", ["Average", "Sum"])
def test_reducescatter_gradient(op):
    rows = 2 * N()
    x = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
    out = hvd.reducescatter(x, op=getattr(hvd, op))
    assert out.shape == (2, 3)
    (out * weight(R(), (2, 3))).sum().backward()
    expect = torch.cat(weights((2, 3)))  # every rank's share of the gradient, gathered
    if op == "Sum":
        # Horovod's convention (its test_torch.py checks it): scaled as an allreduce's
        # gradient would be, so Sum multiplies by the number of ranks and Average by 1
        expect = expect * N()
    assert torch.allclose(x.grad, expect)


def test_gradient_through_a_chain():
    """Collectives compose inside a graph: allgather then allreduce then a local op."""
    x = torch.full((2,), float(R() + 1), dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(hvd.allgather(x), op=hvd.Sum)
    (y ** 2).sum().backward()
    assert x.grad is not None and x.grad.shape == (2,)
    assert torch.isfinite(x.grad).all()


def test_no_grad_inputs_still_work():
    x = torch.ones(3)
    with torch.no_grad():
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((3,), float(N())))
