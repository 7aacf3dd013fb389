"""Datasets of any size train, evaluate and predict under every strategy kind as on one device.

61 training examples in batches of 8 end each epoch with a batch of 5, which
does not divide over 2 or 4 replicas (3 + 2, or 2 + 1 + 1 + 1); 3 validation
and 5 evaluation examples are one partial batch each, and over 4 replicas one
replica gets none. Keras 3 with TensorFlow's own MirroredStrategy fails on such
a batch (keras-team/keras#19246), and weights every replica alike, so a
partial batch's step is not one device's. Multi-worker and Horovod jobs run
any_size_job.py in two processes; parameter servers are in test_parameter_server.py.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from any_size_job import EVALUATE, FIT, TRAIN, X, Y, build, dense, load, run, tensor_parallel
from helpers import HOROVODRUN, ROOT, SCENARIO_DIR, free_ports, patient
from oracle import keras_alone
import zygote
from tfdist import MirroredStrategy
from tfdist.strategies import PipelineStrategy, TensorParallelStrategy

FOUR = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


@pytest.mark.parametrize("make,hidden", [
    pytest.param(lambda: MirroredStrategy(FOUR[:2]), dense, id="mirrored-2"),
    pytest.param(lambda: MirroredStrategy(FOUR), dense, id="mirrored-4"),
    pytest.param(lambda: PipelineStrategy(2, 2, devices=FOUR, verbose=False), dense, id="pipeline-2x2"),
    pytest.param(lambda: TensorParallelStrategy(FOUR[:2]), tensor_parallel, id="tensor_parallel"),
    pytest.param(lambda: TensorParallelStrategy(FOUR, group_size=2), tensor_parallel, id="tensor_parallel-2x2"),
])
def test_sizes_that_do_not_divide_the_batch_match_one_device(make, hidden):
    # tfdist's own parallel layers have no plain Keras twin: their one-device run is the reference.
    one_device = run(tf.distribute.OneDeviceStrategy("/cpu:0"), hidden) if hidden is tensor_parallel else (
        _keras_alone())
    _assert_as_on_one_device(run(make(), hidden), one_device)


def _keras_alone():
    """The job's results on one device from Keras in a process that never imported tfdist."""
    got = keras_alone("fit", build(dense), X[TRAIN], Y[TRAIN], evaluate=(X[EVALUATE], Y[EVALUATE]),
                      predict=X[EVALUATE], **FIT)
    return got["history"], got["weights"], got["evaluation"], got["predictions"]


def _assert_as_on_one_device(results, one_device):
    history, weights, evaluation, predictions = results
    expected_history, expected_weights, expected_evaluation, expected_predictions = one_device
    assert history.keys() == expected_history.keys() == {"loss", "accuracy", "val_loss", "val_accuracy"}
    for key, values in expected_history.items():
        np.testing.assert_allclose(history[key], values, atol=1e-5, err_msg=key)
    for a, b in zip(weights, expected_weights, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(evaluation, expected_evaluation, atol=1e-5)
    assert predictions.shape == (5, 3)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5)  # in order


JOB = os.path.join(SCENARIO_DIR, "any_size_job.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_multi_worker_matches_one_device(tmp_path):
    out = tmp_path / "results.npz"
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    tasks = [zygote.Popen([sys.executable, JOB, "multi_worker", json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}), str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for task in tasks:
        _, err = task.communicate(timeout=patient(240))
        assert task.returncode == 0, err[-3000:]
    _assert_as_on_one_device(load(out), _keras_alone())


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_horovod_matches_one_device(tmp_path):
    out = tmp_path / "results.npz"
    proc = zygote.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, JOB, "horovod",
                       str(out)], cwd=ROOT, capture_output=True, text=True, timeout=patient(240))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    _assert_as_on_one_device(load(out), _keras_alone())
