"""`tfdist bench precision`: float32 and mixed_bfloat16 jobs per kind, speed-ups against one device's."""

import pytest

from helpers import measure_in_fresh_process
from tfdist.bench import machine
from benchmarks.precision import measure

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


def test_measure_compares_each_kinds_speedup_with_one_devices():
    result = measure_in_fresh_process("benchmarks.precision", "dict(repeats=1, kinds=('one_device', 'pipeline', "
                                      "'tensor_parallel'), width=32, image_size=8, warmup=2, steps=4)")
    figures = result["figures"]
    speedup = {}
    for kind, measured in result["kinds"].items():
        rate = measured["samples_per_sec"]
        assert set(rate) == {"float32", "mixed_bfloat16"} and all(v > 0 for v in rate.values())
        assert "precision.policy=mixed_bfloat16" in measured["jobs"]["mixed_bfloat16"]
        speedup[kind] = rate["mixed_bfloat16"] / rate["float32"]
        assert figures[f"{kind}_speedup"] == pytest.approx(speedup[kind])
    for kind in ("pipeline", "tensor_parallel"):
        assert figures[f"{kind}_vs_one_device"] == pytest.approx(speedup[kind] / speedup["one_device"])
    amx = "amx_bf16" in machine.describe()["cpu_flags"]
    assert figures["target_applies"] == amx
    if amx:
        assert figures["meets_target"] == all(figures[f"{k}_vs_one_device"] >= 0.9 for k in ("pipeline",
                                                                                            "tensor_parallel"))
    else:
        assert figures["meets_target"] is None  # not applicable without AMX


def test_kinds_must_include_the_one_device_reference():
    with pytest.raises(ValueError, match="include one_device"):
        measure(kinds=("mirrored",))
