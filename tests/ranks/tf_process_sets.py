"""Process sets, Adasum and the op rule in nbdist.tensorflow (under mpiexec).

The TF binding runs every collective on a Horovod process set (its own engine, from
nbdist.common), eagerly and inside tf.function, with gradients scaled by the set's size;
DistributedGradientTape / DistributedOptimizer on a set average over its members and
leave other ranks' gradients alone; op=Adasum works; the op/average rule is common's.
"""
import numpy as np
import pytest

from _tf_setup import hvd, tf

R, N = hvd.rank(), hvd.size()
MODES = ["eager", "function"]


def run(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


@pytest.fixture(scope="module")
def sets():
    even = hvd.add_process_set([r for r in range(N) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(N) if r % 2 == 1])
    mine, other = (even, odd) if R % 2 == 0 else (odd, even)
    yield even, mine, other
    hvd.barrier()
    hvd.remove_process_set(even)
    hvd.remove_process_set(odd)


@pytest.mark.parametrize("mode", MODES)
def test_collectives_stay_inside_the_set(sets, mode):
    _, mine, _ = sets
    members, k = mine.ranks, len(mine.ranks)
    x = tf.fill([3], float(R))

    def ops(t):
        return (hvd.allreduce(t, op=hvd.Sum, process_set=mine, name=f"ps.ar.{mode}"),
                hvd.grouped_allreduce([t, 2 * t], op=hvd.Average, process_set=mine,
                                      name=f"ps.gar.{mode}"),
                hvd.allgather(t[:1], process_set=mine, name=f"ps.ag.{mode}"),
                hvd.broadcast(t, members[-1], process_set=mine, name=f"ps.bc.{mode}"),
                hvd.alltoall(tf.fill([k], float(R)), process_set=mine, name=f"ps.a2a.{mode}"),
                hvd.reducescatter(tf.ones([2 * k, 2]), op=hvd.Sum, process_set=mine,
                                  name=f"ps.rs.{mode}"),
                hvd.grouped_allgather([t[:1]], process_set=mine, name=f"ps.gag.{mode}"),
                hvd.grouped_reducescatter([tf.ones([k, 1])], op=hvd.Sum, process_set=mine,
                                          name=f"ps.grs.{mode}"))

    summed, grouped, gathered, bcast, a2a, rs, ggathered, grs = run(mode, ops, x)
    np.testing.assert_allclose(summed, sum(members))
    mean = sum(members) / k
    np.testing.assert_allclose(grouped[0], mean)
    np.testing.assert_allclose(grouped[1], 2 * mean)
    assert gathered.numpy().tolist() == [float(r) for r in members]
    assert bcast.numpy().tolist() == [float(members[-1])] * 3  # root_rank is global
    assert a2a.numpy().tolist() == [float(r) for r in members]
    assert rs.shape == (2, 2) and np.all(rs.numpy() == k)
    assert ggathered[0].numpy().tolist() == [float(r) for r in members]
    assert grs[0].shape == (1, 1) and float(grs[0][0, 0]) == k


@pytest.mark.parametrize("mode", MODES)
def test_gradients_scale_with_the_set(sets, mode):
    _, mine, _ = sets
    k = len(mine.ranks)
    x = tf.ones([2 * k, 2])

    def grads(t):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(t)
            summed = hvd.allreduce(t, op=hvd.Sum, process_set=mine, name=f"ps.g.ar.{mode}")
            scattered = hvd.reducescatter(t, op=hvd.Sum, process_set=mine,
                                          name=f"ps.g.rs.{mode}")
            gathered = hvd.allgather(t, process_set=mine, name=f"ps.g.ag.{mode}")
        return (tape.gradient(summed, t), tape.gradient(scattered, t),
                tape.gradient(gathered, t))

    g_sum, g_rs, g_ag = run(mode, grads, x)
    # allreduce(Sum)'s gradient is the Sum of ones over the set; reducescatter(Sum)'s is the
    # allgather of ones times the set's size; allgather's is this rank's rows of the average
    np.testing.assert_allclose(g_sum, k)
    np.testing.assert_allclose(g_rs, k)
    np.testing.assert_allclose(g_ag, 1.0)


def test_sets_this_rank_cannot_use_are_refused(sets):
    _, _, other = sets
    if N == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"rank {R} is not in"):
        hvd.allreduce(tf.ones([2]), process_set=other)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allgather(tf.ones([2]), process_set=hvd.ProcessSet([0]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in the process set"):
        hvd.broadcast_variables([tf.Variable(1.0)], root_rank=other.ranks[0],
                                process_set=sets[1])


def test_set_graph_ops(sets):
    even, mine, other = sets
    assert int(hvd.size_op(process_set_id=mine.process_set_id)) == len(mine.ranks)
    assert int(hvd.process_set_included_op(process_set_id=mine.process_set_id)) == 1
    assert int(hvd.process_set_included_op(process_set_id=0)) == 1
    if N > 1:
        assert int(hvd.process_set_included_op(process_set_id=other.process_set_id)) == 0
    traced = tf.function(lambda: hvd.size_op(process_set_id=even.process_set_id))()
    assert int(traced) == len(even.ranks)
    with pytest.raises(ValueError, match="no process set with id 99"):
        hvd.size_op(process_set_id=99)


@pytest.mark.parametrize("mode", MODES)
def test_tape_and_optimizer_on_a_set(sets, mode):
    even, _, _ = sets
    w = tf.Variable([float(R)])

    def tape_grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        return hvd.DistributedGradientTape(tape, process_set=even,
                                           name=f"ps.tape.{mode}").gradient(loss, [w])[0]

    grad = run(mode, tape_grad)
    want = 2.0 * np.mean(even.ranks) if R % 2 == 0 else 2.0 * R  # others keep their own
    np.testing.assert_allclose(grad, [want])

    import keras
    v = keras.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=even,
                                   name=f"ps.opt.{mode}")
    opt.build([v])
    run(mode, lambda: opt.apply_gradients([(tf.constant([float(R)]), v)]))
    want = -np.mean(even.ranks) if R % 2 == 0 else -float(R)
    np.testing.assert_allclose(v.numpy(), [want])


def test_variables_and_objects_on_a_set(sets):
    _, mine, _ = sets
    root = mine.ranks[0]
    v = tf.Variable([R, R])
    hvd.broadcast_variables([v], root_rank=root, process_set=mine)
    assert v.numpy().tolist() == [root, root]
    assert hvd.broadcast_object({"from": R}, root_rank=root, process_set=mine) == {"from": root}
    assert hvd.broadcast_object_fn(root_rank=root, process_set=mine)(R) == root
    assert hvd.allgather_object(R, process_set=mine) == mine.ranks


def _adasum_reference(vectors):
    """Adasum's formula, pairwise by distance doubling (Horovod's VHDD order)."""
    level = [np.asarray(v, np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, aa, bb = a @ b, a @ a, b @ b
            nxt.append((1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b)
        level = nxt
    return level[0]


@pytest.mark.parametrize("mode", MODES)
def test_adasum_allreduce_and_tape(mode):
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(N, 5))
    x = tf.constant(vectors[R], tf.float32)
    out = run(mode, lambda t: hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.tf.{mode}"), x)
    np.testing.assert_allclose(out, _adasum_reference(vectors), rtol=1e-5, atol=1e-6)
    grouped = run(mode, lambda t: hvd.grouped_allreduce([t], op=hvd.Adasum,
                                                        name=f"adasum.tfg.{mode}"), x)
    np.testing.assert_allclose(grouped[0], _adasum_reference(vectors), rtol=1e-5, atol=1e-6)

    w = tf.Variable(tf.zeros([5]))

    def tape_grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)  # the gradient is this rank's vector
        return hvd.DistributedGradientTape(tape, op=hvd.Adasum,
                                           name=f"adasum.tape.{mode}").gradient(loss, [w])[0]

    np.testing.assert_allclose(run(mode, tape_grad), _adasum_reference(vectors), rtol=1e-5,
                               atol=1e-6)


def test_adasum_refusals():
    with pytest.raises(TypeError, match="floating-point"):
        hvd.allreduce(tf.ones([2], tf.int32), op=hvd.Adasum)
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([2, 2]))
    with pytest.raises(NotImplementedError):
        hvd.allreduce(slices, op=hvd.Adasum)
    if N > 1:  # a lone rank reduces nothing
        table = tf.Variable(tf.ones([4, 2]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [R % 4]))  # an IndexedSlices gradient
        with pytest.raises(NotImplementedError, match="sparse_as_dense"):
            hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [table])


def test_one_op_rule_for_every_binding():
    with pytest.warns(DeprecationWarning):  # Horovod's deprecated average=
        summed = hvd.allreduce(tf.ones([2]), average=False, name="rule.avg")
    np.testing.assert_allclose(summed, N)
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(tf.ones([2]), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="unknown reduction op"):
        hvd.allreduce(tf.ones([2]), op=42)
    # reducescatter reduces with Average or Sum only: the error is both Horovod's torch
    # (ValueError) and TensorFlow (NotImplementedError) types
    for err in (ValueError, NotImplementedError):
        with pytest.raises(err, match="Average or op=Sum"):
            hvd.reducescatter(tf.ones([N, 2]), op=hvd.Max)
    if N > 1:
        w = tf.Variable(1.0)
        with tf.GradientTape() as tape:
            loss = w * 2.0
        with pytest.raises(ValueError, match="gradient_predivide_factor"):
            hvd.DistributedGradientTape(tape, op=hvd.Sum,
                                        gradient_predivide_factor=2.0).gradient(loss, [w])
