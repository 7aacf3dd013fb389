"""The scripts of Keras's and TensorFlow's guides in examples/, their strategy line changed to tfdist's: each
run under a kind equals its one-device run (the same global batch), and what it saves restores."""

import os
import sys

import numpy as np
import pytest

from helpers import ROOT, patient, why_it_failed
import zygote

pytestmark = pytest.mark.timeout(600)


def _script(name, *args, cwd=ROOT):
    proc = zygote.run([sys.executable, os.path.join(ROOT, "examples", name), *map(str, args)], capture_output=True,
                      text=True, timeout=patient(300), cwd=cwd, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return proc.stdout


def _checkpointed(directory):
    """Every variable of the latest `tf.train.Checkpoint` in `directory`: the model's, and the optimizer's slots."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(directory)))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k.endswith("VARIABLE_VALUE")}


@pytest.mark.parametrize("kind", [pytest.param(["strategy.kind=mirrored", "strategy.logical_devices=2"],
                                               id="mirrored")])
def test_the_custom_loop_guide_equals_one_device_and_its_checkpoint_restores(tmp_path, kind):
    """TensorFlow's "Custom training with tf.distribute.Strategy": its optimizer is built by the first step inside
    `strategy.run` in a `tf.function`, which failed under every data-parallel strategy (keras-team/keras#19246)."""
    one = _script("guide_custom_training_loop.py", "--set", "strategy.kind=one_device", "--batch_per_replica", 128,
                  "--epochs", 1, "--checkpoint_dir", tmp_path / "one")
    two = _script("guide_custom_training_loop.py", *(f"--set={s}" for s in kind), "--batch_per_replica", 64,
                  "--epochs", 1, "--checkpoint_dir", tmp_path / "two")
    for output in (one, two):  # the restored model scores as the trained one did
        restored, trained = output.split("without strategy: ")[1].split(" (trained: ")
        assert restored == trained.rstrip(")\n")
    expected, got = _checkpointed(tmp_path / "one"), _checkpointed(tmp_path / "two")
    assert expected.keys() == got.keys() and len(expected) > 10
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=key)
