"""`tfdist bench tensor_parallel`: the figures, on an MLP small enough for a test."""

import pytest

from helpers import measure_in_fresh_process, run_tfdist

SMALL = "dict(repeats=1, width=64, hidden=256, batch=32, steps_per_round=2)"


@pytest.mark.slow
def test_measure_reports_every_figure():
    result = measure_in_fresh_process("benchmarks.tensor_parallel", SMALL)
    figures, step_ms = result["figures"], result["step_time_ms"]
    assert set(step_ms) == {"tensor_parallel", "one_device", "tensor_parallel_forward", "one_device_forward"}
    assert all(t > 0 for t in step_ms.values())
    assert figures["speedup"] == pytest.approx(step_ms["one_device"] / step_ms["tensor_parallel"])
    assert figures["speedup_forward"] == pytest.approx(
        step_ms["one_device_forward"] / step_ms["tensor_parallel_forward"]
    )
    assert figures["bound"] == 2.0
    assert figures["meets_speedup_target"] == (figures["speedup"] >= 1.8)
    # Each device holds half of the MLP's kernels (the output bias, 64 floats, is whole on both).
    assert set(result["variable_bytes_per_device"]) == {"CPU:0", "CPU:1"}
    assert figures["max_device_share"] == pytest.approx(0.5, abs=0.01)


def test_cli_refuses_a_config():
    proc = run_tfdist("bench", "tensor_parallel", "--set", "train.epochs=2")
    assert proc.returncode == 2
    assert "`config` is not used by the tensor_parallel benchmark" in proc.stderr
