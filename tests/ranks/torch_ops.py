"""nbdist.torch collectives on N ranks (run by tests/test_torch.py under mpiexec).

Every rank runs every test in the same order. Each rank builds the inputs of all
ranks deterministically, so it can compute the expected result itself.
"""
import time

import pytest
import torch

import nbdist.torch as hvd

from _torch_setup import N, R, runtime  # noqa: F401 (the autouse fixture starts nbdist)

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
DIMS = [1, 2, 3]


def shape_of(dims, first=3):
    return (first,) + (2,) * (dims - 1)


def value(rank, shape, dtype, low=0, high=5):
    """Rank `rank`'s input: small integers (exact in every dtype, no int8 overflow at 4 ranks)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def all_values(shape, dtype, **kw):
    return [value(r, shape, dtype, **kw) for r in range(N())]


def check_fresh(result, tensor, before):
    """The input is unchanged and the result shares no memory with it."""
    assert torch.equal(tensor, before), "out-of-place op changed its input"
    if result.numel() and tensor.numel():
        assert result.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()


# ------------------------------------------------------------------ allreduce

@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("dims", DIMS)
def test_allreduce_sum_min_max(dtype, dims):
    shape = shape_of(dims)
    xs = all_values(shape, dtype)
    x = xs[R()]
    before = x.clone()
    stacked = torch.stack([v.double() for v in xs])
    for op, expect in ((hvd.Sum, stacked.sum(0)), (hvd.Min, stacked.min(0).values),
                       (hvd.Max, stacked.max(0).values)):
        out = hvd.allreduce(x, op=op, name=f"ar.{op.name}.{dtype}.{dims}")
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out.double(), expect), (op, out, expect)
        check_fresh(out, x, before)


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_allreduce_average_and_product(dtype):
    xs = all_values((4, 3), dtype, low=1, high=3)  # 1..2: products stay small
    x = xs[R()]
    stacked = torch.stack([v.double() for v in xs])
    avg = hvd.allreduce(x)  # op defaults to Average
    expect = stacked.sum(0) / N()
    if not dtype.is_floating_point:
        expect = torch.trunc(expect)  # integer Average rounds toward zero (Horovod)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-9
    assert torch.allclose(avg.double(), expect, atol=tol)
    prod = hvd.allreduce(x, op=hvd.Product)
    assert torch.equal(prod.double(), stacked.prod(0))


def test_allreduce_scalar_and_empty():
    s = torch.tensor(float(R() + 1))
    out = hvd.allreduce(s, op=hvd.Sum)
    assert out.shape == () and out.item() == N() * (N() + 1) / 2
    e = torch.empty(0, 3)
    assert hvd.allreduce(e).shape == (0, 3)


def test_allreduce_deprecated_average_argument():
    x = torch.full((3,), float(R()))
    with pytest.warns(DeprecationWarning):
        summed = hvd.allreduce(x, average=False)
    assert torch.all(summed == sum(range(N())))
    with pytest.warns(DeprecationWarning):
        averaged = hvd.allreduce(x, average=True)
    assert torch.allclose(averaged, torch.full((3,), sum(range(N())) / N()))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_allreduce_scale_factors():
    x = torch.full((5,), float(R() + 1))
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.allclose(out, torch.full((5,), float(sum(range(1, N() + 1)))))
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0)
    assert torch.allclose(out, torch.full((5,), 3.0 * sum(range(1, N() + 1))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_allreduce_inplace_matches_out_of_place(dtype):
    x = value(R(), (6, 4), dtype)
    expect = hvd.allreduce(x, op=hvd.Sum)
    y = x.clone()
    ptr = y.data_ptr()
    ret = hvd.allreduce_(y, op=hvd.Sum)
    assert ret is y and y.data_ptr() == ptr and torch.equal(y, expect)
    z = x.clone()
    h = hvd.allreduce_async_(z, op=hvd.Sum)
    assert hvd.synchronize(h) is z and torch.equal(z, expect)


def test_repeated_allreduces_of_a_tensor_run_in_the_express_table():
    # A plain CPU tensor's repeated allreduce goes straight to nbdist.common's native
    # express table; a strided view, a tensor that records its gradient, another dtype
    # under the same name go the checked way. Every result must be right either way.
    from nbdist.common import basics

    agreement = basics.engine().agreement
    before = agreement.stats["express"] if agreement is not None else 0
    total = sum(range(1, N() + 1))
    for step in range(8):
        t = torch.full((4, 3), float(R() + 1 + step))
        want = torch.full((4, 3), float(total + N() * step))
        assert torch.equal(hvd.allreduce(t, op=hvd.Sum, name="torch.express"), want)
        assert hvd.allreduce_(t, op=hvd.Sum, name="torch.express_") is t and torch.equal(t, want)
        assert torch.equal(hvd.allreduce(torch.full((4, 3), float(R() + 1 + step)),
                                         op=hvd.Sum), want)
    strided = torch.full((3, 4), float(R() + 1)).t()
    assert torch.equal(hvd.allreduce(strided, op=hvd.Sum, name="torch.express"),
                       torch.full((4, 3), float(total)))
    graded = torch.full((4, 3), float(R() + 1), requires_grad=True)
    out = hvd.allreduce(graded, op=hvd.Sum, name="torch.express")
    out.sum().backward()
    assert torch.equal(out.detach(), torch.full((4, 3), float(total)))
    assert torch.equal(graded.grad, torch.full((4, 3), float(N())))
    doubles = torch.full((4, 3), float(R() + 1), dtype=torch.float64)
    assert torch.equal(hvd.allreduce(doubles, op=hvd.Sum, name="torch.express.f64"),
                       torch.full((4, 3), float(total), dtype=torch.float64))
    if agreement is not None and N() > 1:
        ran = hvd.allreduce(torch.tensor([agreement.stats["express"] - before]), op=hvd.Sum)
        assert int(ran.item()) > 0


def test_small_async_allreduces_of_a_tensor_run_as_submitted():
    # A DistributedOptimizer without buckets: small named async allreduces, the same each
    # step. Once cached, each may run as it is submitted (nbdist.common's express path); the
    # handles and results are Horovod's either way: synchronize() of the in-place form
    # returns the tensor itself, the out-of-place form a new tensor and the input unchanged.
    from nbdist.common import basics

    agreement = basics.engine().agreement
    before = agreement.stats["express"] if agreement is not None else 0
    total = sum(range(1, N() + 1))
    for step in range(10):
        grads = [torch.full((5, 2), float(R() + 1 + step + i)) for i in range(3)]
        handles = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"torch.async.{i}")
                   for i, g in enumerate(grads)]
        src = torch.full((3,), float(R() + 1))
        averaged = hvd.allreduce_async(src, name="torch.async.average")
        for i, (handle, g) in enumerate(zip(handles, grads)):
            assert hvd.poll(handle) in (True, False)
            assert hvd.synchronize(handle) is g
            assert torch.equal(g, torch.full((5, 2), float(total + N() * (step + i))))
        got = hvd.synchronize(averaged)
        assert got is not src and torch.allclose(got, torch.full((3,), total / N()))
        assert torch.equal(src, torch.full((3,), float(R() + 1)))
    if agreement is not None and N() > 1:
        ran = hvd.allreduce(torch.tensor([agreement.stats["express"] - before]), op=hvd.Sum)
        assert int(ran.item()) > 0


def test_non_contiguous_inputs():
    base = value(R(), (4, 6), torch.float32)
    t = base.t()  # a strided view
    assert not t.is_contiguous()
    expect = torch.stack(all_values((4, 6), torch.float32)).sum(0).t()
    before = base.clone()
    out = hvd.allreduce(t, op=hvd.Sum)
    assert torch.equal(out, expect) and torch.equal(base, before)
    # in place into a strided view: the result lands in the view (and so in its base)
    hvd.allreduce_(t, op=hvd.Sum)
    assert torch.equal(t, expect) and torch.equal(base, expect.t())
    sliced = value(R(), (6, 4), torch.float64)[::2]
    assert torch.equal(hvd.allgather(sliced), torch.cat([v[::2] for v in all_values((6, 4), torch.float64)]))
    b = value(R(), (3, 5), torch.int64)[:, 1:4]
    hvd.broadcast_(b, 0)
    assert torch.equal(b, value(0, (3, 5), torch.int64)[:, 1:4])


def test_bool_reduction_is_refused_but_gather_works():
    flags = torch.tensor([R() % 2 == 0, True])
    with pytest.raises(TypeError):
        hvd.allreduce(flags)
    gathered = hvd.allgather(flags)
    assert gathered.dtype == torch.bool and gathered.shape == (2 * N(),)
    assert torch.equal(hvd.broadcast(flags, 0), torch.tensor([True, True]))


def test_grouped_allreduce_all_forms():
    shapes = [(3,), (2, 2), (1, 4, 2)]
    xs = [value(R(), s, torch.float32) for s in shapes]
    expect = [torch.stack([value(r, s, torch.float32) for r in range(N())]).sum(0) for s in shapes]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    assert all(torch.equal(o, e) for o, e in zip(outs, expect))
    outs = hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum, name="grp"))
    assert all(torch.equal(o, e) for o, e in zip(outs, expect))
    assert all(torch.equal(x, value(R(), s, torch.float32)) for x, s in zip(xs, shapes))
    ys = [x.clone() for x in xs]
    ret = hvd.grouped_allreduce_(ys, op=hvd.Sum)
    assert all(a is b for a, b in zip(ret, ys))
    assert all(torch.equal(y, e) for y, e in zip(ys, expect))
    zs = [x.clone() for x in xs]
    hvd.synchronize(hvd.grouped_allreduce_async_(zs, op=hvd.Sum))
    assert all(torch.equal(z, e) for z, e in zip(zs, expect))
    avg = hvd.grouped_allreduce(xs)
    assert all(torch.allclose(a, e / N()) for a, e in zip(avg, expect))


def test_fp16_compression():
    x = torch.linspace(-1, 1, 50, dtype=torch.float32) * (R() + 1)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    expect = torch.linspace(-1, 1, 50) * sum(range(1, N() + 1))
    assert torch.allclose(out, expect, atol=1e-2)
    ints = torch.arange(4) + R()
    assert hvd.allreduce(ints, op=hvd.Sum, compression=hvd.Compression.fp16).dtype == torch.int64
    compressed, ctx = hvd.Compression.fp16.compress(x)
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, ctx).dtype == torch.float32
    outs = hvd.grouped_allreduce([x, x.double()], op=hvd.Sum, compression=hvd.Compression.fp16)
    assert outs[0].dtype == torch.float32 and outs[1].dtype == torch.float64


# ------------------------------------------------------------------ allgather

@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
@pytest.mark.parametrize("dims", DIMS)
def test_allgather_varying_first_dimension(dtype, dims):
    shapes = [shape_of(dims, first=r + 1) for r in range(N())]
    xs = [value(r, shapes[r], dtype, high=2 if dtype == torch.bool else 5) for r in range(N())]
    x = xs[R()]
    before = x.clone()
    out = hvd.allgather(x)
    assert out.dtype == dtype
    assert torch.equal(out, torch.cat(xs))
    check_fresh(out, x, before)
    out = hvd.synchronize(hvd.allgather_async(x, name=f"ag.{dtype}.{dims}"))
    assert torch.equal(out, torch.cat(xs))


def test_allgather_empty_rank():
    x = torch.ones(0 if R() == 0 else 2, 3)
    assert hvd.allgather(x).shape == (2 * (N() - 1), 3)


def test_grouped_allgather():
    xs = [torch.full((R() + 1,), float(R())), torch.full((2, 2), R())]
    a, b = hvd.grouped_allgather(xs)
    assert a.shape == (N() * (N() + 1) // 2,) and b.shape == (2 * N(), 2)


# ------------------------------------------------------------------ broadcast

@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
@pytest.mark.parametrize("dims", DIMS)
def test_broadcast_every_root(dtype, dims):
    shape = shape_of(dims)
    for root in range(N()):
        x = value(R(), shape, dtype, high=2 if dtype == torch.bool else 5)
        before = x.clone()
        out = hvd.broadcast(x, root)
        assert out.dtype == dtype and torch.equal(out, value(root, shape, dtype, high=2 if dtype == torch.bool else 5))
        check_fresh(out, x, before)
        y = x.clone()
        assert hvd.broadcast_(y, root) is y and torch.equal(y, out)
        z = x.clone()
        hvd.synchronize(hvd.broadcast_async_(z, root, name=f"bc.{dtype}.{dims}.{root}"))
        assert torch.equal(z, out)
        assert torch.equal(hvd.synchronize(hvd.broadcast_async(x, root)), out)


def test_broadcast_bad_root():
    with pytest.raises(ValueError, match="out of range"):
        hvd.broadcast(torch.ones(2), N())


# ------------------------------------------------------------------ alltoall

def splits_of(rank):
    """Rank `rank` sends (rank + p) % 3 rows to rank p (some zero)."""
    return [(rank + p) % 3 for p in range(N())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("dims", DIMS)
def test_alltoall_with_splits(dtype, dims):
    rows = [sum(splits_of(r)) for r in range(N())]
    xs = [value(r, shape_of(dims, first=rows[r]), dtype) for r in range(N())]
    x = xs[R()]
    before = x.clone()
    out, received_splits = hvd.alltoall(x, splits=splits_of(R()))
    expect, expect_splits = [], []
    for src in range(N()):
        offset = sum(splits_of(src)[:R()])
        count = splits_of(src)[R()]
        expect.append(xs[src][offset:offset + count])
        expect_splits.append(count)
    assert torch.equal(out, torch.cat(expect))
    assert received_splits.dtype == torch.int32 and received_splits.tolist() == expect_splits
    check_fresh(out, x, before)
    out2, rs2 = hvd.synchronize(hvd.alltoall_async(x, splits=torch.tensor(splits_of(R()))))
    assert torch.equal(out2, out) and torch.equal(rs2, received_splits)


def test_alltoall_equal_parts_returns_tensor_only():
    x = torch.arange(2 * N(), dtype=torch.float32) + 100 * R()
    out = hvd.alltoall(x)
    assert isinstance(out, torch.Tensor)
    expect = torch.cat([torch.arange(2 * R(), 2 * R() + 2, dtype=torch.float32) + 100 * s
                        for s in range(N())])
    assert torch.equal(out, expect)


def test_alltoall_bad_splits():
    with pytest.raises(ValueError):
        hvd.alltoall(torch.ones(3), splits=[1] * (N() + 1))


# ------------------------------------------------------------------ reducescatter

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32])
@pytest.mark.parametrize("dims", DIMS)
def test_reducescatter(dtype, dims):
    rows = 2 * N() + 1  # uneven: the first rank gets one row more
    xs = all_values(shape_of(dims, first=rows), dtype)
    total = torch.stack([v.double() for v in xs]).sum(0)
    share, extra = divmod(rows, N())
    start = R() * share + min(R(), extra)
    count = share + (1 if R() < extra else 0)
    out = hvd.reducescatter(xs[R()], op=hvd.Sum)
    assert out.dtype == dtype and torch.equal(out.double(), total[start:start + count])
    if dtype.is_floating_point:
        avg = hvd.reducescatter(xs[R()])
        assert torch.allclose(avg.double(), total[start:start + count] / N(), atol=1e-2)


def test_reducescatter_refuses_min():
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.ones(4), op=hvd.Min)


# ------------------------------------------------------------------ async, ordering, errors

def test_async_poll_and_synchronize():
    xs = [torch.full((1000,), float(R() + i)) for i in range(8)]
    handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"async.{i}") for i, x in enumerate(xs)]
    deadline = time.time() + 30
    while not all(hvd.poll(h) for h in handles):
        assert time.time() < deadline, "async allreduces never completed"
        time.sleep(0.001)
    for i, h in enumerate(handles):
        assert hvd.poll(h)
        out = hvd.synchronize(h)
        assert torch.all(out == sum(range(N())) + N() * i)
    assert hvd.synchronize(handles[0]) is not None  # a second synchronize is harmless


def test_different_submission_orders():
    names = [f"order.{i}" for i in range(6)]
    order = names if R() % 2 == 0 else list(reversed(names))
    handles = {n: hvd.allreduce_async(torch.full((3,), float(int(n[-1]) + R())), op=hvd.Sum,
                                      name=n) for n in order}
    for n in names:
        assert torch.all(hvd.synchronize(handles[n]) == N() * int(n[-1]) + sum(range(N())))
    # mixed kinds in mixed orders
    ops = [lambda: hvd.allgather_async(torch.ones(1) * R(), name="mix.ag"),
           lambda: hvd.broadcast_async(torch.ones(2) * R(), 0, name="mix.bc"),
           lambda: hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="mix.ar")]
    if R() % 2:
        ops.reverse()
    hs = [f() for f in ops]
    results = {h.inner.name: hvd.synchronize(h) for h in hs}
    assert torch.equal(results["mix.ag"], torch.arange(N(), dtype=torch.float32))
    assert torch.equal(results["mix.bc"], torch.zeros(2))
    assert torch.equal(results["mix.ar"], torch.full((2,), float(N())))


def test_name_in_flight_twice_is_an_error():
    x = torch.ones(3)
    if R() == 0:
        # the first op cannot finish before the others submit it, so it is surely in flight
        first = hvd.allreduce_async(x, name="twice")
        with pytest.raises(ValueError, match="twice"):
            hvd.allreduce_async(x, name="twice")
    # rank 0 (the coordinator) has taken the refusal in before this barrier completes
    hvd.barrier()
    if R() != 0:
        first = hvd.allreduce_async(x, name="twice")
    # refused on the submitting rank only (Horovod): the op in flight completes everywhere
    assert torch.equal(hvd.synchronize(first), x)
    assert torch.all(hvd.allreduce(x, op=hvd.Sum, name="after.twice") == N())


@pytest.mark.parametrize("kind", ["shape", "dtype", "op", "root", "kind"])
def test_mismatch_fails_on_every_rank_then_recovers(kind):
    name = f"mismatch.{kind}"
    with pytest.raises(hvd.MismatchError):
        if kind == "shape":
            hvd.allreduce(torch.ones(2 + R()), name=name)
        elif kind == "dtype":
            hvd.allreduce(torch.ones(2, dtype=torch.float32 if R() == 0 else torch.float64), name=name)
        elif kind == "op":
            hvd.allreduce(torch.ones(2), op=hvd.Sum if R() == 0 else hvd.Max, name=name)
        elif kind == "root":
            hvd.broadcast(torch.ones(2), root_rank=0 if R() == 0 else 1, name=name)
        else:
            if R() == 0:
                hvd.allreduce(torch.ones(2), name=name)
            else:
                hvd.allgather(torch.ones(2), name=name)
    assert torch.all(hvd.allreduce(torch.ones(4), op=hvd.Sum, name=f"{name}.after") == N())


def test_bad_inputs_fail_before_sending():
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(TypeError, match="complex"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="Adasum reduces floating-point"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))
    assert torch.all(hvd.allreduce(torch.ones(2), process_set=hvd.global_process_set) == 1)


def test_join_and_barrier():
    for i in range(R() + 1):  # rank r has r + 1 batches; joined ranks contribute zeros
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"join.step.{i}")
    assert hvd.join() == N() - 1
    hvd.barrier()


def test_basics():
    assert hvd.is_initialized() and 0 <= R() < N()
    assert 0 <= hvd.local_rank() < hvd.local_size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.mpi_built() and isinstance(hvd.nccl_built(), bool)
    assert hvd.HorovodInternalError is hvd.CollectiveError
