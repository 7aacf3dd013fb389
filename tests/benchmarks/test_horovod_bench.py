"""`tfdist bench horovod`: both jobs run under horovodrun and the figures are theirs."""

import pytest

from helpers import measure_in_fresh_process, run_tfdist
from benchmarks.horovod_figures import count_gradient_allreduces

pytestmark = [pytest.mark.horovod, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_measure_compares_one_and_two_ranks_and_counts_fused_calls():
    result = measure_in_fresh_process("benchmarks.horovod_figures", "dict(repeats=1, per_rank_batch=32, image_size=8, "
                                      "width=8, epochs=1, steps_per_epoch=12, fusion_threshold_bytes=4096)")
    rate = result["samples_per_sec"]
    assert set(rate) == {"np1", "np2"} and all(value > 0 for value in rate.values())
    figures = result["figures"]
    assert figures["scaling_efficiency_np2"] == pytest.approx(rate["np2"] / (2 * rate["np1"]))
    # digits_cnn has 8 weight tensors; unfused, each is its own all-reduce.
    assert result["gradient_tensors"] == 8
    assert figures["allreduce_calls_per_step_unfused"] == 8
    assert 1 <= figures["allreduce_calls_per_step_fused"] <= figures["allreduce_calls_bound"]
    assert figures["allreduce_calls_bound"] == -(-result["gradient_bytes"] // 4096) + 1
    # The custom loops: one timing of each per repeat, the ratio of their medians.
    custom = result["custom_loop_samples_per_sec"]
    assert {name: len(values) for name, values in result["custom_loop_samples"].items()} == {
        "tape": 1, "grouped_allreduce": 1}
    assert figures["custom_loop_ratio"] == pytest.approx(custom["tape"] / custom["grouped_allreduce"])
    assert figures["custom_loop_meets_target"] == (figures["custom_loop_ratio"] >= 0.98)


def test_counting_reads_only_the_optimizers_all_reduces():
    counts = count_gradient_allreduces([
        "strategy.kind=horovod", "train.verbose=0", "train.epochs=1", "train.steps_per_epoch=2",
        "model.width=8", "horovod.fusion_threshold_bytes=67108864",
    ], steps=2)
    assert counts == {"calls_per_step": 1.0, "tensors_per_step": 8.0}  # one fused call for all 8


def test_cli_refuses_a_config():
    proc = run_tfdist("bench", "horovod", "--set", "train.epochs=2")
    assert proc.returncode == 2
    assert "`config` is not used by the horovod benchmark" in proc.stderr
