"""`tfdist bench overhead` writes its JSON with the ratio figure."""

import json
import math

import pytest

from helpers import run_tfdist, why_it_failed

pytestmark = pytest.mark.slow


def test_overhead_bench_writes_json(tmp_path):
    out = tmp_path / "overhead.json"
    proc = run_tfdist("bench", "overhead", "--json", str(out), "--repeats", "2", timeout=300)
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "overhead"
    assert result["num_replicas"] == 4
    assert len(result["samples"]["tfdist"]) == len(result["samples"]["handwritten"]) == 2
    assert all(t > 0 for t in result["samples"]["tfdist"] + result["samples"]["handwritten"])
    ratio = result["figures"]["ratio"]
    assert math.isfinite(ratio) and ratio > 0
    assert ratio == pytest.approx(result["step_time_ms"]["tfdist"] / result["step_time_ms"]["handwritten"])
    assert f"overhead: meets_target={ratio <= 1.02} ratio={ratio:.4g}" in proc.stdout


def test_overhead_bench_refuses_a_config_it_cannot_mirror():
    proc = run_tfdist("bench", "overhead", "--set", "model.name=mlp")
    assert proc.returncode == 2
    assert "tfdist: error: `model.name` must be digits_cnn for the overhead benchmark" in proc.stderr
