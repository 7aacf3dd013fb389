"""`tfdist bench baselines`: every kind's tfdist job and hand-written job run, and the ratios are theirs."""

import pytest

from helpers import measure_in_fresh_process, run_tfdist
from benchmarks.baselines import KINDS, measure

MULTI_PROCESS = [kind for kind in KINDS if kind != "mirrored"]

pytestmark = [pytest.mark.horovod, pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]


def test_measure_runs_both_jobs_of_every_multi_process_kind():
    # A fresh process: the jobs' timings, apart from whatever this pytest worker ran before.
    result = measure_in_fresh_process(
        "benchmarks.baselines", f"dict(repeats=1, per_replica_batch=16, width=8, warmup=4, steps=8, "
        f"steps_per_function=4, kinds={MULTI_PROCESS!r})", timeout=850)
    figures = result["figures"]
    assert set(result["kinds"]) == set(MULTI_PROCESS)
    for kind, measured in result["kinds"].items():
        rate = measured["samples_per_sec"]
        assert set(rate) == {"tfdist", "handwritten"} and all(v > 0 for v in rate.values()), kind
        assert figures[f"{kind}_ratio"] == pytest.approx(rate["tfdist"] / rate["handwritten"])
    for kind in ("multi_worker", "parameter_server", "horovod"):  # whole jobs, one round each
        assert {side: len(v) for side, v in result["kinds"][kind]["samples"].items()} == {
            "tfdist": 1, "handwritten": 1}
    assert "parameter_server.steps_per_execution=4" in result["kinds"]["parameter_server"]["tfdist_job"]
    assert "--steps_per_function 4" in result["kinds"]["parameter_server"]["handwritten_flags"]
    assert figures["meets_target"] == all(figures[f"{k}_ratio"] >= 0.98 for k in MULTI_PROCESS)
    # Where a Horovod step's time goes: each way of training over the hand-written step, from one job.
    parts = result["kinds"]["horovod"]["step_parts"]
    assert set(parts) == {"fit", "train_function", "keras_train_function", "custom_loop_under_strategy",
                          "handwritten"}
    assert all(len(values) == 1 and values[0] > 0 for values in parts.values())
    assert figures["horovod_step_parts_vs_handwritten"]["fit"] == pytest.approx(
        parts["fit"][0] / parts["handwritten"][0])


def test_the_mirrored_kind_is_the_overhead_benchmarks_run(monkeypatch):
    """`tfdist bench overhead` itself is run by its own test (tests/bench/test_overhead.py)."""
    from benchmarks import baselines
    from tfdist.bench import overhead

    calls = []
    monkeypatch.setattr(overhead, "run", lambda **kwargs: calls.append(kwargs) or {
        "samples_per_sec": {"tfdist": 99.0, "handwritten": 100.0}, "figures": {"ratio": 1.01}})
    result = baselines.measure(kinds=["mirrored"], repeats=2)
    assert calls == [{"repeats": 2}]
    assert result["kinds"]["mirrored"] == {"samples_per_sec": {"tfdist": 99.0, "handwritten": 100.0},
                                           "overhead": {"ratio": 1.01}}
    assert result["figures"]["mirrored_ratio"] == pytest.approx(0.99)
    assert result["figures"]["meets_target"] is True


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="`kinds` must be among"):
        measure(kinds=["tpu"])


def test_cli_refuses_a_config():
    proc = run_tfdist("bench", "baselines", "--set", "train.epochs=2")
    assert proc.returncode == 2
    assert "`config` is not used by the baselines benchmark" in proc.stderr
