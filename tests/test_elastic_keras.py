"""Elastic Keras in the notebook (real kernel, ipyparallel, mpiexec, TensorFlow): model.fit with
hvd.elastic.KerasState and the commit/batch/epoch callbacks on 4 ranks; SIGKILL rank 2
mid-epoch and the same cell finishes on 3 ranks from the last commit."""
import json

import pytest

import nbharness as h

TRAIN = r'''%%distributed -n 4 --elastic --min-np 2 --no-widgets
LOG = {log!r}
import os, json, time, signal
import numpy as np
import tensorflow as tf
import nbdist
import nbdist.keras as hvd
hvd.init()
rng = np.random.default_rng(0)
X = rng.normal(size=(240, 8)).astype("float32")
Y = X @ rng.normal(size=(8, 1)).astype("float32")
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.02)), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0, batch=0, step=0, processed=0, seen=[],
                               complete=[], steps=[], sizes=[])
pids = hvd.allgather_object(os.getpid())
order = np.random.default_rng(1).permutation(len(X)).tolist()
B, COMMIT_EVERY = 4, 3


class Track(tf.keras.callbacks.Callback):
    """Counts the samples each step trained on (all ranks), before the commit callback runs."""

    def __init__(self, mine):
        super().__init__()
        self.mine, self.done = mine, []

    def on_train_batch_end(self, batch, logs=None):
        self.done += self.mine[batch * B:(batch + 1) * B]
        state.processed += B * hvd.size()
        state.step += 1
        state.steps.append(state.step)
        state.sizes.append(hvd.size())
        with open(LOG, "a") as f:
            f.write(json.dumps({{"t": time.time(), "size": hvd.size(), "step": state.step}}) + "\n")
        if state.step == 7 and hvd.rank() == 0 and not os.path.exists(LOG + ".killed"):
            open(LOG + ".killed", "w").close()
            with open(LOG, "a") as f:
                f.write(json.dumps({{"t": time.time(), "kill": pids[2]}}) + "\n")
            os.kill(pids[2], signal.SIGKILL)
        if (state.batch + 1) % COMMIT_EVERY == 0:  # CommitStateCallback commits after this batch
            self.gather()

    def gather(self):
        state.seen += [s for part in hvd.allgather_object(self.done) for s in part]
        self.done = []

    def on_epoch_end(self, epoch, logs=None):
        self.gather()
        state.complete.append(sorted(state.seen) == list(range(len(X))))
        state.seen = []
        state.processed = 0


@hvd.elastic.run
def train(state):
    while state.epoch < 1:
        mine = order[state.processed:][hvd.rank()::hvd.size()]
        model.fit(X[mine], Y[mine], batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Track(mine), hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                             hvd.elastic.UpdateEpochStateCallback(state)])

train(state)
w = hvd.allgather(tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)[None])
print("SUMMARY " + json.dumps({{"size": hvd.size(), "complete": state.complete, "steps": state.steps,
    "sizes": state.sizes, "same_weights": bool(all(np.array_equal(w[0], w[r]) for r in range(hvd.size())))}}))
'''


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("elastic-keras") / "events.log")
    nb = h.notebook("%load_ext nbdist", TRAIN.format(log=log))
    h.execute(nb, timeout=300)
    with open(log) as f:
        events = [json.loads(line) for line in f]
    return nb, events


@pytest.mark.timeout(400)
def test_keras_fit_survives_a_killed_rank(executed):
    nb, events = executed
    cell = nb.cells[1]
    text = h.text_of(cell)
    assert h.error_of(cell) is None, text[-4000:]
    line = next(line for line in text.splitlines() if "SUMMARY " in line)
    s = json.loads(line[line.index("SUMMARY ") + 8:])
    assert s["size"] == 3 and s["sizes"][0] == 4
    assert s["same_weights"]
    assert s["complete"] == [True]  # every sample of the epoch exactly once
    assert s["steps"] == list(range(1, len(s["steps"]) + 1))  # resumed from the last commit
    assert "elastic: lost rank 2" in text and "resized 4 -> 3 ranks" in text
    kill = next(e for e in events if "kill" in e)
    first = next(e for e in events if e.get("size") == 3)
    print(f"keras recovery (kill -> first step on 3 ranks): {first['t'] - kill['t']:.2f} s")
