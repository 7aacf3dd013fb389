"""Mirrored training over 2 and 4 replicas matches one device (same global batch, seed, SGD)."""

import numpy as np
import pytest

from tfdist import load_config, prepare


STEPS = 5


def _train(*overrides, initial_weights=None):
    config = load_config(
        None,
        [
            "train.optimizer=sgd",
            "train.learning_rate=0.1",
            "train.global_batch_size=32",
            "model.dropout=0.0",
            "train.verbose=0",
            *overrides,
        ],
    )
    job = prepare(config)
    if initial_weights is not None:
        job.model.set_weights(initial_weights)
    start = job.model.get_weights()
    job.model.fit(job.train_data, epochs=1, steps_per_epoch=STEPS, verbose=0)
    return start, job.model.get_weights()


@pytest.mark.parametrize("replicas", [2, 4])
def test_mirrored_matches_one_device(replicas):
    start, single = _train("strategy.kind=one_device")
    devices = ", ".join(f"/cpu:{i}" for i in range(replicas))
    _, mirrored = _train(f"strategy.devices=[{devices}]", initial_weights=start)
    moved = max(np.abs(a - b).max() for a, b in zip(start, single))
    assert moved > 1e-3  # the comparison below is about trained weights
    for a, b in zip(single, mirrored):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
