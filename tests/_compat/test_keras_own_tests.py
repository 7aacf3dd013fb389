"""Keras's own tf.distribute tests (installed with Keras: its optimizers under a strategy, EMA, gradient
accumulation, variables, `fit`) pass under tfdist's data-parallel kinds (mirrored, its optimizer state split at
stages 1 and 2, a layout of the data axis alone) wherever they pass under TensorFlow's own
MirroredStrategy, in a process that never imported tfdist."""

import json
import os
import sys

import pytest
import zygote
from helpers import ROOT, patient, why_it_failed

SCRIPT = os.path.join(ROOT, "tests", "scenarios", "keras_own_tests.py")
# Refused in one line before training, as docs/own-script.md says: a split optimizer state keeps no moving average.
REFUSED = {("shard_optimizer_1", "SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute"),
           ("shard_optimizer_2", "SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute")}


def _outcomes(*kinds, env):
    proc = zygote.run([sys.executable, SCRIPT, *kinds], capture_output=True, text=True, timeout=patient(400),
                      cwd=ROOT, env=env)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# On one worker with the other test of references that never saw tfdist: one zygote without tfdist for both.
@pytest.mark.xdist_group("without_tfdist")
def test_keras_own_distribute_tests_pass_under_tfdists_kinds_where_they_pass_under_tensorflows():
    reference = _outcomes("tensorflow", env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"})["tensorflow"]
    passing = {test for test, outcome in reference.items() if outcome == "passed"}
    assert len(passing) >= 20 and "OptimizerDistributeTest::test_gradient_accumulation" in passing
    kinds = ("mirrored", "shard_optimizer_1", "shard_optimizer_2", "layout_data")
    for kind, outcomes in _outcomes(*kinds, env=dict(os.environ)).items():
        for test in passing:
            if (kind, test) in REFUSED:
                assert "cannot be split over devices" in outcomes[test], (kind, test, outcomes[test])
            else:
                assert outcomes[test] == "passed", (kind, test, outcomes[test])
