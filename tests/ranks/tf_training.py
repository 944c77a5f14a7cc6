"""Training with nbdist.tensorflow / nbdist.keras: tape, optimizer, model.fit and callbacks.

Runs under Keras 3, and with TF_USE_LEGACY_KERAS=1 under tf-keras (the outer test sets it).
"""
import os

import numpy as np
import pytest

from _tf_setup import hvd, tf

import nbdist
import nbdist.keras as hvdk
import nbdist.tensorflow.keras as hvdk_same

R, N = hvd.rank(), hvd.size()
LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
keras = tf.keras


def all_equal(arrays) -> bool:
    gathered = hvd.allgather_object([np.asarray(a) for a in arrays])
    return all(all(np.array_equal(a, b) for a, b in zip(gathered[0], g)) for g in gathered)


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def data(rows=8 * 4, seed=0):
    """The same full batch on every rank: rank r's shard is rows r::N."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1)) + 0.3).astype(np.float32)
    return x, y


def test_keras_alias_is_the_same_module():
    assert hvdk is hvdk_same
    assert nbdist.keras is hvdk_same
    assert hvdk.callbacks is hvdk_same.callbacks


def train_linear(xs, ys, distributed: bool, mode: str, steps: int, lr: float) -> list:
    """A linear model trained with a (DistributedGradientTape when `distributed`), eager
    or in a tf.function; its weights."""
    init = [np.linspace(-1, 1, 5, dtype=np.float32).reshape(5, 1), np.zeros(1, np.float32)]
    w = [tf.Variable(v) for v in init]
    opt = tf.keras.optimizers.SGD(lr)

    def step(a, b):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(a @ w[0] + w[1] - b))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, w), w))
    step = tf.function(step) if mode == "function" else step
    for _ in range(steps):
        step(tf.constant(xs), tf.constant(ys))
    return [v.numpy() for v in w]


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tape_training_matches_one_process_on_the_whole_batch(mode):
    x, y = data()
    mine = train_linear(x[R::N], y[R::N], True, mode, 5, 0.1)
    reference = train_linear(x, y, False, mode, 5, 0.1)  # one process, the whole batch
    for a, b in zip(mine, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all_equal(mine)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_embedding_gradients_gathered_or_densified(mode, sparse_as_dense):
    table = tf.Variable(tf.reshape(tf.range(20, dtype=tf.float32), (10, 2)))
    ids = tf.constant([R, R + 1, 7])

    def g():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * float(R + 1))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [table])[0]
    grad = g() if mode == "eager" else tf.function(g)()
    assert isinstance(grad, tf.IndexedSlices) != sparse_as_dense
    dense = tf.convert_to_tensor(grad).numpy()
    expect = np.zeros((10, 2))
    for r in range(N):
        for i in (r, r + 1, 7):
            expect[i] += (r + 1) / N
    np.testing.assert_allclose(dense, expect, rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tape_and_optimizer_do_not_reduce_twice(monkeypatch, mode):
    import nbdist.common as common

    calls = []
    original = common.allreduce_async

    def counting(array, *args, **kwargs):
        calls.append(kwargs.get("name"))
        return original(array, *args, **kwargs)
    monkeypatch.setattr(common, "allreduce_async", counting)
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    model(tf.zeros((1, 4)))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))

    def both():  # the user's example: a distributed tape and a distributed optimizer
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(tf.ones((2, 4))) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def optimizer_only():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(tf.ones((2, 4))) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    if mode == "function":
        both, optimizer_only = tf.function(both), tf.function(optimizer_only)
    n_vars = len(model.trainable_variables)
    both()
    assert len(calls) == n_vars, calls  # once per variable, by the tape
    assert all(c.startswith("DistributedGradientTape.") for c in calls), calls
    calls.clear()
    optimizer_only()  # the optimizer alone reduces them, named after the variables
    assert len(calls) == n_vars and all(c.startswith("DistributedOptimizer.") for c in calls), \
        calls


def test_optimizer_variables_property_and_call():
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    assert isinstance(opt, keras.optimizers.Adam)
    listed, called = opt.variables, opt.variables()
    assert list(listed) == list(called) and len(listed) >= 1
    hvd.broadcast_variables(opt.variables(), root_rank=0)


def make_model(seed):
    keras.utils.set_random_seed(seed)  # a different start on each rank
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    return model


def test_fit_with_distributed_optimizer_and_callbacks(tmp_path_factory):
    x, y = data(rows=64, seed=1)
    model = make_model(seed=100 + R)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01 * N, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvdk.callbacks.MetricAverageCallback(),
                 hvdk.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * N, warmup_epochs=2)]
    history = model.fit(x[R::N], y[R::N], batch_size=4, epochs=3, callbacks=callbacks,
                        verbose=0)
    assert all_equal(weights(model)), "weights differ between ranks after fit"
    # Averaged metrics: the same numbers on every rank although each saw other data.
    logged = hvd.allgather_object({k: history.history[k] for k in ("loss", "mae")})
    assert all(entry == logged[0] for entry in logged)
    assert history.history["loss"][-1] < history.history["loss"][0]
    lrs = history.history["lr"]
    assert lrs[0] < 0.01 * N <= lrs[-1] + 1e-9  # warmed up to the scaled rate

    # Save on rank 0, load everywhere: the optimizer comes back distributed, state kept.
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("model") / "m.keras")
                                if R == 0 else None)
    if LEGACY:
        path = path[:-len(".keras")] + ".h5"
    if R == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvdk.load_model(path)
    assert getattr(loaded.optimizer, "_nbdist_distributed", False)
    assert int(np.asarray(loaded.optimizer.iterations)) == int(np.asarray(opt.iterations))
    loaded.fit(x[R::N], y[R::N], batch_size=4, epochs=1, verbose=0)
    assert all_equal(weights(loaded))


def test_progress_callback_reports_every_batch(monkeypatch):
    import nbdist.rank.report

    seen = []
    monkeypatch.setattr(nbdist.rank.report, "report", lambda **kw: seen.append(kw))
    x, y = data(rows=32, seed=2)
    model = make_model(seed=7)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(x[R::N], y[R::N], batch_size=4, epochs=2, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvdk.callbacks.ProgressCallback()])
    steps = (32 // N) // 4
    batches = [s for s in seen if not s.get("flush")]
    epoch_ends = [s for s in seen if s.get("flush")]
    assert [s["step"] for s in batches] == list(range(1, 2 * steps + 1))
    assert all(s["total"] == 2 * steps and "loss" in s for s in seen)
    assert [s["epoch"] for s in epoch_ends] == [1, 2]  # each epoch's end kept in the history


def test_broadcast_variables_mismatch_is_a_clear_error_on_every_rank():
    variables = [tf.Variable(tf.zeros([2, 2]))] if R == 0 else []
    with pytest.raises(hvd.MismatchError, match=r"(?s)rank 0: 1 variable.*rank 1: 0 variables"
                                                r".*build the model on every rank"):
        hvd.broadcast_variables(variables, root_rank=0)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_autotune_picks_the_fusion_threshold_by_measurement(monkeypatch, tmp_path, mode):
    """NBDIST_AUTOTUNE with TensorFlow: the engine's fusion threshold (which fuses a step's
    gradient allreduces) is chosen by measurement: each candidate trains a warm-up step and
    two measured ones, in two rounds; every rank then keeps the same threshold, the
    fastest, in every replica of the agreement, and rank 0 writes the scores to
    NBDIST_AUTOTUNE_LOG. The training itself is unchanged."""
    import dataclasses

    from nbdist.tensorflow import gradients

    config = nbdist.common.basics.config()
    log = tmp_path / "autotune.csv"
    monkeypatch.setattr(nbdist.common.basics, "config", lambda: dataclasses.replace(
        config, autotune=True, autotune_steps=2, autotune_warmup=1, autotune_log=str(log)))
    monkeypatch.setattr(gradients, "_tuned", None)  # (a tuner of an earlier test is done)
    engine = nbdist.common.basics.engine()
    x, y = data()
    # the first step starts the clock; then 2 rounds x 5 candidates x 3 steps, then more
    steps = 1 + 2 * 5 * 3 + 2
    try:
        mine = train_linear(x[R::N], y[R::N], True, mode, steps, 0.01)
        MiB = 1024 * 1024
        scores = gradients.fusion_autotune_scores()
        assert sorted(scores) == sorted({0, MiB, 4 * MiB, 16 * MiB, config.fusion_threshold})
        chosen = gradients._tuned[1].chosen
        assert scores[chosen] == min(scores.values())
        assert hvd.allgather_object((chosen, scores)) == [(chosen, scores)] * N
        # A new name goes through the agreement's items, behind rank 0's change.
        hvd.allreduce(tf.constant([1.0]), name=f"autotune.after.{mode}")
        if engine.agreement is not None:  # every replica fuses with the same threshold
            assert engine.agreement.coord.fusion_threshold == chosen
        elif R == 0:  # the MPI coordinator decides alone
            assert engine.coordinator.fusion_threshold == chosen
        if R == 0:
            rows = log.read_text().splitlines()
            assert rows[0] == "fusion_threshold,round,median_step_ms,chosen"
            assert sorted(int(r.split(",")[0]) for r in rows[1:]) == sorted(list(scores) * 2)
            assert {r.split(",")[0] for r in rows[1:] if r.endswith(",1")} == {str(chosen)}
    finally:
        engine.set_fusion_threshold(config.fusion_threshold)  # as the other tests expect
    reference = train_linear(x, y, False, mode, steps, 0.01)  # one process, the whole batch
    for a, b in zip(mine, reference):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert all_equal(mine)
