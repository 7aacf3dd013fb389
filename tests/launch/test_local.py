"""`tfdist launch`: every task of a job from one command, its output, its failures, its signals."""

import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

import zygote
from helpers import ROOT, launch_job, launch_output, launch_output_after, processes_with, read_until, run_tfdist, task_pid

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MULTI_WORKER = ["--config", "configs/default.yaml", "--set", "strategy.kind=multi_worker_mirrored",
                "--set", "train.steps_per_epoch=6"]


SPLIT = ["--set", "strategy.shard_optimizer=1"]


def assert_the_plan_predicted_what_each_worker_holds(result, config, overrides):
    """`tfdist plan`'s memory for the job (2 processes, a device each, the optimizer state split) within 5%
    of what the chief's device holds: its weights and its slice of the optimizer's slots."""
    from tfdist.config import load_config
    from tfdist.plan import Cluster, Layout, profile
    from tfdist.plan.predict import predict

    model = profile(load_config(os.path.join(ROOT, config), overrides))
    memory = predict(model, Cluster(devices=2, hosts=2, device_flops=1.0, link=1e9), Layout(2, zero=1),
                     global_batch=64, micro_batches=1).memory
    held = result["optimizer_state"]["slot_bytes_per_device"]
    assert memory["weights"] == pytest.approx(result["trainable_bytes"], rel=0.05)
    assert len(held) == 1 and memory["optimizer"] == pytest.approx(held[0], rel=0.05), (memory, result)


def test_a_multi_worker_job_runs_from_one_command_with_its_progress_bar_and_leaves_nothing(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = launch_job(metrics, "--workers", "2", *MULTI_WORKER, *SPLIT, "--set", "train.epochs=2", terminal=True)
    out, err = launch_output(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "multi_worker_mirrored" and result["num_replicas"] == 2
    assert result["input_sharding"] == "record (2 input pipelines)"  # digits are arrays: no files to count
    assert_the_plan_predicted_what_each_worker_holds(result, "configs/default.yaml", ["strategy.shard_optimizer=1"])
    # The chief's bar redraws in place (a carriage return not ending a line) and its summary shows once.
    assert re.search(r"\r(?!\n)", out) and out.count("tfdist summary") == 1
    assert processes_with(str(metrics)) == []


def test_a_parameter_server_job_stops_its_servers_when_the_chief_is_done(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = launch_job(metrics, "--workers", "2", "--ps", "1", "--config", "configs/parameter_server.yaml",
                   "--set", "train.epochs=3")
    out, err = launch_output(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(metrics.read_text())
    assert result["cluster"] == "2 worker(s), 1 parameter server(s)"  # the launcher's, not a local cluster
    # It trained (chance is 0.1). How far asynchronous updates get in 3 epochs depends on how the workers were
    # scheduled (0.8997 once on a loaded machine): not what this test is about.
    assert result["final"]["val_accuracy"] >= 0.5
    assert processes_with(str(metrics)) == []


@pytest.mark.horovod
def test_a_horovod_job_runs_horovodrun_for_you(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = launch_job(metrics, "--workers", "2", "--config", "configs/horovod.yaml", *SPLIT, "--set", "train.epochs=2")
    out, err = launch_output(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(metrics.read_text())
    assert result["num_replicas"] == 2
    assert_the_plan_predicted_what_each_worker_holds(result, "configs/horovod.yaml", ["strategy.shard_optimizer=1"])
    assert out.count("tfdist summary") == 1 and "<stdout>" not in out  # rank 0 unprefixed, as a plain run
    assert processes_with(str(metrics)) == []


HOROVOD = ["--config", "configs/horovod.yaml"]
_SIGKILL, _SIGSTOP, _SIGTERM = signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM


def _case(name, flags, variable, value, fault, expected, code, within, horovod=False, checkpoints=True):
    return pytest.param(flags, variable, value, fault, expected, code, within, checkpoints, id=name,
                        marks=[pytest.mark.horovod] if horovod else [])


@pytest.mark.parametrize("flags,variable,value,fault,expected,code,within,checkpoints", [
    # A killed worker's peer is stopped at once (it cannot finish a collective), not after 10 s of grace.
    _case("multi_worker-killed", MULTI_WORKER, "TF_CONFIG", '"index": 1', _SIGKILL,
          "worker 1 failed (killed by SIGKILL)", 137, 8),
    _case("horovod-killed", HOROVOD, "HOROVOD_RANK", "1", _SIGKILL, "rank 1 failed (exit code 137, SIGKILL)", 137, 60,
          horovod=True),
    # A stopped task is named, not the peer that timed out waiting for it.
    _case("multi_worker-stopped", MULTI_WORKER, "TF_CONFIG", '"index": 1', _SIGSTOP, "worker 1 ", None, 45),
    _case("horovod-stopped", HOROVOD, "HOROVOD_RANK", "1", _SIGSTOP, "rank 1 ", None, 45, horovod=True),
    # A preempted task is named, not the first to exit 75 after it.
    _case("multi_worker-preempted", MULTI_WORKER, "TF_CONFIG", '"index": 1', _SIGTERM,
          "worker 1 preempted (SIGTERM): every task saved the checkpoint and exited 75", 75, 60),
    _case("horovod-preempted", HOROVOD, "HOROVOD_RANK", "1", _SIGTERM,
          "rank 1 preempted (SIGTERM): every task saved the checkpoint and exited 75", 75, 60, horovod=True),
    # Without checkpoint.dir a SIGTERM still stops the job (TensorFlow's notifier swallowed it: the task trained on).
    _case("multi_worker-terminated", MULTI_WORKER, "TF_CONFIG", '"index": 1', _SIGTERM,
          "worker 1 stopped by SIGTERM: every task stopped at the same step and exited 143", 143, 60,
          checkpoints=False),
])
def test_the_task_that_failed_stalled_or_was_preempted_is_named_in_one_line(
        tmp_path, flags, variable, value, fault, expected, code, within, checkpoints):
    metrics = tmp_path / "metrics.json"
    checkpoint_dir = ["--set", f"checkpoint.dir={tmp_path / 'checkpoints'}"] * checkpoints
    stall = ["--stalled_seconds", "6"] if fault == _SIGSTOP else []
    proc = launch_job(metrics, "--workers", "2", *stall, *flags, "--set", "train.epochs=100", "--set",
                      "train.verbose=2", *checkpoint_dir, real_tasks=fault == _SIGSTOP)
    try:
        read_until(proc, "Epoch 3/")
        os.kill(task_pid(str(metrics), variable, value), fault)
        faulted = time.monotonic()
        out, err = launch_output(proc, timeout=120)
    finally:
        proc.kill()
    elapsed = time.monotonic() - faulted
    lines = err.strip().splitlines()
    assert lines[-1].startswith("tfdist launch: error: " + expected), err[-3000:]
    if fault == _SIGSTOP:
        assert "SIGSTOP" in lines[-1] and proc.returncode != 0, lines[-1]
        assert "stopped (SIGSTOP) for 6 s" in lines[-1] or "stalled the job" in lines[-1], lines[-1]
    else:
        assert proc.returncode == code, err[-3000:]
    assert elapsed < within, (elapsed, err[-3000:])
    assert "Traceback" not in err  # not horovodrun's, not a task's
    assert processes_with(str(metrics)) == []


def test_sigterm_to_the_launcher_reaches_every_task(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = launch_job(metrics, "--workers", "2", "--ps", "1", "--config", "configs/parameter_server.yaml",
                   "--set", "train.epochs=100", "--set", "train.verbose=2")
    out, err = launch_output_after(proc, "Epoch 2/", lambda: proc.send_signal(signal.SIGTERM))
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "tfdist launch: stopped by SIGTERM; stopped every task"
    assert processes_with(str(metrics)) == []


GUIDE = [sys.executable, "examples/guide_multi_worker_keras.py", "--epochs", "2", "--steps_per_epoch", "5"]


def _weights(path):
    import keras

    return keras.models.load_model(path).get_weights()


def test_a_users_own_script_runs_as_every_task_and_trains_as_on_one_device(tmp_path):
    """TensorFlow's multi-worker guide, its strategy line changed, launched as `tfdist launch -- python ...`."""
    one = run_tfdist("launch", "--set", "strategy.kind=one_device", "--", *GUIDE, "--set", "strategy.kind=one_device",
                     "--per_worker_batch", "128", "--model_path", str(tmp_path / "one.keras"),
                     "--backup_dir", str(tmp_path / "backup-one"), timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    # No kind given to the launcher: several workers make a multi-worker job, as torchrun's do.
    two = run_tfdist("launch", "--workers", "2", "--", *GUIDE, "--set", "strategy.kind=multi_worker_mirrored",
                     "--model_path", str(tmp_path / "two.keras"), "--backup_dir", str(tmp_path / "backup"), timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stderr.startswith("tfdist launch: no strategy.kind given: 2 workers as "
                                 "strategy.kind=multi_worker_mirrored (--set strategy.kind=... chooses another)\n")
    assert "[worker 1] Epoch 2/2" in two.stdout and "\nEpoch 2/2" in two.stdout  # worker 0 reports unprefixed
    # The same global batch of 128 on one device and on two workers of 64: the same weights.
    for one_device, two_workers in zip(_weights(tmp_path / "one.keras"), _weights(tmp_path / "two.keras")):
        np.testing.assert_allclose(two_workers, one_device, atol=1e-5)
    # Worker 1 saved to a scratch copy it deleted; the chief deleted the backup once done (BackupAndRestore
    # writes from the chief alone: two workers writing one file failed on h5py's lock).
    assert sorted(os.listdir(tmp_path)) == ["one.keras", "two.keras"]


@pytest.mark.parametrize("flags", [pytest.param(MULTI_WORKER, id="multi_worker"),
                                   pytest.param(HOROVOD, id="horovod", marks=pytest.mark.horovod)])
def test_a_launcher_killed_outright_takes_every_task_with_it(tmp_path, flags):
    from tfdist.launch.guard import GRACE_SECONDS

    metrics, checkpoints = tmp_path / "metrics.json", tmp_path / "checkpoints"
    # Silent tasks: a task that writes to the dead launcher's pipe dies of it, one that does not trains on.
    proc = launch_job(metrics, "--workers", "2", *flags, "--set", "train.epochs=100", "--set", "train.verbose=0",
                      "--set", f"checkpoint.dir={checkpoints}")
    try:
        started = time.monotonic()
        while not (checkpoints.exists() and any(checkpoints.iterdir())):  # an epoch trained
            assert proc.poll() is None and time.monotonic() - started < 240, launch_output(proc)
            time.sleep(0.5)
        assert processes_with(str(metrics))  # the tasks (and under Horovod, horovodrun and its ranks) run
        zygote.send_signal(proc, signal.SIGKILL)  # no cleanup of its own
        killed = time.monotonic()
        while processes_with(str(metrics)) and time.monotonic() - killed < 3 * GRACE_SECONDS:
            time.sleep(0.5)
        assert processes_with(str(metrics)) == [], f"left running {time.monotonic() - killed:.0f} s after"
        assert time.monotonic() - killed < GRACE_SECONDS + 3
    finally:
        proc.kill()
    assert not metrics.exists()  # no task trained on to the end


@pytest.mark.parametrize("flags,message", [
    (["--workers", "2", "--set", "strategy.kind=mirrored"],
     "`--workers` must be 1: strategy.kind=mirrored runs in one process"),
    (["--workers", "2", "--config", "configs/default.yaml"],  # its kind is mirrored
     "`--workers` must be 1: strategy.kind=mirrored runs in one process"),
    (["--workers", "0", *MULTI_WORKER], "`--workers` must be at least 1"),
    (["--workers", "2", "--ps", "1", *MULTI_WORKER], "`--ps` only applies with strategy.kind=parameter_server"),
    (["--workers", "2", *MULTI_WORKER, "--set", "cluster.workers=[127.0.0.1:1]"], "`cluster.workers` must be empty"),
])
def test_counts_that_do_not_fit_the_kind_are_one_line(flags, message):
    proc = run_tfdist("launch", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tfdist: error: " + message), lines


@pytest.mark.parametrize("reported", [[(0, 1), (1, 137)], [(1, 137), (0, 1)]])
def test_a_horovod_job_names_the_rank_that_failed_not_the_one_that_lost_it(reported):
    """Rank 0, seeing rank 1 go, can exit before horovodrun reaps the killed rank 1; rank 1 is named either way."""
    import io

    from tfdist.launch.local import Task, _Job

    horovodrun = Task("horovodrun", 0, ["horovodrun"], {})
    job = _Job([horovodrun], io.StringIO(), io.StringIO(), None)
    job._label(horovodrun, "[0]<stderr>:tfdist: error: Horovod stopped: another rank failed or exited "
                           "(its collective could not complete).\n")
    for rank, code in reported:
        job._label(horovodrun, f"Process {rank} exit with status code {code}.\n")
    line, code = job._failure(horovodrun, 1, [])
    assert line == "rank 1 failed (exit code 137, SIGKILL); horovodrun stopped the other ranks" and code == 137
