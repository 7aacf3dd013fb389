"""Elastic Horovod on Keras 3 (`tfdist.horovod.tensorflow.keras.elastic`, and `horovod.elastic: true` for
`tfdist train`): a real elastic horovodrun job loses a rank in the middle of an epoch and finishes with the
survivor, from its last commit."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from helpers import HOROVODRUN, ROOT, SCENARIO_DIR, horovod_rank_pid, patient, run_tfdist, tfdist_command
import zygote

pytestmark = [pytest.mark.multiprocess, pytest.mark.horovod]

SCRIPT = os.path.join(SCENARIO_DIR, "horovod_elastic_fit.py")
EPOCHS, STEPS = 6, 15  # as in the script


def _events(out_dir):
    events = []
    for name in os.listdir(out_dir):
        if name.startswith("events."):
            with open(os.path.join(out_dir, name)) as f:
                events += [json.loads(line) for line in f if line.endswith("\n")]
    return sorted(events, key=lambda e: e["time"])


def _elastic_job(tmp_path, command):
    """`command` under an elastic horovodrun of 2 ranks (at least 1) on loopback."""
    # Two host names for loopback, one slot each: Horovod blacklists the host of a failed rank,
    # and with one name for both slots the survivor would go with it.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    command = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
               "--host-discovery-script", str(discover), *command]
    return zygote.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.timeout(400)
def test_a_rank_killed_mid_epoch_loses_no_committed_step(tmp_path):
    job = _elastic_job(tmp_path, [sys.executable, SCRIPT, str(tmp_path)])
    try:
        # Kill rank 1 a few batches into epoch 3: rank 0 has committed a step in it.
        kill_after = 2 * STEPS + random.Random(20).randint(2, 8)
        deadline = time.monotonic() + patient(240)
        while not any(e["event"] == "commit" and e["rank"] == 0 and e["step"] >= kill_after
                      for e in _events(tmp_path)):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-4000:]
            time.sleep(0.01)
        victim = next(e for e in _events(tmp_path) if e["event"] == "start" and e["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        killed = time.time()
        output, _ = job.communicate(timeout=patient(240))
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]

    survivor = [e for e in _events(tmp_path) if e["host"] != victim["host"]]  # one rank per host name
    reset = next(e for e in survivor if e["event"] == "reset")
    last_commit = [e for e in survivor if e["event"] == "commit" and e["time"] < reset["time"]][-1]
    recovered = next(e for e in survivor if e["event"] == "first_batch_after_reset")
    result = json.loads((tmp_path / "result.json").read_text())
    figures = {"committed_steps_lost": last_commit["step"] - reset["restored_step"],
               "recovery_seconds": round(recovered["time"] - killed, 2),
               "final_step": result["final_step"], "val_accuracy": round(result["val_accuracy"], 4)}
    print("elastic figures:", json.dumps(figures))

    assert figures["committed_steps_lost"] == 0
    # The restored state is the commit's, in the middle of epoch 3, and training goes on from there:
    assert reset["epoch"] == 2 and 0 < reset["batch"] < STEPS and reset["restored_step"] == 2 * STEPS + reset["batch"]
    assert recovered["step"] == reset["restored_step"] + 1
    # ... with only the epoch's remaining batches, so the run ends with exactly its planned steps.
    assert result["final_step"] == EPOCHS * STEPS and result["size"] == 1
    assert result["val_accuracy"] >= 0.9
    assert figures["recovery_seconds"] < 60


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tfdist_train_with_horovod_elastic_goes_on_without_a_lost_rank(tmp_path):
    metrics = tmp_path / "metrics.json"
    job = _elastic_job(tmp_path, tfdist_command(
        "train", "--config", "configs/horovod.yaml", "--set", "horovod.elastic=true", "--set", "train.epochs=6",
        "--set", "train.verbose=2", "--metrics_out", str(metrics)))
    try:
        lines = []
        for line in job.stdout:
            lines.append(line)
            if line.startswith("[0]<stdout>:Epoch 3/"):
                time.sleep(0.3)  # into the epoch
                os.kill(horovod_rank_pid(job.pid, 1), signal.SIGKILL)
                break
        else:
            pytest.fail("".join(lines)[-4000:])
        output = "".join(lines) + job.communicate(timeout=patient(240))[0]
    finally:
        job.kill()
    assert job.returncode == 0, output[-4000:]
    result = json.loads(metrics.read_text())
    # One reset, one rank left, and exactly the planned optimizer steps (22 per epoch): none lost, none twice.
    assert result["elastic"] == {"resets": 1, "ranks": 1, "optimizer_steps": 6 * 22}
    assert result["final"]["val_accuracy"] >= 0.9
    assert "[0]<stdout>:  elastic         1 reset(s), 1 rank(s) at the end" in output


def test_horovod_elastic_outside_an_elastic_horovodrun_is_one_line():
    done = run_tfdist("train", "--config", "configs/horovod.yaml", "--set", "horovod.elastic=true",
                      "--set", "train.epochs=1")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "tfdist: error: horovod.elastic needs an elastic horovodrun: add --min-np, --max-np and "
        "--host-discovery-script (and --network-interface lo on one machine).")
