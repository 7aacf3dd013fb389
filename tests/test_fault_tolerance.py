"""Lose nothing: `tfdist train` killed at random moments, or preempted, resumes to the uninterrupted weights."""

import json
import os
import random
import re
import signal
import subprocess
import time

import pytest

from helpers import ROOT, patient, task_pid, tfdist_command, why_it_failed
import zygote
from tfdist.callbacks import EXIT_PREEMPTED
from tfdist.checkpoint_store import CheckpointStore

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# One device keeps each of the many restarts short. 10 epochs of 22 steps: 20 kills, each up to ~6 saved steps
# after the last, must all land before the end.
JOB = ["--config", "configs/default.yaml", "--set", "strategy.kind=one_device", "--set", "train.epochs=10",
       "--set", "train.verbose=0", "--set", "callbacks.throughput_warmup_steps=1"]


def _start(directory, metrics, *sets, log=None):
    args = [*JOB, *(f"--set={s}" for s in sets), "--set", f"checkpoint.dir={directory}", "--metrics_out", str(metrics)]
    return zygote.Popen(tfdist_command("train", *args), cwd=ROOT, stdout=subprocess.DEVNULL,
                        stderr=log or subprocess.PIPE, text=True,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def _digest(metrics):
    result = json.loads(metrics.read_text())
    return result["final_weights_digest"], result["resumed_from_step"]


def _wait_for_checkpoint_after(store, step, process, timeout=120):
    timeout = patient(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = store.steps()
        if steps and steps[0] > step:
            return steps
        assert process.poll() is None, f"the job ended (exit {process.returncode}) before saving past step {step}"
        time.sleep(0.02)
    pytest.fail(f"no checkpoint after step {step} within {timeout} s")


# The tests that compare with the uninterrupted job run on one pytest worker, so it runs once.
uninterrupted_once = pytest.mark.xdist_group("uninterrupted_job")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    process = _start(tmp / "ckpt", tmp / "metrics.json", "checkpoint.every_steps=1")
    _, err = process.communicate(timeout=patient(300))
    assert process.returncode == 0, err[-3000:]
    return _digest(tmp / "metrics.json")[0]


@uninterrupted_once
@pytest.mark.timeout(900)
def test_twenty_sigkills_at_random_moments_lose_nothing(tmp_path, uninterrupted):
    rng = random.Random(18)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    newest, kills, during_save = 0, 0, 0
    log = open(tmp_path / "stderr.log", "w")
    while kills < 20:
        process = _start(tmp_path / "ckpt", tmp_path / "metrics.json", "checkpoint.every_steps=1",
                         "checkpoint.keep=1000", log=log)
        steps = _wait_for_checkpoint_after(store, newest, process)
        assert min(s for s in steps if s > newest) == newest + 1, "the restart did not resume from the newest checkpoint"
        time.sleep(rng.uniform(0, 0.3))  # saves every step: many kills land during one
        zygote.send_signal(process, signal.SIGKILL)  # the training process itself, forked or not
        process.wait(timeout=patient(30))
        kills += 1
        during_save += any(name.startswith(".tmp-") for name in os.listdir(store.directory))
        newest = store.steps()[0]
        files = os.listdir(store.path(newest))
        assert "meta.json" in files and "state.index" in files, files  # complete, or not there at all
    process = _start(tmp_path / "ckpt", tmp_path / "metrics.json", "checkpoint.every_steps=1", log=log)
    assert process.wait(timeout=patient(300)) == 0
    log.close()
    digest, resumed_from = _digest(tmp_path / "metrics.json")
    assert resumed_from == newest and digest == uninterrupted
    assert "cannot be read" not in (tmp_path / "stderr.log").read_text()
    print(f"{kills} kills, {during_save} during a save; resumed last from step {newest}")


@uninterrupted_once
@pytest.mark.timeout(600)
def test_sigterm_saves_at_the_step_it_stopped_and_exits_for_a_retry(tmp_path, uninterrupted):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    process = _start(tmp_path / "ckpt", tmp_path / "metrics.json", "checkpoint.every_steps=20",
                     "checkpoint.grace_seconds=20")
    _wait_for_checkpoint_after(store, 0, process)  # step 20: training is under way
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = process.communicate(timeout=patient(60))
    assert process.returncode == EXIT_PREEMPTED and time.monotonic() - sent < 20
    stopped_at = store.steps()[0]
    assert stopped_at > 20
    assert err.strip().splitlines()[-1] == (
        f"tfdist: preempted (SIGTERM): saved the checkpoint of step {stopped_at} in {store.directory}; "
        f"exiting {EXIT_PREEMPTED} so that the job is run again, and it resumes there")
    process = _start(tmp_path / "ckpt", tmp_path / "metrics.json", "checkpoint.every_steps=20")
    _, err = process.communicate(timeout=patient(300))
    assert process.returncode == 0, err[-3000:]
    assert _digest(tmp_path / "metrics.json") == (uninterrupted, stopped_at)


@pytest.mark.timeout(300)
def test_sigterm_saves_with_nobody_reading_its_lines(tmp_path):
    """A launched task whose launcher was killed outright gets SIGTERM from its guard, and nobody reads its lines:
    the line announcing the save meets a closed pipe (EPIPE). The save goes on; the BrokenPipeError ended it."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    process = _start(tmp_path / "ckpt", tmp_path / "metrics.json", "checkpoint.every_steps=20",
                     "checkpoint.grace_seconds=20")
    _wait_for_checkpoint_after(store, 0, process)  # step 20: training is under way
    process.stderr.close()  # the reader is gone
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=patient(60)) == EXIT_PREEMPTED
    assert store.steps()[0] > 20


@uninterrupted_once
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.timeout(600)
def test_a_full_disk_during_a_save_is_one_line_and_the_rerun_resumes_exactly(tmp_path, uninterrupted):
    disk = tmp_path / "disk"  # room for one checkpoint of the digits CNN and its Adam slots (about 460 KB), not two
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=720k", "tfdist-test-full-disk", str(disk)], check=True)
    try:
        store = CheckpointStore(str(disk))
        # Preempted, and its save does not fit: exit 75 all the same (a scheduler requeues on it), since a rerun
        # resumes from the checkpoint before.
        process = _start(disk, tmp_path / "metrics.json", "checkpoint.every_steps=20", "checkpoint.keep=1")
        _wait_for_checkpoint_after(store, 0, process)  # step 20
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=patient(60))
        assert process.returncode == EXIT_PREEMPTED and store.steps() == [20], err[-3000:]
        assert re.fullmatch(rf"tfdist: error: preempted \(SIGTERM\) and could not write the checkpoint of step \d+ to "
                            rf"{disk} \(.*No space left on device\); a rerun resumes from step 20: exiting "
                            rf"{EXIT_PREEMPTED} so that the job is run again", err.strip().splitlines()[-1]), err
        process = _start(disk, tmp_path / "metrics.json", "checkpoint.every_steps=20", "checkpoint.keep=1")
        _, err = process.communicate(timeout=patient(300))
        saved = store.steps()
        assert process.returncode == 1 and saved, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert re.fullmatch(rf"tfdist: error: could not write the checkpoint of step {saved[0] + 20} to {disk} "
                            rf"\(.*No space left on device.*\); a rerun resumes from step {saved[0]}\.", last), err
        assert "Traceback" not in err
        assert not [name for name in os.listdir(disk) if name.startswith(".tmp-")]  # the failed save freed its room
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        process = _start(disk, tmp_path / "metrics.json", "checkpoint.every_steps=20", "checkpoint.keep=1")
        _, err = process.communicate(timeout=patient(300))
        assert process.returncode == 0, err[-3000:]
        assert _digest(tmp_path / "metrics.json") == (uninterrupted, saved[0])
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def _launch(directory, metrics, *flags, tmpdir=None):
    args = ["launch", "--workers", "2", *flags, "--set", "train.epochs=2", "--set", "train.verbose=0",
            "--set", "checkpoint.every_steps=5", "--set", f"checkpoint.dir={directory}", "--metrics_out", str(metrics)]
    return zygote.Popen(tfdist_command(*args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                                            **({"TMPDIR": str(tmpdir)} if tmpdir else {})})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags,variable,value,task", [
    (["--config", "configs/default.yaml", "--set", "strategy.kind=multi_worker_mirrored"], "TF_CONFIG",
     '"index": 1', "worker"),
    pytest.param(["--config", "configs/horovod.yaml"], "HOROVOD_RANK", "1", "rank", marks=pytest.mark.horovod),
])
def test_a_two_process_job_killed_then_preempted_restarts_and_ends_as_if_uninterrupted(
        tmp_path, flags, variable, value, task):
    whole = _launch(tmp_path / "whole", tmp_path / "whole.json", *flags)
    _, err = whole.communicate(timeout=patient(300))
    assert whole.returncode == 0, err[-3000:]
    store = CheckpointStore(str(tmp_path / "job"))
    # One restart allowed: the preemption after the kill must not use one up.
    scratch = tmp_path / "tmp"  # the tasks' temporary directory
    scratch.mkdir()
    job = _launch(store.directory, tmp_path / "job.json", "--max_restarts", "1", *flags, tmpdir=scratch)
    try:
        _wait_for_checkpoint_after(store, 10, job)  # mid-epoch 0 of 22 steps
        os.kill(task_pid(str(tmp_path / "job.json"), variable, value), signal.SIGKILL)
        killed_after = store.steps()[0]
        time.sleep(1)  # the launcher has stopped the job; the restart resumes and saves again
        _wait_for_checkpoint_after(store, killed_after + 5, job)
        # SIGTERM to one process only, as a scheduler draining one node: both save at one step and exit 75.
        os.kill(task_pid(str(tmp_path / "job.json"), variable, value), signal.SIGTERM)
        _, err = job.communicate(timeout=patient(300))
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    restarts = [line for line in err.splitlines() if line.startswith("tfdist launch: restarting the job")]
    assert len(restarts) == 2, err[-3000:]
    assert f"1 of 1) after: {task} 1 failed (" in restarts[0] and "SIGKILL" in restarts[0]
    assert "after a preemption (1; preemptions do not count as failures)" in restarts[1]
    assert f"{task} 1 preempted (SIGTERM): every task saved the checkpoint and exited 75" in restarts[1]
    # The killed task's saves (it is not the chief: they were only for the collectives) left nothing behind.
    left = [str(path) for path in scratch.rglob("*") if "checkpoint" in path.name or path.suffix == ".index"]
    assert not left, left
    preempted_at = int(re.search(r"saved the checkpoint of step (\d+)", err)[1])
    assert _digest(tmp_path / "job.json") == (_digest(tmp_path / "whole.json")[0], preempted_at)


@pytest.mark.timeout(400)
def test_a_parameter_server_job_resumes_from_its_checkpoint(tmp_path):
    # Its workers' steps are asynchronous, so the resume is not bit-exact: it restarts from the saved step.
    ps = ["train", "--config", "configs/parameter_server.yaml", "--set", "train.steps_per_epoch=10",
          "--set", "train.verbose=0", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.every_steps=4",
          "--metrics_out", str(tmp_path / "metrics.json")]
    for epochs, resumed in ((1, 0), (3, 10)):
        proc = zygote.run(tfdist_command(*ps, "--set", f"train.epochs={epochs}"), cwd=ROOT, capture_output=True,
                          text=True, timeout=patient(300), env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert proc.returncode == 0, why_it_failed(proc.stderr)
        result = json.loads((tmp_path / "metrics.json").read_text())
        assert result["resumed_from_step"] == resumed
    assert CheckpointStore(str(tmp_path / "ckpt")).steps()[0] == 30


@pytest.mark.timeout(300)
def test_rerunning_a_finished_job_says_so_and_keeps_its_results(tmp_path):
    metrics = tmp_path / "metrics.json"
    args = ["train", "--set", "train.epochs=1", "--set", "train.steps_per_epoch=5", "--set", "train.verbose=0",
            "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--metrics_out", str(metrics)]
    first = zygote.run(tfdist_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=patient(240))
    assert first.returncode == 0, why_it_failed(first.stderr)
    finished = metrics.read_text()
    assert json.loads(finished)["final"]["loss"] > 0
    again = zygote.run(tfdist_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=patient(240))
    assert again.returncode == 0, why_it_failed(again.stderr)
    assert "tfdist: nothing to train: the checkpoint in " in again.stdout and "is of step 5" in again.stdout
    assert metrics.read_text() == finished  # not rewritten with an empty `final` and 0 samples/sec
