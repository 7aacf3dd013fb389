"""`tfdist bench data_parallel_pipeline`: 1- and 2-process pipeline jobs run and the efficiency is theirs."""

import pytest

from helpers import measure_in_fresh_process

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.horovod, pytest.mark.timeout(600)]


def test_measure_compares_one_process_with_two():
    result = measure_in_fresh_process("benchmarks.data_parallel_pipeline",
                                      "dict(repeats=1, epochs=1, steps_per_epoch=12, per_process_batch=32, width=8)")
    rate = result["samples_per_sec"]
    assert set(rate) == {"np1", "np2"} and all(value > 0 for value in rate.values())
    figures = result["figures"]
    assert figures["scaling_efficiency_np2"] == pytest.approx(rate["np2"] / (2 * rate["np1"]))
    assert figures["samples_per_sec_per_process_np2"] == pytest.approx(rate["np2"] / 2)
    assert "strategy.data_parallel=horovod" in result["jobs"]["np2"]
    assert "train.global_batch_size=64" in result["jobs"]["np2"]  # the same batch per process
    assert "train.global_batch_size=32" in result["jobs"]["np1"]
