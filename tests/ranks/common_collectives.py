"""nbdist.common collectives on every rank (run under mpiexec -n 2 and -n 4 by test_common.py).

Every rank runs the same tests in the same order. Values are small integers so
results are exact for every dtype (float16 and bfloat16 included).
"""
import time

import numpy as np
import pytest

import nbdist.common as hvd
from nbdist.common.ops_base import BFLOAT16

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8]
if BFLOAT16 is not None:
    DTYPES.append(BFLOAT16)
SHAPES = [(0,), (5,), (3, 4), (2, 3, 2)]
DTYPE_IDS = [np.dtype(d).name for d in DTYPES]


def base(shape, dtype):
    """Small values 0..3 so sums and products fit even in uint8 with 4 ranks."""
    return (np.arange(int(np.prod(shape))) % 4).reshape(shape).astype(dtype)


def test_init_twice_and_topology():
    hvd.init()
    assert hvd.is_initialized()
    assert 0 <= RANK < SIZE
    assert 0 <= hvd.local_rank() < hvd.local_size() <= SIZE
    assert hvd.cross_size() * hvd.local_size() == SIZE
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert hvd.mpi_threads_supported()
    assert hvd.nccl_built() in (True, False)
    ranks = hvd.allgather_object(RANK)
    assert ranks == list(range(SIZE))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_allreduce_ops(dtype, shape):
    b = base(shape, dtype)
    x = b * np.asarray(RANK + 1, dtype=dtype) if np.dtype(dtype) != BFLOAT16 else (
        b.astype(np.float32) * (RANK + 1)).astype(dtype)
    factors = np.arange(1, SIZE + 1)
    wide = b.astype(np.float64)
    expected = {
        hvd.Sum: wide * factors.sum(),
        hvd.Min: wide * factors.min(),
        hvd.Max: wide * factors.max(),
        hvd.Product: wide ** SIZE * np.prod(factors),
    }
    for op, want in expected.items():
        if op == hvd.Product and np.dtype(dtype) in (np.dtype(np.uint8), np.dtype(np.int8)):
            want = np.where(wide > 1, np.nan, want)  # overflow: skip those entries
        got = hvd.allreduce(x, op=op, name=f"ar.{np.dtype(dtype).name}.{shape}.{int(op)}")
        assert got.dtype == np.dtype(dtype) and got.shape == shape
        mask = ~np.isnan(want)
        np.testing.assert_allclose(got.astype(np.float64)[mask], want[mask], rtol=1e-2)
    avg = hvd.allreduce(x, name=f"ar.avg.{np.dtype(dtype).name}.{shape}")
    if np.dtype(dtype).kind in "iu":
        want = np.trunc(wide * factors.sum() / SIZE)  # toward zero, as Horovod
    else:
        want = wide * factors.mean()
    np.testing.assert_allclose(avg.astype(np.float64), want, rtol=1e-2)
    # the input is never changed by the out-of-place form
    np.testing.assert_array_equal(x, b * np.asarray(RANK + 1, dtype=dtype) if np.dtype(
        dtype) != BFLOAT16 else (b.astype(np.float32) * (RANK + 1)).astype(dtype))


def test_zero_dim_arrays_keep_their_shape():
    scalar = np.array(RANK + 1.0, np.float32)
    assert hvd.allreduce(scalar, op=hvd.Sum, name="scalar.sum").shape == ()
    assert float(hvd.allreduce(scalar, op=hvd.Sum, name="scalar.sum2")) == SIZE * (SIZE + 1) / 2
    got = hvd.broadcast(scalar, root_rank=0, name="scalar.bcast")
    assert got.shape == () and float(got) == 1.0


def test_allreduce_inplace_and_scaling():
    x = np.full((4, 4), RANK + 1, np.float32)
    out = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    assert out is x
    np.testing.assert_array_equal(x, np.full((4, 4), SIZE * (SIZE + 1) / 2))
    y = np.ones(8, np.float64)
    got = hvd.allreduce(y, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    np.testing.assert_allclose(got, np.full(8, SIZE))
    got = hvd.allreduce(y, op=hvd.Average, postscale_factor=3.0, name="scaled.avg")
    np.testing.assert_allclose(got, np.full(8, 3.0))


def test_grouped_allreduce():
    arrays = [np.full(i + 1, RANK, np.float32) for i in range(5)]
    results = hvd.grouped_allreduce(arrays, op=hvd.Sum, name="group")
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, np.full(i + 1, SIZE * (SIZE - 1) / 2))


@pytest.mark.parametrize("dtype", DTYPES + [np.bool_], ids=DTYPE_IDS + ["bool"])
@pytest.mark.parametrize("inner", [(), (3,), (2, 2)], ids=str)
def test_allgather_varying_first_dim(dtype, inner):
    rows = RANK % 3  # 0 rows on some ranks
    x = np.full((rows,) + inner, RANK % 2, dtype)
    got = hvd.allgather(x, name=f"ag.{np.dtype(dtype).name}.{inner}")
    expected = np.concatenate([np.full((r % 3,) + inner, r % 2, dtype) for r in range(SIZE)])
    assert got.shape == expected.shape and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_broadcast_every_root(dtype, shape):
    for root in range(SIZE):
        x = (base(shape, np.float32) + RANK).astype(dtype)
        got = hvd.broadcast(x, root_rank=root, name=f"bc.{np.dtype(dtype).name}.{shape}.{root}")
        np.testing.assert_array_equal(got.astype(np.float64),
                                      (base(shape, np.float32) + root).astype(dtype).astype(np.float64))
        np.testing.assert_array_equal(x.astype(np.float64),
                                      (base(shape, np.float32) + RANK).astype(dtype).astype(np.float64))
    y = np.full(3, RANK, np.int64)
    assert hvd.broadcast_(y, root_rank=SIZE - 1, name="bc.inplace") is y
    np.testing.assert_array_equal(y, np.full(3, SIZE - 1))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.float16], ids=str)
def test_alltoall_with_splits(dtype):
    # rank r sends (p + r) % 3 rows to rank p; each row holds [r, p]
    splits = [(p + RANK) % 3 for p in range(SIZE)]
    rows = [np.array([[RANK, p]] * splits[p], dtype).reshape(-1, 2) for p in range(SIZE)]
    x = np.concatenate(rows)
    got, received = hvd.alltoall(x, splits=splits, name=f"a2a.{np.dtype(dtype).name}")
    want_splits = [(RANK + src) % 3 for src in range(SIZE)]
    assert list(received) == want_splits
    want = np.concatenate([np.array([[src, RANK]] * want_splits[src], dtype).reshape(-1, 2)
                           for src in range(SIZE)])
    np.testing.assert_array_equal(got, want)
    even, even_splits = hvd.alltoall(np.arange(2 * SIZE, dtype=dtype), name="a2a.even")
    assert list(even_splits) == [2] * SIZE
    np.testing.assert_array_equal(even, np.tile(np.arange(2 * RANK, 2 * RANK + 2), SIZE).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16], ids=str)
@pytest.mark.parametrize("rows", [1, SIZE, 2 * SIZE + 1])
def test_reducescatter(dtype, rows):
    x = np.full((rows, 3), RANK + 1, dtype)
    got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{np.dtype(dtype).name}.{rows}")
    base_rows, extra = divmod(rows, SIZE)
    assert got.shape == (base_rows + (1 if RANK < extra else 0), 3)
    np.testing.assert_array_equal(got, np.full(got.shape, SIZE * (SIZE + 1) // 2, dtype))
    avg = hvd.reducescatter(np.full((rows, 3), 2.0 * RANK, np.float32), name=f"rs.avg.{rows}")
    np.testing.assert_allclose(avg, np.full(avg.shape, SIZE - 1.0))


def test_objects():
    obj = hvd.broadcast_object({"from": RANK, "list": list(range(RANK + 1))}, root_rank=SIZE - 1)
    assert obj == {"from": SIZE - 1, "list": list(range(SIZE))}
    everyone = hvd.allgather_object({"rank": RANK, "pad": "x" * RANK * 100})
    assert [e["rank"] for e in everyone] == list(range(SIZE))
    assert hvd.broadcast_object(lambda v: v + 1, root_rank=0)(1) == 2  # cloudpickle


def test_async_poll_synchronize():
    handles = [hvd.allreduce_async(np.full(4, i, np.float32), op=hvd.Sum, name=f"async.{i}")
               for i in range(10)]
    results = [hvd.synchronize(h) for h in handles]
    assert all(hvd.poll(h) for h in handles)
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, np.full(4, i * SIZE))
    h = hvd.allgather_async(np.array([RANK]), name="async.gather")
    deadline = time.monotonic() + 30
    while not hvd.poll(h):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    np.testing.assert_array_equal(hvd.synchronize(h), np.arange(SIZE))
    with pytest.raises(TypeError):
        hvd.synchronize("not a handle")


def test_async_ops_nobody_synchronizes_still_run():
    # An async op above the express size rings the engine thread "soon" (ring_soon): it
    # leaves the op to a thread that drives it right away. Here none does (poll only), so
    # the engine thread must run it; and while this thread keeps driving synchronous ops,
    # an op submitted from a second thread and only waited on must run too (a ring left to
    # the driver is rung again when the driver lets go).
    import threading

    big = np.full(128 * 1024, RANK + 1, np.float32)  # 512 KiB: no express as submitted
    total = sum(r + 1 for r in range(SIZE))
    for _ in range(5):
        h = hvd.allreduce_async_(big, op=hvd.Sum, name="soon.poll")
        deadline = time.monotonic() + 30
        while not hvd.poll(h):
            assert time.monotonic() < deadline, "an async op nobody drove did not run"
            time.sleep(0.0005)
        np.testing.assert_array_equal(hvd.synchronize(h), np.full(big.shape, total))
        big[:] = RANK + 1
    results, errors = [], []

    def submit_and_wait():
        try:
            for step in range(20):
                a = np.full(128 * 1024, RANK + step, np.float32)
                handle = hvd.allreduce_async_(a, op=hvd.Sum, name="soon.thread")
                assert handle.wait(30), "an async op of a second thread did not run"
                results.append(handle.result()[0])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=submit_and_wait)
    thread.start()
    # (as many driving ops on every rank: until no rank's second thread is alive)
    while hvd.allreduce(np.array([thread.is_alive()], np.int32), op=hvd.Max, name="soon.driver")[0]:
        pass
    thread.join()
    assert not errors, errors
    assert results == [sum(r + step for r in range(SIZE)) for step in range(20)]
    hvd.barrier()


def test_different_submission_orders():
    names = [f"order.{i}" for i in range(20)]
    order = names if RANK % 2 == 0 else list(reversed(names))
    if RANK == 2:
        order = names[::2] + names[1::2]
    handles = {n: hvd.allreduce_async(np.full(3, int(n.split(".")[1]), np.int64), op=hvd.Sum,
                                      name=n) for n in order}
    for n, h in handles.items():
        np.testing.assert_array_equal(hvd.synchronize(h), np.full(3, int(n.split(".")[1]) * SIZE))
    # mixed kinds, in different orders
    ops = [lambda: hvd.allgather_async(np.array([RANK]), name="mix.gather"),
           lambda: hvd.broadcast_async(np.array([RANK]), 0, name="mix.bcast"),
           lambda: hvd.allreduce_async(np.array([1.0]), op=hvd.Sum, name="mix.reduce")]
    if RANK % 2:
        ops.reverse()
    hs = [f() for f in ops]
    values = sorted(hvd.synchronize(h).tolist() for h in hs)
    assert [0] in values and [float(SIZE)] in values and list(range(SIZE)) in values


def test_same_name_again_right_after_synchronize():
    """The next training step reuses the gradient's name the moment the last one is done."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # make thread switches (and the race) as likely as possible
    try:
        a = np.ones(8)
        for _ in range(1000):
            hvd.synchronize(hvd.allreduce_async_(a, op=hvd.Max, name="grad.w"))
    finally:
        sys.setswitchinterval(old)


def test_hundreds_of_small_ops_fused():
    engine = hvd.basics.engine()
    before = dict(engine.executor.stats)
    count = 300
    handles = [hvd.allreduce_async(np.full(7, i + RANK, np.float32), op=hvd.Sum,
                                   name=f"small.{i}") for i in range(count)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(hvd.synchronize(h),
                                      np.full(7, i * SIZE + SIZE * (SIZE - 1) / 2))
    ops = engine.executor.stats["allreduce_ops"] - before["allreduce_ops"]
    units = engine.executor.stats["allreduce_units"] - before["allreduce_units"]
    assert ops == count
    assert units < count / 4, f"{count} small allreduces ran as {units} units: no fusion"


@pytest.mark.parametrize("dtype,op", [(np.float32, hvd.Average), (np.float64, hvd.Sum),
                                      (np.float16, hvd.Average), (np.int32, hvd.Average)],
                         ids=["f32-avg", "f64-sum", "f16-avg", "i32-avg"])
def test_pieces_reduced_where_they_are(dtype, op):
    # A bucket of gradients: pieces of every size (a 1.5 MiB one makes the unit bigger
    # than a slot), reduced as one flat array. Where the transport scales natively (the
    # shm transport: float32/float64) the pieces hold the result and the handle says so;
    # else they are packed into `flat`, which holds it. Steps repeat (the cached op), and
    # a small op fused with the bucket keeps its own result.
    sizes = [3, 0, 1000, 3 * 2**17 + 1, 7]
    flat = np.full(sum(sizes), -1, dtype)
    transport = hvd.basics.engine().executor.choose("cpu", "allreduce")
    native = hasattr(transport, "allreduce_pieces") and dtype in (np.float32, np.float64)
    for step in range(3):
        pieces = [(np.arange(n) % 5 + RANK + step).astype(dtype) for n in sizes]
        want = [sum((np.arange(n) % 5 + r + step) for r in range(SIZE)) for n in sizes]
        if op == hvd.Average:
            want = [w / SIZE if dtype != np.int32 else w // SIZE for w in want]
        handle = hvd.ops.allreduce_pieces_async_(flat, pieces, op=op, name=f"pieces.{dtype.__name__}")
        small = hvd.allreduce_async(np.full(3, RANK, np.float32), op=hvd.Sum, name="beside.pieces")
        result = hvd.synchronize(handle)
        np.testing.assert_array_equal(hvd.synchronize(small), np.full(3, SIZE * (SIZE - 1) / 2))
        if native:
            assert result.__class__ is tuple and all(r is p for r, p in zip(result, pieces))
            got = pieces
        else:
            assert result is flat
            got = np.split(flat, np.cumsum(sizes)[:-1])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, np.asarray(w, dtype))


def test_pieces_that_do_not_add_up_are_refused():
    flat = np.zeros(10, np.float32)
    for pieces in ([np.zeros(9, np.float32)], [np.zeros(10, np.float64)],
                   [np.zeros((4, 5), np.float32)[:, :2]], [np.zeros(10, np.float32)[::-1]]):
        with pytest.raises(ValueError, match=f"rank {RANK}.*adding up to the 1-d flat array"):
            hvd.ops.allreduce_pieces_async_(flat, pieces, name="pieces.bad")


def test_steady_state_uses_response_cache():
    engine = hvd.basics.engine()
    for _step in range(3):
        hs = [hvd.allreduce_async(np.ones(5, np.float32), name=f"steady.{i}") for i in range(10)]
        [hvd.synchronize(h) for h in hs]
    cached = [n for n in engine._cache if n.startswith("steady.")]
    assert len(cached) == 10


def test_one_op_of_64_mib():
    n = 64 * 1024 * 1024 // 4
    x = np.full(n, RANK + 1, np.float32)
    got = hvd.allreduce(x, op=hvd.Sum, name="big")
    assert got[0] == got[-1] == got[n // 2] == SIZE * (SIZE + 1) / 2
    del got, x


def test_barrier_and_join():
    hvd.barrier()
    # rank r does r+1 allreduces, then joins: the others go on with zeros from it
    results = []
    for step in range(SIZE):
        if step <= RANK:
            results.append(hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum, name=f"join.{step}"))
    last = hvd.join()
    assert last == SIZE - 1
    for step, r in enumerate(results):
        np.testing.assert_array_equal(r, np.full(3, SIZE - step))
    hvd.barrier()


# -- errors: each followed by a working op ---------------------------------------------------
def works(tag):
    got = hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum, name=f"works.{tag}")
    np.testing.assert_array_equal(got, np.full(2, SIZE))


@pytest.mark.parametrize("case", ["shape", "dtype", "op", "kind", "ndim-gather", "scale"])
def test_mismatch_fails_on_every_rank(case):
    odd = RANK == SIZE - 1
    name = f"mismatch.{case}"
    with pytest.raises(hvd.MismatchError) as info:
        if case == "shape":
            hvd.allreduce(np.ones(3 + odd, np.float32), name=name)
        elif case == "dtype":
            hvd.allreduce(np.ones(3, np.float64 if odd else np.float32), name=name)
        elif case == "op":
            hvd.allreduce(np.ones(3), op=hvd.Max if odd else hvd.Sum, name=name)
        elif case == "kind":
            if odd:
                hvd.allgather(np.ones(3), name=name)
            else:
                hvd.allreduce(np.ones(3), name=name)
        elif case == "ndim-gather":
            hvd.allgather(np.ones((2, 2) if odd else (2,)), name=name)
        elif case == "scale":
            hvd.allreduce(np.ones(3), prescale_factor=2.0 if odd else 1.0, name=name)
    message = str(info.value)
    assert name in message and f"rank {SIZE - 1}" in message
    works(case)


def test_root_mismatch():
    with pytest.raises(hvd.MismatchError, match="root rank"):
        hvd.broadcast(np.ones(2), root_rank=RANK % 2, name="mismatch.root")
    works("root")


def test_name_in_flight_twice():
    # The others submit only after the barrier, so rank 0's first op cannot finish before its
    # second try: submitted together, it could (4 ranks on 2 cores), and the try was then legal.
    if RANK == 0:
        h = hvd.allreduce_async(np.ones(2), name="twice")
        with pytest.raises(ValueError, match="submitted twice"):
            hvd.allreduce_async(np.ones(2), name="twice")
    hvd.barrier()
    if RANK != 0:
        h = hvd.allreduce_async(np.ones(2), name="twice")
    # refused on the submitting rank only (Horovod): the op in flight completes
    assert hvd.synchronize(h).tolist() == [1.0, 1.0]
    works("twice")


@pytest.mark.parametrize("bad,error,match", [
    ([1.0, 2.0], TypeError, "Python list"),
    (np.array([object(), 1], dtype=object), TypeError, "dtype=object"),
    (np.ones(3, np.complex64), TypeError, "not supported"),
    ("text", TypeError, "buffer-protocol"),
])
def test_bad_input_fails_before_sending(bad, error, match):
    with pytest.raises(error, match=match):
        hvd.allreduce(bad, name="bad.input")
    works(f"bad.{type(bad).__name__}")


def test_bad_input_inplace_and_args():
    strided = np.ones((4, 4), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        hvd.allreduce_(strided, name="bad.strided")
    np.testing.assert_array_equal(hvd.allreduce(strided, op=hvd.Sum, name="ok.strided"),
                                  np.full((4, 2), SIZE))  # out of place copies it
    with pytest.raises(ValueError, match="out of range"):
        hvd.broadcast(np.ones(2), root_rank=SIZE, name="bad.root")
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(np.ones(5), splits=[5] + [1] * (SIZE - 1), name="bad.splits")
    with pytest.raises(TypeError, match="Adasum reduces floating-point"):
        hvd.allreduce(np.ones(2, np.int64), op=hvd.Adasum, name="bad.adasum")
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(np.ones(2, bool), name="bad.bool")
    works("args")


def test_abort_releases_peers():
    if RANK == SIZE - 1:
        time.sleep(0.2)
        hvd.abort(f"rank {RANK} raised ZeroDivisionError (test)")
    else:
        start = time.monotonic()
        with pytest.raises(hvd.AbortedError, match="ZeroDivisionError"):
            hvd.allreduce(np.ones(2), name="aborted.op")
        assert time.monotonic() - start < 10
    hvd.barrier()
    works("after.abort")


def test_concurrent_aborts_leave_the_next_op_working():
    h = hvd.allreduce_async(np.ones(2), name="aborted.together")
    hvd.abort(f"rank {RANK} interrupted (test)")  # every rank at once, as a notebook interrupt
    with pytest.raises(hvd.AbortedError):
        hvd.synchronize(h)
    # A rank may still be sending its abort while another already moved on: meet once
    # (retrying what a late abort fails), then nothing may fail any more.
    for attempt in range(SIZE + 1):
        try:
            hvd.allgather_object(attempt, name="meet")  # same name: a retry meets a peer's first try
            break
        except hvd.AbortedError:
            continue
    else:
        pytest.fail("could not meet after concurrent aborts")
    for i in range(3):
        works(f"after.concurrent.{i}")


def test_shutdown_and_init_again():
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="init"):
        hvd.rank()
    hvd.init()
    assert hvd.size() == SIZE
    works("reinit")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
def test_repeated_synchronous_allreduces_keep_horovods_results(dtype, inplace):
    # The steady state of a training loop: one cached op queued at a time. On one node its
    # vote and its bytes run in one native call (float32/float64 scaled there too); integer
    # and float16 Average are finished in Python. Results and inputs must not tell.
    engine = hvd.basics.engine()
    ran_before = engine.agreement.stats["ran_with_vote"] if engine.agreement else 0
    for step in range(6):
        x = np.full((3, 5), RANK + 1 + step, dtype)
        before = x.copy()
        if inplace:
            out = hvd.allreduce_(x, name=f"steady.{np.dtype(dtype).name}.in")
            assert out is x
        else:
            out = hvd.allreduce(x, name=f"steady.{np.dtype(dtype).name}")
            np.testing.assert_array_equal(x, before)
        total = sum(r + 1 + step for r in range(SIZE))
        want = np.full((3, 5), total, dtype)
        want = want // SIZE if want.dtype.kind in "iu" else (want / SIZE).astype(dtype)
        assert out.dtype == np.dtype(dtype) and out.shape == (3, 5)
        np.testing.assert_array_equal(out, want)
    if engine.agreement is not None and SIZE > 1 and np.dtype(dtype).char in "fd":
        assert engine.agreement.stats["ran_with_vote"] > ran_before


def test_ranks_that_run_an_op_with_the_vote_meet_ranks_that_cannot():
    # Rank 0 has a second op queued, so its cycle goes through Python; the others vote and
    # run "mix.x" in one native call. Every rank must still run the same allreduce.
    x = np.full(8, RANK + 1, np.float32)
    y = np.full(4, 10.0 * (RANK + 1), np.float64)
    total = SIZE * (SIZE + 1) // 2
    for _step in range(10):
        if RANK == 0:
            hy = hvd.allreduce_async(y, op=hvd.Sum, name="mix.y")
            rx = hvd.allreduce(x, op=hvd.Sum, name="mix.x")
            ry = hvd.synchronize(hy)
        else:
            rx = hvd.allreduce(x, op=hvd.Sum, name="mix.x")
            ry = hvd.allreduce(y, op=hvd.Sum, name="mix.y")
        np.testing.assert_array_equal(rx, np.full(8, total, np.float32))
        np.testing.assert_array_equal(ry, np.full(4, 10.0 * total))


def _express_count() -> int:
    agreement = hvd.basics.engine().agreement
    return agreement.stats["express"] if agreement is not None else 0


def _express_ran_since(before: int) -> bool:
    """True when some rank ran an op on the express path since `before` (its own count).

    Summed over the ranks: a rank that always arrives first falls back to the queued path
    and may never count one itself (4 ranks on 2 cores); the last to arrive does."""
    ran = hvd.allreduce(np.array([_express_count() - before]), op=hvd.Sum)
    return int(ran[0]) > 0


def test_repeated_sync_allreduces_run_in_the_calling_thread():
    # A synchronous allreduce of a name the response cache knows runs in one native call of
    # the calling thread on one node (Engine.express_allreduce): no queue, no handle.
    before = _express_count()
    for step in range(20):
        x = np.full(16, RANK + step, np.float32)
        got = hvd.allreduce(x, op=hvd.Sum, name="express.sum")
        total = sum(r + step for r in range(SIZE))
        np.testing.assert_array_equal(got, np.full(16, total, np.float32))
        y = np.full(4, float(RANK))
        assert hvd.allreduce_(y, name="express.average") is y
        np.testing.assert_allclose(y, np.full(4, (SIZE - 1) / 2))
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        assert _express_ran_since(before)


def test_cached_sync_allreduce_waits_as_usual_for_a_late_peer():
    # The last rank comes later than the express path waits: the others' ops are queued as
    # usual and complete when it arrives.
    hvd.allreduce(np.ones(2, np.float32), name="late.x")  # cached from now on
    for step in range(3):
        if RANK == SIZE - 1:
            time.sleep(0.05)
        got = hvd.allreduce(np.full(2, RANK + step, np.float32), op=hvd.Sum, name="late.x")
        np.testing.assert_array_equal(got, np.full(2, sum(r + step for r in range(SIZE))))


def test_cached_sync_allreduce_meets_a_peer_with_a_new_op():
    # Rank 0 queues a new op (items in the vote) before the cached one; the others' cached
    # op then finds those items in its vote, and every rank runs both ops.
    x = np.full(3, RANK + 1.0)
    total = SIZE * (SIZE + 1) / 2
    hvd.allreduce(x, op=hvd.Sum, name="items.cached")
    for step in range(5):
        new = np.full(2, 1.0)
        if RANK == 0:
            handle = hvd.allreduce_async(new, op=hvd.Sum, name=f"items.new.{step}")
            got = hvd.allreduce(x, op=hvd.Sum, name="items.cached")
            summed = hvd.synchronize(handle)
        else:
            got = hvd.allreduce(x, op=hvd.Sum, name="items.cached")
            summed = hvd.allreduce(new, op=hvd.Sum, name=f"items.new.{step}")
        assert got.tolist() == [total] * 3
        assert summed.tolist() == [float(SIZE)] * 2


def test_arguments_the_cached_plan_does_not_cover_take_the_python_path():
    # After a name's plan is in the native express table, a call it does not cover (another
    # op, dtype, shape or postscale; a strided or read-only array; a process set) is checked
    # and run as before: right results, the same clear errors.
    x = np.full(6, RANK + 1.0)
    total = SIZE * (SIZE + 1) / 2
    for _ in range(3):
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, name="plan.x"), total)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Max, name="plan.max"), SIZE)
    np.testing.assert_array_equal(
        hvd.allreduce(x, op=hvd.Sum, name="plan.x", postscale_factor=2.0), 2 * total)
    np.testing.assert_array_equal(
        hvd.allreduce(x.astype(np.float32), op=hvd.Sum, name="plan.f32"), total)
    np.testing.assert_array_equal(
        hvd.allreduce(np.full(12, RANK + 1.0)[::2], op=hvd.Sum, name="plan.strided"), total)
    np.testing.assert_array_equal(
        hvd.allreduce(x, op=hvd.Sum, name="plan.x", process_set=hvd.global_process_set), total)
    frozen = x.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        hvd.allreduce_(frozen, op=hvd.Sum, name="plan.x")
    with pytest.raises(TypeError, match="Python list"):
        hvd.allreduce_([1.0, 2.0], op=hvd.Sum, name="plan.x")
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, name="plan.x"), total)


def test_unnamed_ops_keep_one_numbering_when_ranks_take_different_paths():
    # Rank 0 has another op in flight, so its unnamed allreduce goes through Python, while
    # the others' run in the native table: every rank must still number them alike.
    x = np.full(5, RANK + 1.0)
    total = SIZE * (SIZE + 1) / 2
    for _ in range(3):
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum), total)
    for step in range(6):
        if RANK == 0 and step % 2:
            handle = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name=f"numbering.{step}")
            got = hvd.allreduce(x, op=hvd.Sum)
            other = hvd.synchronize(handle)
        else:
            got = hvd.allreduce(x, op=hvd.Sum)
            other = (hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"numbering.{step}")
                     if step % 2 else np.full(2, float(SIZE)))
        np.testing.assert_array_equal(got, total)
        np.testing.assert_array_equal(other, float(SIZE))
    engine = hvd.basics.engine()
    counters = hvd.allgather_object(engine.auto_name_counter)
    assert len(set(counters)) == 1, counters


def test_small_async_allreduces_of_cached_names_run_as_submitted():
    # A step of small named async allreduces (a DistributedOptimizer without buckets): once
    # the names are cached, each runs as it is submitted when every rank is there (the
    # express path), else it waits as a queued op; the results are the same either way.
    before = _express_count()
    for step in range(20):
        xs = [np.full(8, RANK + step + i, np.float32) for i in range(4)]
        handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"async.small.{i}")
                   for i, x in enumerate(xs)]
        src = np.full(3, float(RANK))
        averaged = hvd.allreduce_async(src, name="async.small.average")
        unnamed = hvd.allreduce_async(np.full(2, RANK + step), op=hvd.Sum)
        for i, (handle, x) in enumerate(zip(handles, xs)):
            assert hvd.synchronize(handle) is x
            np.testing.assert_array_equal(x, np.full(8, sum(r + step + i for r in range(SIZE))))
        got = hvd.synchronize(averaged)
        assert got is not src
        np.testing.assert_allclose(got, np.full(3, (SIZE - 1) / 2))
        np.testing.assert_array_equal(src, np.full(3, float(RANK)))  # input untouched
        np.testing.assert_array_equal(hvd.synchronize(unnamed),
                                      np.full(2, sum(r + step for r in range(SIZE))))
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        assert _express_ran_since(before)


def test_small_async_allgathers_and_broadcasts_of_cached_names_run_as_submitted():
    # The same for allgather and both broadcasts (TensorFlow's graph ops submit this way):
    # results, in place and out of place, as through the queue; inputs untouched.
    before = _express_count()
    root = SIZE - 1
    for step in range(15):
        rows = np.full((RANK + 1, 2), RANK * 10 + step, np.int32)
        gathered = hvd.allgather_async(rows, name="async.gather")
        unnamed = hvd.allgather_async(np.array([RANK + step], np.float32))
        src = np.full(4, RANK * 100.0 + step)
        sent = hvd.broadcast_async(src, root, name="async.bcast")
        y = np.full(3, RANK + step, np.int64)
        sent_ = hvd.broadcast_async_(y, 0, name="async.bcast_")
        want = np.concatenate([np.full((r + 1, 2), r * 10 + step, np.int32) for r in range(SIZE)])
        np.testing.assert_array_equal(hvd.synchronize(gathered), want)
        np.testing.assert_array_equal(hvd.synchronize(unnamed),
                                      np.arange(SIZE, dtype=np.float32) + step)
        got = hvd.synchronize(sent)
        assert got is not src
        np.testing.assert_array_equal(got, np.full(4, root * 100.0 + step))
        np.testing.assert_array_equal(src, np.full(4, RANK * 100.0 + step))
        assert hvd.synchronize(sent_) is y
        np.testing.assert_array_equal(y, np.full(3, step, np.int64))
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        assert _express_ran_since(before)


def test_small_async_ops_do_not_wait_for_a_late_peer():
    # Running as it is submitted is only for when every rank is there: a submit whose peer
    # is late returns at once (the op waits as a queued one), as Horovod's async ops do.
    for _ in range(3):
        hvd.allreduce(np.ones(2), name="async.late")
        hvd.allgather(np.ones(2), name="async.late.gather")
        hvd.broadcast(np.ones(2), 0, name="async.late.bcast")
    if RANK == SIZE - 1:
        time.sleep(1.0)
    start = time.monotonic()
    reduced = hvd.allreduce_async(np.full(2, RANK + 1.0), op=hvd.Sum, name="async.late")
    gathered = hvd.allgather_async(np.full(2, float(RANK)), name="async.late.gather")
    sent = hvd.broadcast_async(np.full(2, float(RANK)), 0, name="async.late.bcast")
    submitted = time.monotonic() - start
    np.testing.assert_array_equal(hvd.synchronize(reduced), np.full(2, SIZE * (SIZE + 1) / 2))
    np.testing.assert_array_equal(hvd.synchronize(gathered),
                                  np.repeat(np.arange(SIZE, dtype=np.float64), 2))
    np.testing.assert_array_equal(hvd.synchronize(sent), np.zeros(2))
    if RANK != SIZE - 1:
        assert submitted < 0.5, f"async submits waited {submitted:.2f} s for a late peer"


def test_changed_shape_under_a_cached_name_is_a_mismatch_async():
    for _ in range(3):
        hvd.synchronize(hvd.allreduce_async(np.ones(4), name="reshape.async"))
    shape = (5,) if RANK == 0 else (4,)
    with pytest.raises(hvd.MismatchError, match="reshape.async"):
        hvd.synchronize(hvd.allreduce_async(np.ones(shape), name="reshape.async"))
    got = hvd.synchronize(hvd.allreduce_async(np.ones(4), op=hvd.Sum, name="reshape.async"))
    np.testing.assert_array_equal(got, np.full(4, float(SIZE)))


def test_changed_shape_under_a_cached_name_is_a_mismatch():
    for _ in range(2):
        hvd.allreduce(np.ones(4), name="reshape.x")
    shape = (5,) if RANK == 0 else (4,)
    with pytest.raises(hvd.MismatchError, match="reshape.x"):
        hvd.allreduce(np.ones(shape), name="reshape.x")
    got = hvd.allreduce(np.ones(4), op=hvd.Sum, name="reshape.x")
    np.testing.assert_array_equal(got, np.full(4, float(SIZE)))


def test_repeated_sync_allgathers_run_in_the_calling_thread():
    # allgather's express path: rows differ per rank; the result is a new array each time
    # (earlier results keep their values).
    before = _express_count()
    results = []
    for step in range(12):
        x = np.full((RANK + 1, 3), RANK * 10 + step, np.int32)
        got = hvd.allgather(x, name="express.gather")
        want = np.concatenate([np.full((r + 1, 3), r * 10 + step, np.int32) for r in range(SIZE)])
        np.testing.assert_array_equal(got, want)
        results.append((got, want))
    for got, want in results:
        np.testing.assert_array_equal(got, want)
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        assert _express_ran_since(before)


def test_big_allgather_and_broadcast_results_are_whole():
    # Parts of 4 MiB and more: each rank's own part (and a broadcast root's own result) is
    # copied with streaming stores while the peers read theirs; repeated, so the later
    # calls run carried by the vote. Odd sizes leave an unaligned tail; every byte checked.
    def part(rank, step, extra):
        rng = np.random.default_rng((rank, step, extra))
        return rng.integers(0, 256, (4 << 20) + 13 + rank * extra, dtype=np.uint8)

    for step in range(3):
        got = hvd.allgather(part(RANK, step, 1), name="big.gather")
        np.testing.assert_array_equal(got, np.concatenate([part(r, step, 1) for r in range(SIZE)]))
        root = step % SIZE
        y = part(RANK, step, 0)
        out = hvd.broadcast(y, root_rank=root, name="big.broadcast")
        assert out is not y
        np.testing.assert_array_equal(out, part(root, step, 0))
        np.testing.assert_array_equal(y, part(RANK, step, 0))


def test_cached_sync_allgather_waits_as_usual_for_a_late_peer():
    hvd.allgather(np.ones(2, np.float32), name="late.gather")
    for step in range(3):
        if RANK == 0:
            time.sleep(0.05)
        got = hvd.allgather(np.full(2, RANK + step, np.float32), name="late.gather")
        want = np.repeat(np.arange(SIZE, dtype=np.float32) + step, 2)
        np.testing.assert_array_equal(got, want)


def test_cached_sync_broadcast_waits_as_usual_for_a_late_peer():
    # (from the third call on, the waiting ranks' op starts in the native table, which
    # hands it back to Python when the peer is late: ops._resume)
    for step in range(4):
        if RANK == SIZE - 1:
            time.sleep(0.05)
        y = np.full(3, RANK + step, np.int32)
        assert hvd.broadcast_(y, 0, name="late.bcast_") is y
        np.testing.assert_array_equal(y, np.full(3, step, np.int32))
        got = hvd.broadcast(np.full(3, RANK + step, np.int32), 0, name="late.bcast")
        np.testing.assert_array_equal(got, np.full(3, step, np.int32))


def test_repeated_sync_broadcasts_run_in_the_calling_thread():
    before = _express_count()
    root = SIZE - 1
    for step in range(10):
        x = np.full(5, RANK * 100.0 + step)
        got = hvd.broadcast(x, root, name="express.broadcast")
        np.testing.assert_array_equal(got, np.full(5, root * 100.0 + step))
        np.testing.assert_array_equal(x, np.full(5, RANK * 100.0 + step))  # input untouched
        y = np.full((2, 3), RANK + step, np.int64)
        assert hvd.broadcast_(y, 0, name="express.broadcast_") is y
        np.testing.assert_array_equal(y, np.full((2, 3), step, np.int64))
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        assert _express_ran_since(before)


def test_a_late_peer_costs_the_waiting_ranks_no_second_result_array():
    # An express op that a late peer makes wait (handed back by the native table, or
    # waiting in Python) keeps the result array it made: the executor writes the result
    # there. A second one would leave the buffer pool short, and the next call would fault
    # fresh memory in. Counted by the pool: one array per call of 1 MiB or more.
    from nbdist.common import buffers

    n = buffers.POOL_MIN_BYTES // 4
    calls = {
        "allreduce": lambda step: (hvd.allreduce(np.full(n, RANK + step, np.float32),
                                                 op=hvd.Sum, name="late.pool.ar"),
                                   np.full(n, sum(range(SIZE)) + SIZE * step, np.float32)),
        "allgather": lambda step: (hvd.allgather(np.full(n, RANK + step, np.float32),
                                                 name="late.pool.ag"),
                                   np.repeat(np.arange(SIZE, dtype=np.float32) + step, n)),
        "broadcast": lambda step: (hvd.broadcast(np.full(n, RANK + step, np.float32),
                                                 SIZE - 1, name="late.pool.bc"),
                                   np.full(n, SIZE - 1 + step, np.float32)),
    }
    for kind, call in calls.items():
        results = []
        for step in range(5):
            if RANK == 0 and step >= 2:
                time.sleep(0.05)
            before = buffers.pool_stats()
            got, want = call(step)
            after = buffers.pool_stats()
            taken = after["hits"] + after["misses"] - before["hits"] - before["misses"]
            assert taken == 1, f"{kind} call {step} on rank {RANK} took {taken} arrays"
            np.testing.assert_array_equal(got, want)
            results.append((got, want))
        for got, want in results:  # each call's result is its own
            np.testing.assert_array_equal(got, want)


def _table_runs() -> tuple[int, int]:
    """(allgathers and broadcasts, allreduces) the native express table ran on this rank."""
    agreement = hvd.basics.engine().agreement
    if agreement is None:
        return 0, 0
    table = agreement.express_table
    return table.runs - table.allreduce_runs, table.allreduce_runs


def test_cached_allgathers_and_broadcasts_run_in_the_native_table():
    # After the first calls, a cached synchronous allgather or broadcast (named or not) is
    # checked and run in one native call (native/express_table.cpp), with the same results;
    # the executor's stats count them as units, not as allreduces.
    stats = hvd.basics.engine().executor.stats
    before, allreduces = _table_runs()
    for step in range(12):
        rows = hvd.allgather(np.full((RANK + 1, 2), RANK * 10 + step, np.int16), name="table.g")
        want = np.concatenate([np.full((r + 1, 2), r * 10 + step, np.int16)
                               for r in range(SIZE)])
        np.testing.assert_array_equal(rows, want)
        assert rows.dtype == np.int16 and rows.flags.writeable
        unnamed = hvd.allgather(np.array([RANK + step], np.float32))
        np.testing.assert_array_equal(unnamed, np.arange(SIZE, dtype=np.float32) + step)
        x = np.full(3, RANK + 10.0 * step)
        got = hvd.broadcast(x, SIZE - 1, name="table.b")
        np.testing.assert_array_equal(got, np.full(3, SIZE - 1 + 10.0 * step))
        np.testing.assert_array_equal(x, np.full(3, RANK + 10.0 * step))  # input untouched
        assert got is not x
        y = np.full(4, RANK + step, np.uint8)
        assert hvd.broadcast_(y, 0, name="table.b_") is y
        np.testing.assert_array_equal(y, np.full(4, step, np.uint8))
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        ran, reduced = _table_runs()
        total = hvd.allreduce(np.array([ran - before]), op=hvd.Sum, name="table.count")
        assert int(total[0]) > 0  # (a rank that always comes first may never run one itself)
        assert reduced == allreduces  # none of them counted as an allreduce
        after = hvd.basics.engine().executor.stats
        assert after["units"] - stats["units"] >= ran - before


@pytest.mark.parametrize("carried", [True, False], ids=["vote-carries", "own-syncs"])
def test_single_copy_ops_of_cached_names(carried):
    # From the CMA thresholds up, a cached allreduce, allgather or broadcast is read straight
    # from its owner's buffer; the agreement's vote carries the addresses (default) or the
    # op syncs on its own segment after it (an allreduce then goes through the slots).
    # Either way: every root, uneven parts and slices, in place and out of place, inputs
    # untouched, each result its own array.
    engine = hvd.basics.engine()
    if engine.agreement is None or SIZE == 1:
        pytest.skip("no shm agreement here")
    data = engine.transports.for_op("cpu", "allgather")
    if data.single_copy_bytes == (0, 0, 0):
        pytest.skip("single-copy transfers (process_vm_readv) are not allowed here")
    hvd.barrier()
    thresholds, tuned = data.single_copy_bytes, data.tuned_paths
    # every op below single-copy, at any rank count (those above what travels in the vote
    # itself), not left to the path tuner
    data.set_single_copy((1, 1, 1))
    engine.agreement.native.set_vote_carries(carried)
    try:
        results = []
        for dtype, op, n in [(np.float32, hvd.Sum, 100_003), (np.float64, hvd.Average, 20_000),
                             (np.int32, hvd.Max, 70_001), (np.float16, hvd.Sum, 65_537)]:
            base = (np.arange(n) % 7).astype(dtype)
            for step in range(3):
                x = base + RANK + step
                want = {hvd.Sum: sum(base + r + step for r in range(SIZE)),
                        hvd.Average: base + (SIZE - 1) / 2 + step,
                        hvd.Max: base + SIZE - 1 + step}[op]
                got = hvd.allreduce(x, op=op, name=f"cma.ar.{np.dtype(dtype).name}")
                np.testing.assert_allclose(got, want, rtol=1e-6)
                np.testing.assert_array_equal(x, base + RANK + step)
                assert hvd.allreduce_(x, op=op, name=f"cma.ar_.{np.dtype(dtype).name}") is x
                np.testing.assert_allclose(x, want, rtol=1e-6)
                results.append((got, want))
        for step in range(6):
            rows = 300 + 7 * RANK
            x = np.full((rows, 9), RANK * 100 + step, np.float32)
            got = hvd.allgather(x, name="cma.gather")
            want = np.concatenate([np.full((300 + 7 * r, 9), r * 100 + step, np.float32)
                                   for r in range(SIZE)])
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(x, np.full((rows, 9), RANK * 100 + step, np.float32))
            results.append((got, want))
            for root in range(SIZE):
                b = np.full(5000, RANK * 10.0 + step)
                out = hvd.broadcast(b, root, name=f"cma.bcast.{root}")
                np.testing.assert_array_equal(out, np.full(5000, root * 10.0 + step))
                np.testing.assert_array_equal(b, np.full(5000, RANK * 10.0 + step))
                assert hvd.broadcast_(b, root, name=f"cma.bcast_.{root}") is b
                np.testing.assert_array_equal(b, np.full(5000, root * 10.0 + step))
        for got, want in results:
            np.testing.assert_array_equal(got, want)
    finally:
        hvd.barrier()
        engine.agreement.native.set_vote_carries(True)
        data.set_single_copy(thresholds, tuned)


def test_allgather_and_broadcast_calls_the_cached_plan_does_not_cover():
    # After a name's allgather or broadcast plan is in the native table, a call it does not
    # cover (another root, dtype or shape; a numpy integer root; a 0-d array; a list; a
    # read-only array in place; a process set) is checked and run as before, with the same
    # clear errors.
    for _ in range(3):
        hvd.broadcast(np.full(2, float(RANK)), 0, name="cover.b")
        hvd.allgather(np.full(2, RANK, np.int64), name="cover.g")
    np.testing.assert_array_equal(hvd.broadcast(np.full(2, float(RANK)), SIZE - 1,
                                                name="cover.b"), float(SIZE - 1))
    np.testing.assert_array_equal(hvd.broadcast(np.full(2, float(RANK)), np.int64(0),
                                                name="cover.b"), 0.0)
    np.testing.assert_array_equal(hvd.broadcast(np.full(3, float(RANK)), 0, name="cover.b3"),
                                  0.0)
    frozen = np.full(2, float(RANK))
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        hvd.broadcast_(frozen, 0, name="cover.b")
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(np.full(2, float(RANK)), SIZE, name="cover.b")
    np.testing.assert_array_equal(hvd.allgather(np.array(RANK, np.int64), name="cover.g0"),
                                  np.arange(SIZE))
    with pytest.raises(TypeError, match="Python list"):
        hvd.allgather([RANK, RANK], name="cover.g")
    np.testing.assert_array_equal(
        hvd.allgather(np.full(2, RANK, np.int64), name="cover.g",
                      process_set=hvd.global_process_set), np.repeat(np.arange(SIZE), 2))
    np.testing.assert_array_equal(hvd.allgather(np.full(2, RANK, np.int64), name="cover.g"),
                                  np.repeat(np.arange(SIZE), 2))
    np.testing.assert_array_equal(hvd.broadcast(np.full(2, float(RANK)), 0, name="cover.b"), 0.0)


def test_repeated_unnamed_sync_ops_run_in_the_calling_thread():
    # Unnamed ops are matched by the order in which each rank submits them; once one of a
    # signature has been agreed, the next ones take the express path too (a template).
    before = _express_count()
    for step in range(20):
        got = hvd.allreduce(np.full(8, RANK + step, np.float32), op=hvd.Sum)
        np.testing.assert_array_equal(got, np.full(8, sum(r + step for r in range(SIZE))))
        rows = hvd.allgather(np.full((1, 2), RANK * 10 + step, np.int64))
        np.testing.assert_array_equal(rows[:, 0], np.arange(SIZE) * 10 + step)
        sent = hvd.broadcast(np.full(3, RANK + step, np.float64), 0)
        np.testing.assert_array_equal(sent, np.full(3, float(step)))
    if hvd.basics.engine().agreement is not None and SIZE > 1:
        assert _express_ran_since(before)


def test_unnamed_ops_pair_by_order_when_ranks_take_different_paths():
    # Rank 0 has an unnamed op in flight when it submits the next one; the others submit the
    # same two ops one at a time (synchronously). Whichever way each rank sends an op (the
    # template's bit or in full), the i-th unnamed op of every rank meets the i-th of the
    # others, with no stall.
    for _ in range(2):
        hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum)  # the template of this signature
    for step in range(6):
        first = np.full(4, RANK + step, np.float32)
        second = np.full(4, 10.0 * (RANK + 1), np.float32)
        start = time.monotonic()
        if RANK == 0:
            handle = hvd.allreduce_async(first, op=hvd.Sum)
            got_second = hvd.allreduce(second, op=hvd.Sum)
            got_first = hvd.synchronize(handle)
        else:
            if step % 2:
                time.sleep(0.01)
            got_first = hvd.allreduce(first, op=hvd.Sum)
            got_second = hvd.allreduce(second, op=hvd.Sum)
        np.testing.assert_array_equal(got_first, np.full(4, sum(r + step for r in range(SIZE))))
        np.testing.assert_array_equal(got_second, np.full(4, 10.0 * SIZE * (SIZE + 1) / 2))
        # (a bit left waiting for a peer that sent the op in full would wait DEMOTE_S)
        assert time.monotonic() - start < 0.2


def test_unnamed_shape_mismatch_after_a_template_fails_on_every_rank():
    for _ in range(2):
        hvd.allreduce(np.ones(6))
    shape = (7,) if RANK == SIZE - 1 else (6,)
    with pytest.raises(hvd.MismatchError, match="allreduce.noname"):
        hvd.allreduce(np.ones(shape))
    got = hvd.allreduce(np.ones(6), op=hvd.Sum)
    np.testing.assert_array_equal(got, np.full(6, float(SIZE)))
