"""`tfdist bench sharded_optimizer`: the memory, wire and speed figures, on an MLP small enough for a test."""

import pytest

from helpers import measure_in_fresh_process

SMALL = "dict(repeats=1, width=32, batch=32, steps_per_round=3)"


@pytest.mark.slow
def test_measure_reports_the_slots_split_n_ways_the_bytes_and_the_speed():
    result = measure_in_fresh_process("tfdist.bench.sharded_optimizer", SMALL)
    figures = result["figures"]
    for n in (2, 4):
        memory = result["slot_bytes_by_device"][str(n)]
        assert set(memory["split"]) == set(memory["unsplit"]) == {f"CPU:{i}" for i in range(n)}
        # Adam's two slots of (784*32 + 32 + 32*32 + 32 + 32*10 + 10) weights, whole on every device.
        assert set(memory["unsplit"].values()) == {2 * 4 * 26_506}
        assert figures[f"slot_bytes_share_{n}"] == pytest.approx(1 / n, abs=0.002)  # padding: < 1 float/slice
        assert figures[f"meets_memory_target_{n}"]
        assert figures[f"wire_bytes_ratio_{n}"] == pytest.approx(1.5, abs=0.01)  # all-reduce + all-gather
    step_ms = result["speed"]["step_time_ms"]
    assert set(step_ms) == {"split", "unsplit"} and all(t > 0 for t in step_ms.values())
    assert figures["speed_ratio"] == pytest.approx(step_ms["unsplit"] / step_ms["split"])
    assert figures["meets_speed_target"] == (figures["speed_ratio"] >= 0.95)
