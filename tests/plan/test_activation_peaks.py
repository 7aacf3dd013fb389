"""The planner's activation bytes against TensorFlow's CPU allocator. Under pytest, not Bazel: its one job runs
for a minute, which a Bazel group starved beside pytest ran alone at the end of `make test`."""

import json
import os
import sys

import pytest

from helpers import ROOT, SCENARIO_DIR, patient, why_it_failed
import zygote


@pytest.mark.slow
def test_predicted_activation_bytes_are_within_25_percent_of_what_tensorflows_allocator_reports():
    """The CPU allocator's peak in one step, at two batch sizes (what grows with the batch: see
    tests/scenarios/activation_peaks.py), for a CNN, a transformer and MobileNetV2. The allocator counts its
    peak only with oneDNN on, which is not TensorFlow's default on every CPU: set before TensorFlow starts."""
    proc = zygote.run([sys.executable, os.path.join(SCENARIO_DIR, "activation_peaks.py")], capture_output=True,
                      text=True, timeout=patient(300), cwd=ROOT, env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"})
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, job in result.items():
        assert job["predicted_per_example"] == pytest.approx(job["measured_per_example"], rel=0.25), (name, job)
    # The layers' outputs alone miss what attention keeps inside (scores, the MLP's hidden units).
    transformer = result["transformer"]
    assert transformer["layer_outputs_per_example"] < 0.5 * transformer["measured_per_example"]
