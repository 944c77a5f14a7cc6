"""Behaviours Horovod's own test_tensorflow.py checks, pinned in our words (under mpiexec).

Each was once wrong in nbdist: the error types TF code catches, IndexedSlices averages
of integer values, the TF graph ops and helpers Horovod code calls, grouped ops and the
broadcast gradient inside a graph.
"""
import numpy as np
import pytest

from _tf_setup import hvd, tf

R, N = hvd.rank(), hvd.size()
MODES = ["eager", "function"]


def run(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


@pytest.mark.parametrize("mode", MODES)
def test_mismatch_is_a_failed_precondition(mode):
    if N == 1:
        pytest.skip("needs two ranks")
    x = tf.ones([3], dtype=tf.int32 if R % 2 == 0 else tf.float32)
    # eagerly TF's FailedPreconditionError, as Horovod's op raises; in a graph TensorFlow
    # reports any error of a Python op as UnknownError, with our message
    expected = tf.errors.FailedPreconditionError if mode == "eager" else tf.errors.OpError
    with pytest.raises(expected, match="ranks disagree on dtype"):
        run(mode, lambda t: hvd.allreduce(t, name=f"compat.mismatch.{mode}"), x)
    if mode == "eager":  # our own class too, so either except clause catches it
        with pytest.raises(hvd.MismatchError):
            hvd.broadcast(tf.ones([2 + R]), 0, name="compat.mismatch.bcast")


def test_bad_input_is_an_invalid_argument_eagerly():
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits"):
        hvd.alltoall(tf.ones([N + 1]), splits=tf.constant([N + 2] + [0] * (N - 1)))
    with pytest.raises(ValueError):  # and still a ValueError
        hvd.alltoall(tf.ones([N + 1]), splits=tf.constant([N + 2] + [0] * (N - 1)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.uint8, tf.int32, tf.float32])
def test_indexed_slices_average_divides_like_tensorflow(mode, dtype):
    values = tf.cast(tf.fill([2, 3], 3), dtype)
    slices = tf.IndexedSlices(values, tf.constant([R, R + 1]), dense_shape=tf.constant([N + 1, 3]))
    out = run(mode, lambda: hvd.allreduce(slices, op=hvd.Average, name=f"compat.is.{mode}"))
    # uint8 3 / 2 is 1.5 in TensorFlow's division, not a uint8 0 or 1
    assert out.values.shape == (2 * N, 3)
    np.testing.assert_allclose(np.asarray(out.values, np.float64), 3.0 / N)
    with pytest.raises(NotImplementedError):
        hvd.allreduce(slices, op=hvd.Sum, prescale_factor=2.0)
    with pytest.raises(NotImplementedError):
        hvd.grouped_allreduce([slices, slices], op=hvd.Max)


def test_grouped_allreduce_of_mixed_slices_and_tensors():
    x = tf.fill([4], float(R + 1))
    slices = tf.IndexedSlices(tf.ones([1, 4]) * (R + 1), tf.constant([R]), tf.constant([N, 4]))
    sparse, dense = hvd.grouped_allreduce([slices, x], op=hvd.Average)
    mean = (N + 1) / 2
    np.testing.assert_allclose(dense.numpy(), mean)
    np.testing.assert_allclose(tf.math.unsorted_segment_sum(sparse.values, sparse.indices, N),
                               [[(r + 1) / N] * 4 for r in range(N)])


def test_topology_ops():
    assert int(hvd.rank_op()) == R and int(hvd.size_op()) == N
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.local_size_op()) == hvd.local_size()
    traced = tf.function(lambda: hvd.rank_op() * 10 + hvd.size_op())()
    assert int(traced) == R * 10 + N


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather_and_reducescatter(mode):
    xs = [tf.fill([R + 1, 2], float(R)) for _ in range(3)]
    gathered = run(mode, lambda *t: hvd.grouped_allgather(list(t), name=f"compat.gag.{mode}"), *xs)
    want = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(N)])
    for g in gathered:
        np.testing.assert_array_equal(g.numpy(), want)
    ys = [tf.ones([2 * N, 3]) * (i + 1) for i in range(2)]
    scattered = run(mode, lambda *t: hvd.grouped_reducescatter(
        list(t), op=hvd.Sum, name=f"compat.grs.{mode}", postscale_factor=0.5), *ys)
    for i, s in enumerate(scattered):
        np.testing.assert_allclose(s.numpy(), np.full((2, 3), (i + 1) * N * 0.5))


def test_grouped_reducescatter_gradient_is_horovods():
    xs = [tf.Variable(tf.ones([2 * N, 2])) for _ in range(2)]
    with tf.GradientTape() as tape:
        outs = hvd.grouped_reducescatter(xs, op=hvd.Sum)
        loss = tf.add_n([tf.reduce_sum(o) for o in outs])
    for g in tape.gradient(loss, xs):
        np.testing.assert_allclose(g.numpy(), float(N))


def test_broadcast_gradient_in_a_graph_runs_on_every_rank():
    # in a graph, the non-root rank's zero gradient must still take part in the allreduce
    x = tf.Variable(tf.ones([3]) * R)

    @tf.function
    def grad_of_broadcast():
        with tf.GradientTape() as tape:
            y = hvd.broadcast(x, 0, name="compat.bcast.grad")
        return tape.gradient(y, x)

    np.testing.assert_array_equal(grad_of_broadcast().numpy(), np.full(3, 1.0 if R == 0 else 0.0))


def test_broadcast_object_fn_and_alltoall_with_empty_parts():
    fn = hvd.broadcast_object_fn(root_rank=0, name="compat.bof")
    assert fn({"r": R}) == {"r": 0}
    # rank 0 sends nothing; the others send one row to every rank
    rows = 0 if R == 0 else N
    x = tf.reshape(tf.range(rows * 2, dtype=tf.float32), [rows, 2]) + 100 * R
    splits = tf.constant([0 if R == 0 else 1] * N)
    out, received = hvd.alltoall(x, splits, name="compat.a2a.empty")
    assert received.numpy().tolist() == [0] + [1] * (N - 1)
    assert out.shape == (N - 1, 2)


def test_partial_distributed_gradient_tape_keeps_local_layers_local():
    """Keras 3 variables: the local layer's gradient is this rank's, divided by size()."""
    import keras

    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(R + 1.0),
                               use_bias=False)
    head = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    x = tf.ones([1, 2])
    with tf.GradientTape(persistent=True) as plain:
        loss = tf.reduce_sum(head(dense(x)))
    own = plain.gradient(loss, [dense.kernel, head.kernel])
    tape = hvd.PartialDistributedGradientTape(plain, local_layers=[dense])
    local_grad, head_grad = tape.gradient(loss, [dense.kernel, head.kernel])
    np.testing.assert_allclose(local_grad.numpy(), own[0].numpy() / N)
    mean_head = np.mean([2.0 * (r + 1) for r in range(N)])  # d loss / d head = sum of dense out
    np.testing.assert_allclose(head_grad.numpy(), [[mean_head]])
    local, shared = tape.get_local_and_global_gradients(loss, [dense.kernel, head.kernel])
    assert len(local) == 1 and len(shared) == 1


@pytest.mark.parametrize("mode", MODES)
def test_sync_batch_normalization_uses_the_global_batch(mode):
    import keras

    batches = [np.random.default_rng(r).normal(size=(3 + r, 2, 4)).astype(np.float32)
               for r in range(N)]
    sync_bn = hvd.SyncBatchNormalization(axis=-1, name=f"sbn_{mode}")
    plain = keras.layers.BatchNormalization(axis=-1)
    out = run(mode, lambda t: sync_bn(t, training=True), tf.constant(batches[R]))
    everything = plain(tf.constant(np.concatenate(batches)), training=True)
    start = sum(3 + r for r in range(R))
    np.testing.assert_allclose(out.numpy(), everything.numpy()[start:start + 3 + R],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("average", [False, True])
def test_backward_passes_per_step_reduces_once_per_n_passes(mode, average):
    """Keras 3: N passes accumulate on each rank; the Nth applies their reduced sum (or mean)."""
    import keras
    import nbdist.keras as hvd_keras

    v = keras.Variable([0.0])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                         average_aggregated_gradients=average,
                                         name=f"bpps.{mode}.{average}")
    opt.build([v])
    step = lambda: opt.apply_gradients([(tf.constant([float(R + 1)]), v)])  # noqa: E731
    step = step if mode == "eager" else tf.function(step)
    step()
    assert v.numpy().tolist() == [0.0]  # the first pass only accumulates
    step()
    mean = np.mean([r + 1.0 for r in range(N)])  # the ranks' gradient, averaged
    np.testing.assert_allclose(v.numpy(), [-(1 if average else 2) * mean])
    built = keras.optimizers.SGD(1.0)
    built.build([v])
    with pytest.raises(ValueError, match="not been built"):
        hvd_keras.DistributedOptimizer(built, backward_passes_per_step=2)


def test_partial_distributed_optimizer_keeps_local_layers_local():
    import keras
    import nbdist.keras as hvd_keras

    local = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(R + 1.0),
                               use_bias=False)
    head = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    x = tf.ones([1, 2])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(head(local(x)))
    grads = tape.gradient(loss, [local.kernel, head.kernel])
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    before = local.kernel.numpy().copy()
    opt.apply_gradients(zip(grads, [local.kernel, head.kernel]))
    # the local layer stepped with its own gradient / size(); the head with the average
    np.testing.assert_allclose(local.kernel.numpy(), before - grads[0].numpy() / N, rtol=1e-6)
    mean_head = np.mean([2.0 * (r + 1) for r in range(N)])
    np.testing.assert_allclose(head.kernel.numpy(), [[1.0 - mean_head]], rtol=1e-6)


def test_compute_gradients_gives_reduced_pairs():
    """Horovod's optimizer.compute_gradients / _compute_gradients (loss callable or taped)."""
    import keras
    import nbdist.keras as hvd_keras

    w = keras.Variable([1.0])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), name="compute.grads")
    pairs = opt._compute_gradients(lambda: tf.reduce_sum(w * (R + 1.0)), [w])
    mean = np.mean([r + 1.0 for r in range(N)])
    assert pairs[0][1] is w
    np.testing.assert_allclose(pairs[0][0], [mean])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w * (R + 1.0))
    (grad, _), = opt.compute_gradients(loss, [w], tape=tape)
    np.testing.assert_allclose(grad, [2.0 * mean])
    opt.apply_gradients(pairs)  # already reduced: applied as they are
    np.testing.assert_allclose(w.numpy(), [1.0 - mean])


def test_broadcast_callback_keeps_local_variables():
    import keras
    import nbdist.keras as hvd_keras

    init = keras.initializers.Constant(float(R))
    model = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(2, kernel_initializer=init, trainable=False),
                              keras.layers.Dense(1, kernel_initializer=init, trainable=False)])
    model.compile(loss="mse", optimizer=hvd_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.0), name="bcast.local"))
    local = list(model.layers[0].variables)
    root = N - 1
    cb = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)
    model.fit(np.ones((2, 2)), np.ones((2, 1)), epochs=1, verbose=0, callbacks=[cb])
    assert np.all(model.layers[0].kernel.numpy() == R)  # kept this rank's own values
    assert np.all(model.layers[1].kernel.numpy() == root)


def test_broadcast_global_variables_in_a_tf1_graph():
    with pytest.raises(RuntimeError, match="TensorFlow 1 graphs only"):  # eagerly, as Horovod
        hvd.broadcast_global_variables(0)
    assert hvd.util._executing_eagerly()
    with tf.Graph().as_default():
        assert not hvd.util._executing_eagerly()
        v = tf.compat.v1.get_variable("v", initializer=[float(R), 2.0 * R], use_resource=True)
        bcast = hvd.broadcast_global_variables(N - 1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(bcast)
            assert session.run(v).tolist() == [N - 1.0, 2.0 * (N - 1)]


def _tf1_session():
    # One inter-op thread: the case where a wait that held its thread would stop the rank.
    return tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1))


def test_a_tf1_session_runs_many_collectives_in_any_order():
    # One Session.run fetches several collectives, built in another order on odd ranks, so
    # each rank's executor starts them in its own order. A wait must not hold the inter-op
    # thread while this rank has yet to submit what its peer waits for (Horovod's kernels
    # are asynchronous for this reason; so is nbdist's wait op).
    count = 6
    order = range(count) if R % 2 == 0 else reversed(range(count))
    with tf.Graph().as_default():
        built = {i: hvd.allreduce(tf.fill([3], float(R + i)), op=hvd.Sum, name=f"compat.tf1.{i}")
                 for i in order}
        gathered = hvd.allgather(tf.fill([R + 1, 2], R), name="compat.tf1.gather")
        with _tf1_session() as session:
            for _ in range(2):  # the second run goes through the response cache
                values, rows = session.run(([built[i] for i in range(count)], gathered))
                for i, value in enumerate(values):
                    assert value.tolist() == [N * i + N * (N - 1) / 2] * 3
                assert rows[:, 0].tolist() == [r for r in range(N) for _ in range(r + 1)]


def test_a_tf1_graph_raises_horovods_error_types():
    if N == 1:
        pytest.skip("needs two ranks")
    with tf.Graph().as_default():
        x = tf.ones([3], dtype=tf.int32 if R % 2 == 0 else tf.float32)
        y = hvd.allreduce(x, name="compat.tf1.mismatch")
        with _tf1_session() as session:
            # as Horovod's op: FailedPrecondition, not the UnknownError of a Python op
            with pytest.raises(tf.errors.FailedPreconditionError, match="ranks disagree on dtype"):
                session.run(y)
            ok = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="compat.tf1.after")
            assert session.run(ok).tolist() == [N, N]


def test_a_tf1_graph_builds_a_grouped_gradient_once_per_output():
    # tf.gradients once per output builds the grouped op's gradient several times, and one
    # Session.run runs them all: each build needs names of its own (from its incoming
    # gradient, unique in the graph), not "<op>.0.grad" submitted twice while in flight.
    with tf.Graph().as_default():
        xs = [tf.ones([R + 1, 2]) * R for _ in range(3)]
        gathered = hvd.grouped_allgather(xs)
        scattered = hvd.grouped_reducescatter([tf.ones([N, 2]) * (R + 1) for _ in range(3)],
                                              op=hvd.Sum)
        grads = [tf.gradients(y, x, tf.ones_like(y))[0] for y, x in zip(gathered, xs)]
        with _tf1_session() as session:
            out, scat = session.run((grads, scattered))
    for g in out:  # the allgather's gradient: this rank's rows of the averaged ones
        assert g.tolist() == [[1.0, 1.0]] * (R + 1)
    for s in scat:
        assert s.tolist() == [[N * (N + 1) / 2] * 2]
