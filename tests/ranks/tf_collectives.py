"""nbdist.tensorflow collectives x dtypes, eager and in tf.function, and their gradients."""
import contextlib

import numpy as np
import pytest

from _tf_setup import hvd, tf

R, N = hvd.rank(), hvd.size()
MODES = ["eager", "function"]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
INTS = [tf.int8, tf.uint8, tf.int32, tf.int64]
ALL = FLOATS + INTS + [tf.bool]


def run(mode, fn, *args):
    """fn(*args) eagerly, or traced into a fresh tf.function."""
    if mode == "eager":
        return fn(*args)
    return tf.function(fn)(*args)


def base(dtype, shape=(2, 3)):
    """A rank-dependent tensor: rank r holds (r+1) * [0, 1, 2, ...] (bool: alternating)."""
    values = np.arange(np.prod(shape)).reshape(shape) % 5
    if dtype == tf.bool:
        return tf.constant((values + R) % 2 == 0)
    return tf.cast(tf.constant(values * (R + 1)), dtype)


def as_np(t):
    return np.asarray(t.numpy(), dtype=np.float64) if t.dtype != tf.bool else t.numpy()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=lambda d: d.name)
def test_allreduce_sum_min_max(mode, dtype):
    x = base(dtype)
    out = run(mode, lambda t: (hvd.allreduce(t, op=hvd.Sum, name="ar.sum"),
                               hvd.allreduce(t, op=hvd.Min, name="ar.min"),
                               hvd.allreduce(t, op=hvd.Max, name="ar.max")), x)
    ref = np.arange(6).reshape(2, 3) % 5
    total = N * (N + 1) // 2
    if dtype in (tf.int8, tf.uint8):
        expect_sum = (ref * total).astype(dtype.as_numpy_dtype).astype(np.float64)  # wraps
    else:
        expect_sum = ref * total
    assert all(o.dtype == dtype and o.shape == x.shape for o in out)
    tol = 0.1 * N if dtype in (tf.float16, tf.bfloat16) else 1e-6
    np.testing.assert_allclose(as_np(out[0]), expect_sum, atol=tol * ref.max() * total / N)
    np.testing.assert_allclose(as_np(out[1]), ref * 1.0)
    np.testing.assert_allclose(as_np(out[2]), ref * N, rtol=1e-2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_allreduce_average_and_scaling(mode, dtype):
    x = base(dtype)
    out = run(mode, lambda t: (hvd.allreduce(t), hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5,
                                                              postscale_factor=2.0, name="scaled")),
              x)
    ref = np.arange(6).reshape(2, 3) % 5
    np.testing.assert_allclose(as_np(out[0]), ref * (N + 1) / 2, rtol=2e-2)
    np.testing.assert_allclose(as_np(out[1]), ref * N * (N + 1) / 2, rtol=2e-2)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_scalar_variable_and_fp16_compression(mode):
    v = tf.Variable(float(R + 1))
    out = run(mode, lambda: (hvd.allreduce(v, op=hvd.Sum, name="scalar"),
                             hvd.allreduce(tf.fill([4], float(R)), compression=hvd.Compression.fp16,
                                           name="fp16")))
    assert out[0].shape == () and float(out[0]) == N * (N + 1) / 2
    assert out[1].dtype == tf.float32
    np.testing.assert_allclose(out[1].numpy(), np.full(4, (N - 1) / 2))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_mixed_dtypes(mode):
    xs = [base(tf.float32), base(tf.float64, (4,)), base(tf.int32, (1, 2))]
    out = run(mode, lambda *t: hvd.grouped_allreduce(list(t), op=hvd.Sum, name="group"), *xs)
    total = N * (N + 1) / 2
    for x, o in zip(xs, out):
        assert o.dtype == x.dtype and o.shape == x.shape
        np.testing.assert_allclose(as_np(o), as_np(x) / (R + 1) * total)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ALL, ids=lambda d: d.name)
def test_allgather_uneven_rows(mode, dtype):
    x = base(dtype, (R + 1, 2))  # rank r contributes r+1 rows
    out = run(mode, lambda t: hvd.allgather(t, name="gather"), x)
    assert out.dtype == dtype and out.shape == (N * (N + 1) // 2, 2)
    if mode == "function":
        pass
    gathered = as_np(out)
    start = R * (R + 1) // 2
    np.testing.assert_array_equal(gathered[start:start + R + 1], as_np(x))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ALL, ids=lambda d: d.name)
def test_broadcast_from_each_root(mode, dtype):
    for root in range(N):
        x = base(dtype)
        out = run(mode, lambda t, root=root: hvd.broadcast(t, root, name=f"bcast.{root}"), x)
        values = np.arange(6).reshape(2, 3) % 5
        expect = (values + root) % 2 == 0 if dtype == tf.bool else values * (root + 1)
        np.testing.assert_array_equal(as_np(out), np.asarray(expect, dtype=as_np(out).dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float32, tf.int64, tf.bfloat16, tf.bool], ids=lambda d: d.name)
def test_alltoall_with_and_without_splits(mode, dtype):
    x = base(dtype, (2 * N, 3))
    even = run(mode, lambda t: hvd.alltoall(t, name="a2a.even"), x)
    assert even.shape == (2 * N, 3)
    # Uneven: rank r sends p+1 rows to rank p.
    rows = sum(p + 1 for p in range(N))
    y = tf.cast(tf.fill([rows, 1], R), tf.int32)
    splits = tf.constant([p + 1 for p in range(N)], tf.int32)
    out, received = run(mode, lambda t, s: hvd.alltoall(t, splits=s, name="a2a.uneven"), y, splits)
    assert received.numpy().tolist() == [R + 1] * N
    np.testing.assert_array_equal(out.numpy()[:, 0], np.repeat(np.arange(N), R + 1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32], ids=lambda d: d.name)
def test_reducescatter(mode, dtype):
    x = tf.cast(tf.reshape(tf.range(2 * N * 2), (2 * N, 2)), dtype) * (R + 1)
    out = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, name="rs"), x)
    assert out.shape == (2, 2)
    full = np.arange(2 * N * 2).reshape(2 * N, 2) * (N * (N + 1) // 2)
    np.testing.assert_allclose(as_np(out), full[2 * R:2 * R + 2])


def test_collective_errors_name_the_problem():
    # (op=Adasum works: tf_process_sets.py)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(tf.ones(2), op=hvd.Sum, average=True)
    # A shape that differs between ranks: a clear error on every rank, no hang.
    with pytest.raises(hvd.NbdistError):
        hvd.allreduce(tf.ones([R + 1]), name="bad.shape")


def test_eager_ops_outside_a_tape_take_the_synchronous_path():
    # Eagerly with no GradientTape, allreduce/allgather/broadcast skip tf.custom_gradient
    # and run through nbdist.common's synchronous forms: a repeated op (named or not)
    # then runs at once in this thread (the express path).
    from nbdist.common import basics

    agreement = basics.engine().agreement
    before = agreement.stats["express"] if agreement is not None else 0
    for step in range(10):
        x = tf.fill([4], float(R + step))
        want = sum(r + step for r in range(N))
        np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, name="eager.x").numpy(), want)
        np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum).numpy(), want)
        np.testing.assert_allclose(hvd.allgather(tf.fill([1, 2], float(R))).numpy()[:, 0],
                                   np.arange(N))
        np.testing.assert_allclose(hvd.broadcast(x, 0).numpy(), float(step))
    if agreement is not None and N > 1:
        ran = hvd.allreduce(tf.constant([agreement.stats["express"] - before]), op=hvd.Sum)
        assert int(ran.numpy()[0]) > 0


def test_eager_results_live_where_tf_would_place_them():
    # An eager result is placed as tf.constant would place it (the default device, or
    # the tf.device scope's), and it owns its bytes: changing the input later leaves it.
    x = tf.Variable(tf.fill([8], float(R)))
    for scope in (None, "/CPU:0"):
        with tf.device(scope) if scope else contextlib.nullcontext():
            out = hvd.allreduce(x, op=hvd.Sum, name=f"placed.{scope}")
            assert out.device == tf.constant(1.0).device
        x.assign_add(tf.ones([8]))
        np.testing.assert_allclose(out.numpy(), sum(range(N)))
        x.assign(tf.fill([8], float(R)))


# -- gradients -------------------------------------------------------------------------------
def grad_of(mode, loss_fn, x):
    def g(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = loss_fn(x)
        return tape.gradient(loss, x)
    return run(mode, g, x)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_gradients(mode):
    x = tf.fill([3], float(R + 1))
    w = float(R + 1)  # a per-rank weight on the output
    avg = grad_of(mode, lambda t: tf.reduce_sum(hvd.allreduce(t, name="g.avg") * w), x)
    total = grad_of(mode, lambda t: tf.reduce_sum(hvd.allreduce(t, op=hvd.Sum, name="g.sum") * w), x)
    mean_w = (N + 1) / 2
    np.testing.assert_allclose(avg.numpy(), np.full(3, mean_w))   # allreduce(Average) of w
    np.testing.assert_allclose(total.numpy(), np.full(3, mean_w * N))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_gradients(mode):
    xs = [tf.ones([2]), tf.ones([3], tf.float64)]

    def g(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="g.group")
            loss = tf.reduce_sum(ya) + tf.cast(tf.reduce_sum(yb), tf.float32)
        return tape.gradient(loss, [a, b])
    ga, gb = run(mode, g, *xs)
    np.testing.assert_allclose(ga.numpy(), np.full(2, N))
    np.testing.assert_allclose(gb.numpy(), np.full(3, N))


@pytest.mark.parametrize("mode", MODES)
def test_allgather_gradient_is_this_ranks_rows(mode):
    x = tf.ones([R + 1, 2])
    total = N * (N + 1) // 2
    c = tf.reshape(tf.range(total * 2, dtype=tf.float32), (total, 2))
    grad = grad_of(mode, lambda t: tf.reduce_sum(hvd.allgather(t, name="g.gather") * c), x)
    start = R * (R + 1) // 2
    np.testing.assert_allclose(grad.numpy(), c.numpy()[start:start + R + 1])


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_gradient_reaches_the_root_only(mode):
    x = tf.ones([2])
    grad = grad_of(mode, lambda t: tf.reduce_sum(hvd.broadcast(t, 0, name="g.bcast") * 3.0), x)
    np.testing.assert_allclose(grad.numpy(), np.full(2, 3.0 if R == 0 else 0.0))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_gradient_goes_back_to_the_sender(mode):
    x = tf.ones([2 * N, 1])
    splits = tf.constant([2] * N, tf.int32)
    grad = grad_of(mode, lambda t: tf.reduce_sum(
        hvd.alltoall(t, splits=splits, name="g.a2a")[0] * float(R + 1)), x)
    # The two rows sent to rank p come back weighted by p + 1.
    np.testing.assert_allclose(grad.numpy()[:, 0], np.repeat(np.arange(1, N + 1), 2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gradient(mode, op):
    x = tf.ones([2 * N, 2])
    grad = grad_of(mode, lambda t: tf.reduce_sum(
        hvd.reducescatter(t, op=getattr(hvd, op), name=f"g.rs.{op}")), x)
    np.testing.assert_allclose(grad.numpy(), np.full((2 * N, 2), N if op == "Sum" else 1.0))


def test_objects():
    assert hvd.broadcast_object({"r": R}, root_rank=N - 1) == {"r": N - 1}
    assert hvd.allgather_object(R * 10) == [r * 10 for r in range(N)]
