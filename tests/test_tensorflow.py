"""nbdist.tensorflow / nbdist.keras on 2 and 4 ranks (tests/ranks/tf_*.py under mpiexec)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_rank_tests

pytest.importorskip("tensorflow")

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_collectives_and_gradients(n):
    run_rank_tests(n, "tf_collectives.py", timeout=360, extra_env=TF_ENV)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_horovod_compat(n):
    run_rank_tests(n, "tf_horovod_compat.py", timeout=260, extra_env=TF_ENV)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_process_sets_adasum_and_the_op_rule(n):
    run_rank_tests(n, "tf_process_sets.py", timeout=260, extra_env=TF_ENV)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_training_keras3(n):
    run_rank_tests(n, "tf_training.py", timeout=360, extra_env=TF_ENV)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_training_legacy_tf_keras(n):
    pytest.importorskip("tf_keras")
    run_rank_tests(n, "tf_training.py", timeout=360,
                   extra_env={**TF_ENV, "TF_USE_LEGACY_KERAS": "1"})


@pytest.mark.timeout(500)
@pytest.mark.parametrize("n", [2, 4])
def test_user_example_both_forms(n):
    run_rank_tests(n, "tf_example.py", timeout=460, extra_env=TF_ENV,
                   pytest_args=("--timeout", "300"))


@pytest.mark.timeout(120)
def test_single_process_without_mpiexec():
    """A lone process is a world of one: the API works and reduces nothing."""
    code = (
        "import tensorflow as tf, nbdist.tensorflow as hvd, nbdist.keras as k\n"
        "hvd.init(); assert hvd.size() == 1\n"
        "assert float(hvd.allreduce(tf.constant(3.0))) == 3.0\n"
        "w = tf.Variable([1.0, 2.0])\n"
        "with tf.GradientTape() as t: loss = tf.reduce_sum(w * w)\n"
        "g = hvd.DistributedGradientTape(t).gradient(loss, [w])\n"
        "assert g[0].numpy().tolist() == [2.0, 4.0]\n"
        "opt = k.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))\n"
        "opt.apply_gradients(zip(g, [w])); assert opt.variables() == opt.variables\n"
        "print('ok')\n")
    env = {**os.environ, **TF_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-3000:]
