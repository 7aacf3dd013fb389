"""`tfdist bench sharded_optimizer`: the memory, wire and speed figures, on an MLP small enough for a test."""

import pytest

from helpers import measure_in_fresh_process

# Stage 3 splits the kernels and keeps the biases whole. The peaks come from TensorFlow's BFC allocator, which the
# bench makes the CPU's (tfdist.bench.allocator): the suite runs without oneDNN, whose allocator alone keeps them.
SMALL = "dict(repeats=1, width=256, batch=32, steps_per_round=3, keep_whole_below=1000)"


@pytest.mark.slow
def test_measure_reports_the_slots_split_n_ways_the_bytes_and_the_speed():
    result = measure_in_fresh_process("benchmarks.sharded_optimizer", SMALL)
    figures = result["figures"]
    for n in (2, 4):
        memory = result["slot_bytes_by_device"][str(n)]
        assert set(memory) == {"unsplit", "stage_1", "stage_2", "stage_3"}
        assert all(set(m) == {f"CPU:{i}" for i in range(n)} for m in memory.values())
        # Adam's two slots of (784*256 + 256 + 256*256 + 256 + 256*10 + 10) weights, whole on every device.
        assert set(memory["unsplit"].values()) == {2 * 4 * 269_322}
        gradients = result["reduced_gradient_bytes_by_device"][str(n)]
        assert set(gradients["unsplit"].values()) == {4 * 269_322}  # the whole all-reduced gradient
        for stage in ("stage_1", "stage_2", "stage_3"):
            assert figures[f"slot_bytes_share_{n}_{stage}"] == pytest.approx(1 / n, abs=0.002)  # padding
        # Stage 1 holds the whole sum before keeping its slice; stage 2 receives its slice's only.
        assert figures[f"gradient_bytes_share_{n}_stage_1"] == pytest.approx(1, abs=0.002)
        assert figures[f"gradient_bytes_share_{n}_stage_2"] == pytest.approx(1 / n, abs=0.002)
        # All-reduce + all-gather, against reduce-scatter + all-gather (an all-reduce's bytes).
        assert figures[f"wire_bytes_ratio_{n}_stage_1"] == pytest.approx(1.5, abs=0.01)
        assert figures[f"wire_bytes_ratio_{n}_stage_2"] == pytest.approx(1.0, abs=0.01)
        assert figures[f"meets_memory_target_{n}"] and figures[f"meets_wire_target_{n}"]
        # Stage 3: the kernels' 268,800 weights split (the biases' 522 whole), gathered twice a step and
        # reduce-scattered once (the biases' gradients as at stage 2); the measured peak within its target.
        weights = result["weight_bytes_by_device"][str(n)]["stage_3"]
        assert set(weights.values()) == {4 * (-(-784 * 256 // n) - (-256 * 256 // n) - (-256 * 10 // n) + 522)}
        assert figures[f"gradient_bytes_share_{n}_stage_3"] == pytest.approx(1 / n, abs=0.002)
        assert figures[f"wire_bytes_ratio_{n}_stage_3"] == pytest.approx((3 * 268_800 + 2 * 522) / (2 * 269_322),
                                                                        abs=0.01)
        assert figures[f"meets_weight_memory_target_{n}"] and figures[f"peak_share_{n}_stage_3"] < 1, result
    step_ms = result["speed"]["step_time_ms"]
    assert set(step_ms) == {"unsplit", "stage_1", "stage_2", "stage_3"} and all(t > 0 for t in step_ms.values())
    for stage in ("stage_1", "stage_2", "stage_3"):
        assert figures[f"speed_ratio_{stage}"] == pytest.approx(step_ms["unsplit"] / step_ms[stage])
    assert figures["meets_speed_target"] == (figures["speed_ratio_stage_2"] >= 0.95)
