"""`tfdist bench pipeline`: the figures, on a model small enough for a test."""

import pytest

from helpers import measure_in_fresh_process, run_tfdist
from benchmarks.pipeline import bound

SMALL = "dict(repeats=1, width=64, layers=4, batch=64, steps_per_round=2)"


def test_bound_is_gpipes_formula():
    assert bound(2, 1) == 1.0
    assert bound(2, 8) == pytest.approx(16 / 9)
    assert bound(4, 4) == pytest.approx(16 / 7)


@pytest.mark.slow
def test_measure_reports_every_figure():
    result = measure_in_fresh_process("benchmarks.pipeline", SMALL)
    figures, step_ms, serial = result["figures"], result["step_time_ms"], result["serial_step_time_ms"]
    assert set(step_ms) == {"naive_m1", "m8_1f1b_first_device"} | {
        f"m{m}_{s}" for m in (2, 4, 8) for s in ("gpipe", "1f1b")
    }
    assert set(serial) == {"naive_m1", "m8_1f1b"}
    assert all(t > 0 for t in list(step_ms.values()) + list(serial.values()))
    assert figures["bound_m8"] == pytest.approx(16 / 9)
    assert figures["speedup_m8_1f1b"] == pytest.approx(step_ms["naive_m1"] / step_ms["m8_1f1b"])
    assert figures["speedup_m8_gpipe"] == pytest.approx(step_ms["naive_m1"] / step_ms["m8_gpipe"])
    assert figures["concurrency_m8_1f1b"] == pytest.approx(serial["m8_1f1b"] / step_ms["m8_1f1b"])
    # 1F1B keeps at most K=2 of the 8 micro-batches alive on a stage; GPipe all 8.
    assert result["peak_stashed_micro_batches"]["m8_1f1b"] == [2, 1]
    assert result["peak_stashed_micro_batches"]["m8_gpipe"] == [8, 8]
    assert figures["stash_ratio_1f1b_vs_gpipe"] == 0.25
    assert figures["meets_stash_target"] is True
    assert figures["meets_speedup_target"] == (figures["efficiency_m8_1f1b"] >= 0.95)
    # Each stage's weights and Adam slots on its own device: about 1/K of each on every device.
    for k in (2, 4):
        held = result["bytes_by_device"][f"k{k}"]
        assert len(held["params"]) == len(held["optimizer"]) == k
        assert figures[f"max_device_share_params_k{k}"] == max(held["params"].values()) / sum(held["params"].values())
        assert 1 / k <= figures[f"max_device_share_params_k{k}"] <= 1.15 / k
        assert 1 / k <= figures[f"max_device_share_optimizer_k{k}"] <= 1.15 / k
    assert figures["meets_memory_target"] is True
    # Stage 1 (2 of the 4 Dense 64x64 layers) read from the first device once per micro-batch, before.
    assert figures["weight_bytes_copied_per_step_first_device"] == 8 * 2 * (64 * 64 + 64) * 4
    assert figures["weight_bytes_copied_per_step"] == 0 and figures["meets_copy_target"] is True
    assert figures["step_vs_first_device_m8_1f1b"] == pytest.approx(step_ms["m8_1f1b"] / step_ms["m8_1f1b_first_device"])


def test_cli_refuses_a_config():
    proc = run_tfdist("bench", "pipeline", "--set", "train.epochs=2")
    assert proc.returncode == 2
    assert "`config` is not used by the pipeline benchmark" in proc.stderr
