"""`tfdist bench checkpoint` writes its JSON: the step-time ratio with checkpoints every 100 steps."""

import json
import math

import pytest

from helpers import run_tfdist, why_it_failed

pytestmark = pytest.mark.slow


def test_checkpoint_bench_times_rounds_with_and_without_saves(tmp_path):
    out = tmp_path / "checkpoint.json"
    # A one-device job keeps the test short; `make bench` measures the default mirrored one.
    proc = run_tfdist("bench", "checkpoint", "--json", str(out), "--repeats", "1", "--set", "strategy.kind=one_device",
                      "--set", "train.verbose=0", timeout=300)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "checkpoint" and result["every_steps"] == 100
    assert result["steps_per_round"] > 2 * result["every_steps"]  # two saves inside the timed steps
    figures = result["figures"]
    ratio = figures["ratio"]
    assert math.isfinite(ratio) and ratio == pytest.approx(
        result["mean_step_time_ms"]["checkpointed"] / result["mean_step_time_ms"]["plain"])
    assert figures["save_ms"] > 0
    assert figures["ratio_from_parts"] == pytest.approx(
        1 + figures["save_ms"] / (100 * result["mean_step_time_ms"]["plain"]))
    # Weights, Adam's two slots per weight and the metrics: more than 3 x the digits CNN's float32 weights.
    assert figures["checkpoint_bytes"] > 3 * 4 * 20000
    assert f"ratio={ratio:.4g}" in proc.stdout and "machine" in result
