"""`tfdist.horovod.tensorflow`: Horovod's custom-loop surface on Keras 3, under horovodrun."""

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT

pytestmark = [pytest.mark.horovod, pytest.mark.multiprocess, pytest.mark.timeout(300)]

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
CUSTOM_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_custom_loop.py")


def _custom_loop(tmp_path, *options, np=2):
    out = str(tmp_path / f"loop{np}")
    command = [sys.executable, CUSTOM_LOOP, out, *options]
    if np > 1:
        command = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", "--gloo", *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return [np_load(f"{out}.rank{r}.npz") for r in range(np)]


def np_load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _weights(result):
    return [result[k] for k in sorted((k for k in result if k.startswith("arr_")), key=lambda k: int(k[4:]))]


def test_a_custom_loop_matches_one_process_on_the_whole_batches(tmp_path):
    ranks = _custom_loop(tmp_path)
    (reference,) = _custom_loop(tmp_path, np=1)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # every rank ends with the same weights
    for a, b in zip(_weights(ranks[0]), _weights(reference)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_broadcast_variables_makes_ranks_that_started_apart_equal(tmp_path):
    ranks = _custom_loop(tmp_path, "seed_by_rank")
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def test_a_partial_tape_keeps_the_local_layers_gradients_on_their_rank(tmp_path):
    ranks = _custom_loop(tmp_path, "partial")
    first, second = _weights(ranks[0]), _weights(ranks[1])
    # The hidden layer's gradients are all-reduced: equal on both ranks; the head's are each rank's own.
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])
    assert np.abs(first[2] - second[2]).max() > 1e-4
