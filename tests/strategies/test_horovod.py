"""HorovodStrategy under horovodrun: real ranks on loopback, Gloo controller."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import HOROVODRUN, ROOT, SCENARIO_DIR, horovod_rank_pid, horovodrun, patient, run_tfdist, tfdist_imports
import zygote

SCENARIOS = os.path.join(SCENARIO_DIR, "horovod_scenarios.py")

pytestmark = pytest.mark.horovod


def _scenario(tmp_path, name, *options, np=2, expect_ok=True, controller="--gloo"):
    proc = horovodrun([sys.executable, SCENARIOS, name, str(tmp_path), *options], np=np, controller=controller)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-4000:]
    results = {}
    for rank in range(np):
        path = tmp_path / f"rank-{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return proc, results


# Each case of the scenarios that compare two ranks with one process, and its tolerance.
MATCH_CASES = {
    "matches_single_process": 1e-5,
    "matches_single_process:op=sum": 1e-5,
    "matches_single_process:accumulation=4": 1e-5,  # Keras's gradient_accumulation_steps (keras-team/keras#20582)
    "matches_single_process:clipnorm=0.01": 1e-5,  # clipped after the all-reduce, as in one process
    "matches_single_process:fp16_compression=1": 1e-3,  # float16 gradients on the wire
    "matches_single_process:embedding=1": 1e-5,  # the embedding's gradient all-gathered as rows
    "matches_single_process:embedding=1,op=sum": 1e-5,
}
UNEVEN = "matches_single_process:examples=149"
KERAS_API = ["keras_api_matches_single_process:accumulation=1", "keras_api_matches_single_process:accumulation=2"]
# mixed_float16: two ranks against one process, the second with an overflow in rank 1's part only.
LOSS_SCALING = ["loss_scaling_matches_single_process", "loss_scaling_matches_single_process:overflow_on_rank_1=1"]
# The optimizer split over the ranks: stage 2 (reduce-scatter) with each optimizer, stage 1 once, stage 3 (the
# weights split too) with those it takes; Keras's gradient accumulation at 1, 2 and 3 (the unsplit Horovod job equals
# one process: MATCH_CASES).
SPLIT_CASES = [f"split_optimizer_matches_unsplit:stage=2,optimizer={name}" for name in (
    "sgd_momentum", "adam", "adamw_excluding_biases", "adam_global_clipnorm", "mixed_float16_adam",
    "adam_accumulating_4")] + [f"split_optimizer_matches_unsplit:stage=1,optimizer={name}" for name in (
        "adam", "adam_accumulating_4")] + [f"split_optimizer_matches_unsplit:stage=3,optimizer={name}" for name in (
            "sgd_momentum", "adam", "adamw_excluding_biases", "adam_global_clipnorm", "mixed_float16_adam",
            "adamw_accumulating_4")] + [
    "split_optimizer_matches_unsplit:stage=3,optimizer=adam,recompute=1"]  # and every layer recomputed
SPLIT_RESUME = "split_optimizer_matches_unsplit:stage=2,optimizer=adam,resume=1"


# The cases run in a few 2-rank jobs, each about a minute and a half on the slowest machine (one job of them all took
# 249 s there): a slow run fails the tests of one job at most, and the jobs can run on both pytest workers.
JOBS = {
    "match": [*MATCH_CASES, UNEVEN],
    "keras": [*KERAS_API, *LOSS_SCALING],
    "split_stage_1_2": [case for case in SPLIT_CASES if "stage=3" not in case] + [SPLIT_RESUME],
    "split_stage_3": [case for case in SPLIT_CASES if "stage=3" in case],
}
JOB_OF = {case: job for job, job_cases in JOBS.items() for case in job_cases}


class _Jobs:
    """{case: {rank: result}}: a case's job runs the first time one of its cases is asked for; a job that failed
    fails its other cases' tests at once, without running again."""

    def __init__(self, tmp_path_factory):
        self._tmp_path_factory, self._results, self._failed = tmp_path_factory, {}, {}

    def __getitem__(self, case):
        job = JOB_OF[case]
        if job in self._failed:
            pytest.fail(f"the {job} job of these cases failed in an earlier test: {self._failed[job]}")
        if job not in self._results:
            try:
                _, results = _scenario(self._tmp_path_factory.mktemp(f"horovod_{job}"), "cases", *JOBS[job])
                assert sorted(results) == [0, 1]
            except (Exception, pytest.fail.Exception) as error:  # pytest-timeout's failure too
                self._failed[job] = str(error)[:2000]
                raise
            self._results[job] = results
        return {rank: result[case] for rank, result in self._results[job].items()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return _Jobs(tmp_path_factory)


def _on_its_jobs_worker(case):
    """The tests of a job's cases run on one pytest worker, so that the job runs once, within the first one's time."""
    return pytest.mark.xdist_group(f"horovod_{JOB_OF[case]}")


def _each_on_its_jobs_worker(*job_cases):
    """The cases as parameters, each on its job's worker."""
    return [pytest.param(case, marks=_on_its_jobs_worker(case)) for case in job_cases]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", _each_on_its_jobs_worker(*MATCH_CASES))
def test_two_ranks_match_one_process_with_the_global_batch(cases, case):
    results, tolerance = cases[case], MATCH_CASES[case]
    for result in results.values():
        assert result["size"] == 2
        assert result["max_abs_diff"] <= tolerance
        assert result["evaluate"] == pytest.approx(result["reference_evaluate"], abs=max(tolerance, 1e-5))
        assert result["predict_shape"] == [160, 3]  # every rank gets every row, in order
        assert result["predict_diff"] <= max(tolerance, 1e-5)
        assert result["task"] == ["worker", result["rank"], 2]  # strategy.cluster_resolver: worker 0 is rank 0
    assert results[0]["weights_checksum"] == results[1]["weights_checksum"]
    # Rank 1 was seeded differently, yet started from rank 0's weights.
    assert results[1]["initial_differs_from_seeded"]
    # An embedding's gradient stays rows (IndexedSlices), all-gathered rather than made dense.
    assert all((r["sparse_all_gathers"] > 0) == ("embedding=1" in case) for r in results.values()), results


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", _each_on_its_jobs_worker(*KERAS_API))
def test_horovod_keras_api_matches_one_process(cases, case):
    accumulation = int(case.rsplit("=", 1)[1])
    for result in cases[case].values():
        assert result["max_abs_diff"] <= 1e-5
        assert result["updates"] == 5 // accumulation
        assert result["loss_is_rank_average"]  # MetricAverageCallback averaged the logs


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", _each_on_its_jobs_worker(*LOSS_SCALING))
def test_loss_scaling_on_two_ranks_steps_and_skips_as_one_process(cases, case):
    """Keras's LossScaleOptimizer applies its update in a tf.cond, and decides from each rank's own
    gradients; both ranks must take one process's decision (an overflow anywhere skips the step)."""
    skipped = 2 if "overflow" in case else 0  # the overflowing batch comes once an epoch
    for result in cases[case].values():
        assert result["loss_scaled"] and result["steps"] == [10 - skipped] * 2, result
        assert result["scales"] == [32768.0 / 2 ** skipped] * 2, result  # halved at each skip
        assert result["max_abs_diff"] <= 2e-4, result  # float16 products over half the batch per rank


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", _each_on_its_jobs_worker(*SPLIT_CASES))
def test_an_optimizer_split_over_the_ranks_trains_the_unsplit_jobs_weights(cases, case):
    for rank, result in cases[case].items():
        updates = 20 // 4 if "accumulating_4" in case else 20  # Keras counts the updates, not the batches
        assert result["iterations"] == updates and result["max_abs_diff"] <= 1e-5, result
        report = result["report"]  # this rank's slots: those of its half of every variable
        assert report["devices"] == 2 and report["stage"] == int(case.split("stage=")[1][0])
        assert max(report["slot_bytes_per_device"]) <= 1.15 / 2 * report["unsplit_slot_bytes"]
        assert len(result["slot_devices"]) == 1
        if report["stage"] == 3:  # the kernels' 105 weights halved (53 of them), the biases' 10 whole
            assert report["weight_bytes_per_device"] == [4 * (53 + 10)], report


@_on_its_jobs_worker(SPLIT_RESUME)
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_split_job_saved_together_resumes_split_or_in_one_process_and_one_rank_alone_cannot_save_it(cases):
    for result in cases[SPLIT_RESUME].values():
        assert result["resumed_from"] == 20  # the checkpoint every rank joined, rank 0 wrote
        assert result["resumed_split_diff"] <= 1e-5 and result["resumed_alone_diff"] <= 1e-5, result
        assert "cannot be saved by one process into a Keras file" in result["keras_file_refused"]
        assert result["keras_file_resumed_diff"] <= 1e-5, result  # strategy.save_model on every rank
        assert not result["keras_file_written"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_horovod_keras_script_runs_with_only_its_import_changed_under_tfdist_launch(tmp_path):
    script = os.path.join(ROOT, "examples", "horovod_keras_digits.py")
    # The one changed line (the data aside, which tfdist ships); the rest is Horovod's API.
    assert tfdist_imports(script) == ["tfdist.horovod.tensorflow.keras", "tfdist.data"]
    # tfdist's launcher runs horovodrun (scripts under horovodrun itself: tests/horovod/test_horovod_tensorflow.py).
    proc = run_tfdist("launch", "--workers", "2", "--set", "strategy.kind=horovod", "--", sys.executable, script,
                      "--epochs", "12", "--checkpoint_dir", str(tmp_path), "--result", str(tmp_path / "accuracy.txt"),
                      timeout=360)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert float((tmp_path / "accuracy.txt").read_text()) >= 0.95
    assert "finished gradual learning rate warmup to 0.002" in proc.stdout
    assert len(list(tmp_path.glob("checkpoint-*.keras"))) == 12  # rank 0 only, once per epoch

    from tfdist.horovod.tensorflow.keras import DistributedOptimizer, load_model

    model = load_model(str(tmp_path / "checkpoint-12.keras"))
    assert isinstance(model.optimizer, DistributedOptimizer)
    assert model.optimizer.inner_optimizer.iterations.numpy() == 12 * 22


@_on_its_jobs_worker(UNEVEN)
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_uneven_data_gives_every_rank_the_same_steps(cases):
    # 149 examples, batch 32: the last batch of 21 splits 11/10 over the ranks.
    assert [r["iterations"] for r in cases[UNEVEN].values()] == [5, 5]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault,expected", [
    (signal.SIGKILL, "tfdist: error: Horovod stopped: another rank failed or exited"),
    # A scheduler's SIGTERM to one rank (no checkpoint.dir): every rank stops at the same step.
    (signal.SIGTERM, "tfdist: stopped by SIGTERM; no checkpoint.dir, so nothing was saved"),
    # Alive but stuck: the step watchdog or Horovod's stall inspector, whichever is first.
    (signal.SIGSTOP, "tfdist: error: "),
])
def test_a_rank_killed_terminated_or_stopped_ends_the_job_with_one_line_on_the_others(fault, expected):
    command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "tfdist.cli", "train",
               "--config", "configs/horovod.yaml", "--set", "train.epochs=100", "--set", "train.verbose=2",
               "--set", "horovod.stall_shutdown_seconds=10"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the CLI's own default
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Epoch 3/" in line:
                os.kill(horovod_rank_pid(proc.pid, 1), fault)
                faulted = time.monotonic()
                break
        else:
            pytest.fail("".join(lines)[-3000:])
        lines += proc.stdout.readlines()
        proc.wait(timeout=patient(120))
    finally:
        proc.kill()
    assert proc.returncode != 0 and time.monotonic() - faulted < 60
    rank0 = [line.split(":", 1)[1].strip() for line in lines if line.startswith("[0]<stderr>:") and line[12:].strip()]
    # Rank 0's own last words are one line that says what happened, not a traceback.
    errors = [line for line in rank0 if line.startswith(("tfdist: error:", "tfdist: stopped"))]
    assert len(errors) == 1 and errors[0].startswith(expected), "".join(lines)[-4000:]
    if fault == signal.SIGSTOP:
        assert "stuck" in errors[0], errors[0]
    assert not any(line.startswith("Traceback") for line in rank0), "".join(lines)[-4000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_stuck_between_steps_ends_the_other_waiting_in_the_agreement_with_one_line(tmp_path):
    # The SIGSTOP above lands where it lands; here rank 0 waits in the collective between steps for sure.
    started = time.monotonic()
    proc, _ = _scenario(tmp_path, "agreement_with_a_stuck_rank", expect_ok=False)
    rank0 = [line[12:].strip() for line in proc.stderr.splitlines() if line.startswith("[0]<stderr>:")]
    errors = [line for line in rank0 if line.startswith("tfdist: error:")]
    assert proc.returncode != 0 and time.monotonic() - started < 60, proc.stdout[-3000:]
    assert len(errors) == 1 and "stuck" in errors[0], proc.stderr[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_adasum_on_gloo_is_refused_with_the_reason(tmp_path):
    _, results = _scenario(tmp_path, "adasum_is_refused", np=1)
    assert "adasum needs Horovod's MPI controller: launch with `horovodrun --mpi`" in results[0]["error"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_adasum_under_mpi_combines_gradients_by_its_formula(tmp_path):
    _, results = _scenario(tmp_path, "adasum_matches_its_formula", controller="--mpi")
    assert sorted(results) == [0, 1]
    assert all(r["max_abs_diff"] <= 1e-5 for r in results.values())
    assert all(r["diff_from_average"] > 1e-3 for r in results.values())  # not plain averaging


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_config_trains_digits_with_two_ranks_and_only_rank_0_reports(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = horovodrun(
        [sys.executable, "-m", "tfdist.cli", "train", "--config", "configs/horovod.yaml",
         "--metrics_out", str(metrics), "--set", f"horovod.timeline={tmp_path / 'timeline.json'}"],
        timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "horovod" and result["num_replicas"] == 2
    assert result["final"]["val_accuracy"] >= 0.95
    lines = proc.stdout.splitlines()
    assert sum("tfdist summary" in line for line in lines) == 1
    assert not any(line.startswith("[1]<stdout>") for line in lines)  # rank 1 prints nothing
    assert '"name": "NEGOTIATE_ALLREDUCE"' in (tmp_path / "timeline.json").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_example_script_runs_under_horovodrun_and_only_rank_0_reports():
    proc = horovodrun([sys.executable, "examples/train_digits.py", "--config", "configs/horovod.yaml",
                       "--set", "train.epochs=6"], timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:]
    reports = [line for line in proc.stdout.splitlines() if "val_accuracy=" in line]
    assert len(reports) == 1 and reports[0].startswith("[0]")
    assert "strategy=horovod replicas=2" in reports[0]
    assert float(reports[0].rsplit("=", 1)[1]) >= 0.9


def test_learning_rate_schedule_callback_sets_the_rate_per_epoch_and_corrects_momentum():
    import keras
    import numpy as np

    from tfdist.horovod.tensorflow.keras.callbacks import LearningRateScheduleCallback, _scale_momentum

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    x, y = np.ones((16, 4), "float32"), np.zeros((16, 2), "float32")
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[LearningRateScheduleCallback(initial_lr=0.2, multiplier=0.5)])
    assert history.history["lr"] == pytest.approx([0.2, 0.1, 0.05])

    # Keras 3 SGD keeps velocity in learning-rate units: scaling it by new/old rate
    # is Horovod's momentum correction.
    velocity = model.optimizer.momentums[0]
    before = np.array(velocity.numpy())
    _scale_momentum(model.optimizer, 0.5)
    assert np.allclose(velocity.numpy(), 0.5 * before) and np.abs(before).sum() > 0

    adam = keras.optimizers.Adam()
    adam.build(model.trainable_variables)
    moments = [np.array(m.numpy()) for m in adam.variables]
    _scale_momentum(adam, 0.5)  # no velocity in rate units: left alone, as Horovod does
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(moments, adam.variables))  # exact: left untouched


def test_a_distributed_optimizer_reloads_with_its_op_and_compression():
    hvd = pytest.importorskip("horovod.tensorflow", reason="needs Horovod (make setup builds it)")
    import keras

    from tfdist.horovod.tensorflow.keras import DistributedOptimizer

    optimizer = DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, compression=hvd.Compression.fp16)
    config = optimizer.get_config()
    assert (config["op"], config["compression"]) == ("sum", "fp16")
    reloaded = DistributedOptimizer.from_config(config)
    assert reloaded.op == hvd.Sum and reloaded.compression is hvd.Compression.fp16
    assert DistributedOptimizer.from_config(DistributedOptimizer(keras.optimizers.SGD()).get_config()).op == hvd.Average


_STEP_FUNCTIONS = """
import json, keras, sys
from tfdist import HorovodStrategy
strategy = HorovodStrategy(stall_shutdown_seconds=float(sys.argv[1])) if sys.argv[1] else HorovodStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
print(json.dumps(sorted({f.__qualname__ for f in strategy.keras_hooks(model).values()})))
"""


@pytest.mark.timeout(120)
def test_a_stall_shutdown_of_0_turns_the_step_watchdog_off():
    pytest.importorskip("horovod.tensorflow", reason="needs Horovod (make setup builds it)")
    from tfdist import HorovodStrategy, load_config

    assert load_config("configs/horovod.yaml", ["horovod.stall_shutdown_seconds=0"]).horovod.stall_shutdown_seconds == 0
    assert load_config("configs/horovod.yaml").horovod.stall_shutdown_seconds == 600
    with pytest.raises(ValueError, match="`stall_shutdown_seconds` must be >= 0"):
        HorovodStrategy(stall_shutdown_seconds=-1)

    def step_functions(seconds):  # in a fresh process: Horovod of size 1, initialised once
        proc = zygote.run([sys.executable, "-c", _STEP_FUNCTIONS, seconds], capture_output=True, text=True,
                          timeout=patient(100), cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # Off: the step functions themselves (tfdist's training, Keras's evaluation); by default, the watchdog's wrappers.
    assert step_functions("0") == [
        "HorovodStrategy.keras_hooks.<locals>.predict_function", "TensorFlowTrainer._make_function.<locals>.function",
        "multi_step_function.<locals>.train_function",
    ]
    assert step_functions("") == ["StepWatchdog.wrap.<locals>.watched"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_adasum_on_gloo_from_the_cli_is_one_config_error_line():
    proc = horovodrun([sys.executable, "-m", "tfdist.cli", "train", "--config", "configs/horovod.yaml",
                       "--set", "horovod.op=adasum"], np=2, timeout=150)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "tfdist: error:" in line]
    assert errors and all("`horovod.op` adasum needs Horovod's MPI controller" in line for line in errors), proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr.split("tfdist: error:")[0]
