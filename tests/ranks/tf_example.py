"""The user's example from issue 6, run as written (its import line is already nbdist's).

Two changes to the program text, both stated here: the number of batches
(`10000 // hvd.size()` -> `EXAMPLE_BATCHES // hvd.size()`, to fit a 2-core test) and,
for the fixed form, the model built on every rank (the `if hvd.rank() == 0:` dropped).
MNIST's load_data needs the network, so it serves small generated data of MNIST's
shapes and dtypes (uint8 28x28 images, uint8 labels) with a learnable pattern.
"""
import contextlib
import io
import re
import time

import numpy as np
import pytest

from _tf_setup import hvd, tf

R, N = hvd.rank(), hvd.size()
EXAMPLE_BATCHES = 120

EXAMPLE = '''
import tensorflow as tf
import nbdist.tensorflow as hvd
hvd.init()                                   # 1. initialise
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:                             # 2. pin the GPU
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')
(mnist_images, mnist_labels), _ = tf.keras.datasets.mnist.load_data()   # 3. data
dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., None] / 255.0, tf.float32),
     tf.cast(mnist_labels, tf.int64)))
dataset = dataset.repeat().shuffle(10000).batch(128)
model = tf.keras.models.Sequential([        # 4. model
    tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
    tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])
opt = tf.keras.optimizers.Adam(0.001 * hvd.size())   # 5. scale the learning rate
opt = hvd.DistributedOptimizer(opt)                  # 6.
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
metric = tf.keras.metrics.SparseCategoricalAccuracy()
@tf.function
def train_step(images, labels):                      # 8.
    with tf.GradientTape() as tape:
        probs = model(images, training=True)
        loss = loss_fn(labels, probs)
    tape = hvd.DistributedGradientTape(tape)
    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))
    metric.update_state(labels, probs)
    return loss
@tf.function
def initialize_vars():                               # 9. broadcast initial variables
    if hvd.rank() == 0:
        model(tf.zeros((1, 28, 28, 1)))
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables(), root_rank=0)
initialize_vars()
for batch, (images, labels) in enumerate(dataset.take(10000 // hvd.size())):   # 10.
    loss = train_step(images, labels)
    if batch % 10 == 0 and hvd.rank() == 0:
        print('batch: %d, loss: %.4f, accuracy: %.2f' % (batch, loss, metric.result()))
'''

RANK0_BUILD = "    if hvd.rank() == 0:\n        model(tf.zeros((1, 28, 28, 1)))\n"
EVERY_RANK_BUILD = "    model(tf.zeros((1, 28, 28, 1)))\n"


def fake_mnist():
    """MNIST-shaped data: each digit class lights up its own band of rows."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 3000).astype(np.uint8)
    images = (rng.random((3000, 28, 28)) * 80).astype(np.uint8)
    for digit in range(10):
        images[labels == digit, 2 * digit + 4:2 * digit + 7, 4:24] = 255
    return (images, labels), (images[:500], labels[:500])


def program(build_on_every_rank: bool) -> str:
    text = EXAMPLE.replace("10000 // hvd.size()", f"{EXAMPLE_BATCHES} // hvd.size()")
    if build_on_every_rank:
        text = text.replace(RANK0_BUILD, EVERY_RANK_BUILD)
    return text


def run_example(monkeypatch, build_on_every_rank):
    monkeypatch.setattr(tf.keras.datasets.mnist, "load_data", fake_mnist)
    namespace, out = {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(program(build_on_every_rank), "user_example.py", "exec"), namespace)
    return namespace, out.getvalue()


def test_example_with_model_built_on_rank_0_only_fails_fast_on_every_rank(monkeypatch):
    start = time.monotonic()
    with pytest.raises(Exception) as caught:
        run_example(monkeypatch, build_on_every_rank=False)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert "the ranks passed different variables" in message
    assert re.search(r"rank 0: \d+ variables: sequential\S*/conv2d\S*/kernel \(3, 3, 1, 32\)",
                     message), message
    for r in range(1, N):
        assert f"rank {r}: " in message
    assert "build the model on every rank" in message
    assert elapsed < 30, f"the error took {elapsed:.1f} s"


def test_example_with_model_built_on_every_rank_trains(monkeypatch):
    namespace, printed = run_example(monkeypatch, build_on_every_rank=True)
    lines = re.findall(r"batch: (\d+), loss: ([\d.]+), accuracy: ([\d.]+)", printed)
    if R == 0:
        assert len(lines) == len(range(0, EXAMPLE_BATCHES // N, 10)), printed
        losses = [float(loss) for _, loss, _ in lines]
        assert losses[-1] < losses[0] * 0.7, printed
    else:
        assert not lines, "only rank 0 prints"
    model = namespace["model"]
    flat = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    gathered = hvd.allgather_object(flat)
    assert all(np.array_equal(gathered[0], g) for g in gathered), "weights differ between ranks"
