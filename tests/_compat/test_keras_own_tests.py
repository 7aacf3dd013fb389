"""Keras's own tf.distribute tests (installed with Keras: its optimizers under a strategy, EMA, gradient
accumulation, variables, `fit`) pass under each of tfdist's one-process kinds wherever they pass under TensorFlow's
own MirroredStrategy of as many replicas, in a process that never imported tfdist, but for refusals in one line the
docs name."""

import json
import os
import sys

import pytest
import zygote
from helpers import ROOT, patient, why_it_failed

SCRIPT = os.path.join(ROOT, "tests", "scenarios", "keras_own_tests.py")
# The kinds of 2 replicas, against TensorFlow's MirroredStrategy on the 2 devices; the kinds of one replica on both
# devices (a pipeline's 2 stages, a model split in 2), against TensorFlow's on one: Keras's tests assert numbers that
# assume their replicas (gradients summed over 2, a batch split in 2).
TWO_REPLICAS = ("mirrored", "shard_optimizer_1", "shard_optimizer_2", "layout_data")
ONE_REPLICA = ("pipeline", "tensor_parallel", "layout_model")
# Refused in one line before training, as the docs say (kind, test -> what the refusal says): a split optimizer state
# or a split model keeps no moving average; a model split over devices trains with `fit`, not a custom loop; a
# pipeline needs a layer per stage, and Megatron's split something to split (Keras's tests have one Dense layer).
_EMA = "SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute"
_CUSTOM_LOOPS = ("OptimizerDistributeTest::test_ema", "OptimizerDistributeTest::test_weight_decay")
_ONE_LAYER = "DistributeTest::test_correctness_with_fit_and_regularizer"
REFUSED = {
    ("shard_optimizer_1", _EMA): "cannot be split over devices",
    ("shard_optimizer_2", _EMA): "cannot be split over devices",
    ("pipeline", _EMA): "must not exceed the model's 1 layers",
    ("pipeline", _ONE_LAYER): "must not exceed the model's 1 layers",
    ("tensor_parallel", _ONE_LAYER): "no MultiHeadAttention, no Dense pair",
    **{(kind, _EMA): "use_ema would keep each weight's moving average whole" for kind in ("tensor_parallel",
                                                                                          "layout_model")},
    **{(kind, test): "not in a custom training loop" for kind in ("tensor_parallel", "layout_model")
       for test in _CUSTOM_LOOPS},
}


def _outcomes(*kinds, env):
    proc = zygote.run([sys.executable, SCRIPT, *kinds], capture_output=True, text=True, timeout=patient(600),
                      cwd=ROOT, env=env)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# On one worker with the other test of references that never saw tfdist: one zygote without tfdist for both.
@pytest.mark.xdist_group("without_tfdist")
def test_keras_own_distribute_tests_pass_under_tfdists_kinds_where_they_pass_under_tensorflows():
    references = _outcomes("tensorflow", "tensorflow_one_replica",
                           env={**os.environ, zygote.WITHOUT_TFDIST_VARIABLE: "1"})
    passing = {name: {test for test, outcome in outcomes.items() if outcome == "passed"}
               for name, outcomes in references.items()}
    assert len(passing["tensorflow"]) >= 20 and "OptimizerDistributeTest::test_gradient_accumulation" in passing[
        "tensorflow"]
    for kind, outcomes in _outcomes(*TWO_REPLICAS, *ONE_REPLICA, env=dict(os.environ)).items():
        for test in passing["tensorflow" if kind in TWO_REPLICAS else "tensorflow_one_replica"]:
            if (kind, test) in REFUSED:
                assert REFUSED[kind, test] in outcomes[test], (kind, test, outcomes[test])
            else:
                assert outcomes[test] == "passed", (kind, test, outcomes[test])
