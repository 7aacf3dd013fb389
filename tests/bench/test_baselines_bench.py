"""`tfdist bench baselines`: every kind's tfdist job and hand-written job run, and the ratios are theirs."""

import pytest

from helpers import measure_in_fresh_process, run_tfdist
from tfdist.bench.baselines import KINDS, measure

pytestmark = [pytest.mark.horovod, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


def test_measure_runs_both_jobs_of_every_kind():
    # A fresh process: the overhead part sets TensorFlow's threads, which a test before it in this
    # pytest worker may have started already (so this failed whenever it was not its worker's first).
    result = measure_in_fresh_process(
        "tfdist.bench.baselines", "dict(repeats=1, per_replica_batch=16, width=8, warmup=4, steps=8, "
        "steps_per_function=4)", timeout=850)
    figures = result["figures"]
    assert set(result["kinds"]) == set(KINDS)
    for kind, measured in result["kinds"].items():
        rate = measured["samples_per_sec"]
        assert set(rate) == {"tfdist", "handwritten"} and all(v > 0 for v in rate.values()), kind
        assert figures[f"{kind}_ratio"] == pytest.approx(rate["tfdist"] / rate["handwritten"])
    for kind in ("multi_worker", "parameter_server", "horovod"):  # whole jobs, one round each
        assert {side: len(v) for side, v in result["kinds"][kind]["samples"].items()} == {
            "tfdist": 1, "handwritten": 1}
    assert "parameter_server.steps_per_execution=4" in result["kinds"]["parameter_server"]["tfdist_job"]
    assert "--steps_per_function 4" in result["kinds"]["parameter_server"]["handwritten_flags"]
    assert figures["meets_target"] == all(figures[f"{k}_ratio"] >= 0.98 for k in KINDS)
    # Where a Horovod step's time goes: each way of training over the hand-written step, from one job.
    parts = result["kinds"]["horovod"]["step_parts"]
    assert set(parts) == {"fit", "train_function", "keras_train_function", "custom_loop_under_strategy",
                          "handwritten"}
    assert all(len(values) == 1 and values[0] > 0 for values in parts.values())
    assert figures["horovod_step_parts_vs_handwritten"]["fit"] == pytest.approx(
        parts["fit"][0] / parts["handwritten"][0])


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="`kinds` must be among"):
        measure(kinds=["tpu"])


def test_cli_refuses_a_config():
    proc = run_tfdist("bench", "baselines", "--set", "train.epochs=2")
    assert proc.returncode == 2
    assert "`config` is not used by the baselines benchmark" in proc.stderr
