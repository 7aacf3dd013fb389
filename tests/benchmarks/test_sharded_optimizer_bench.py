"""`tfdist bench sharded_optimizer`: the memory, wire and speed figures, on an MLP small enough for a test."""

import pytest

from helpers import measure_in_fresh_process

SMALL = "dict(repeats=1, width=32, batch=32, steps_per_round=3)"


@pytest.mark.slow
def test_measure_reports_the_slots_split_n_ways_the_bytes_and_the_speed():
    result = measure_in_fresh_process("benchmarks.sharded_optimizer", SMALL)
    figures = result["figures"]
    for n in (2, 4):
        memory = result["slot_bytes_by_device"][str(n)]
        assert set(memory) == {"unsplit", "stage_1", "stage_2"}
        assert all(set(m) == {f"CPU:{i}" for i in range(n)} for m in memory.values())
        # Adam's two slots of (784*32 + 32 + 32*32 + 32 + 32*10 + 10) weights, whole on every device.
        assert set(memory["unsplit"].values()) == {2 * 4 * 26_506}
        gradients = result["reduced_gradient_bytes_by_device"][str(n)]
        assert set(gradients["unsplit"].values()) == {4 * 26_506}  # the whole all-reduced gradient
        for stage in ("stage_1", "stage_2"):
            assert figures[f"slot_bytes_share_{n}_{stage}"] == pytest.approx(1 / n, abs=0.002)  # padding
        # Stage 1 holds the whole sum before keeping its slice; stage 2 receives its slice's only.
        assert figures[f"gradient_bytes_share_{n}_stage_1"] == pytest.approx(1, abs=0.002)
        assert figures[f"gradient_bytes_share_{n}_stage_2"] == pytest.approx(1 / n, abs=0.002)
        # All-reduce + all-gather, against reduce-scatter + all-gather (an all-reduce's bytes).
        assert figures[f"wire_bytes_ratio_{n}_stage_1"] == pytest.approx(1.5, abs=0.01)
        assert figures[f"wire_bytes_ratio_{n}_stage_2"] == pytest.approx(1.0, abs=0.01)
        assert figures[f"meets_memory_target_{n}"] and figures[f"meets_wire_target_{n}"]
    step_ms = result["speed"]["step_time_ms"]
    assert set(step_ms) == {"unsplit", "stage_1", "stage_2"} and all(t > 0 for t in step_ms.values())
    for stage in ("stage_1", "stage_2"):
        assert figures[f"speed_ratio_{stage}"] == pytest.approx(step_ms["unsplit"] / step_ms[stage])
    assert figures["meets_speed_target"] == (figures["speed_ratio_stage_2"] >= 0.95)
