"""Two MultiWorkerMirrored workers as processes on loopback, through `tfdist train`."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT, SCENARIO_DIR, free_ports, patient, tfdist_command
from oracle import keras_alone
import zygote

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _start_workers(tmp_path, ports, count, extra=()):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # tfdist's own default, as a user gets it
    workers = ", ".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for index in range(count):
        args = tfdist_command(
            "train",
            "--set", "strategy.kind=multi_worker_mirrored",
            "--set", f"cluster.workers=[{workers}]",
            "--set", f"cluster.task_index={index}",
            "--set", "train.epochs=2",
            "--set", "train.steps_per_epoch=6",
            "--set", "train.verbose=0",
            "--set", "callbacks.throughput_warmup_steps=1",
            "--metrics_out", str(tmp_path / f"metrics{index}.json"),
            *extra,
        )
        procs.append(
            zygote.Popen(
                args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env,
            )
        )
    return procs


def _wait(procs, timeout):
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=patient(timeout))
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


def test_two_workers_train_together(tmp_path):
    results = _wait(_start_workers(tmp_path, free_ports(2), 2), timeout=180)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    chief = json.loads((tmp_path / "metrics0.json").read_text())
    assert chief["strategy"] == "multi_worker_mirrored"
    assert chief["num_replicas"] == 2
    assert chief["final"]["val_accuracy"] > 0.3  # 12 steps, 10 classes
    assert not (tmp_path / "metrics1.json").exists()  # only the chief writes results
    assert "tfdist summary" in results[0][1] and "tfdist summary" not in results[1][1]


_MADE_TWICE = """
import json, os, sys
import tfdist
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [sys.argv[1]]}, "task": {"type": "worker", "index": 0}})
kind = ["strategy.kind=multi_worker_mirrored"]
first = tfdist.make_strategy(tfdist.load_config(None, kind))
again = tfdist.make_strategy(tfdist.load_config(None, kind))
try:
    tfdist.make_strategy(tfdist.load_config(None, [*kind, "strategy.bytes_per_pack=1024"]))
except tfdist.ConfigError as error:
    print(again is first, error)
"""


def test_a_process_joins_its_cluster_once_and_make_strategy_returns_that_strategy_again():
    """Keras's guide makes its strategy in each function; TensorFlow cannot join a process to its cluster twice
    (the second strategy's first broadcast failed: "Delete called on non-empty BufRendezvous")."""
    done = zygote.run([sys.executable, "-c", _MADE_TWICE, f"127.0.0.1:{free_ports(1)[0]}"], capture_output=True,
                      text=True, timeout=patient(120), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    same, message = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert same == "True" and message.startswith("`strategy` cannot change in a process that has joined its cluster")


def test_a_missing_peer_is_an_error_naming_it(tmp_path):
    # Worker 1 never starts: worker 0 must fail after the start-up timeout.
    started = time.monotonic()
    results = _wait(
        _start_workers(tmp_path, free_ports(2), 1, ["--set", "cluster.startup_timeout_seconds=10"]),
        timeout=90,
    )
    code, _, err = results[0]
    assert code == 1
    assert (
        "tfdist: error: tasks /job:worker/replica:0/task:1 did not start within "
        "cluster.startup_timeout_seconds=10." in err
    )
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("kind", ["multi_worker_mirrored", "parameter_server"])
def test_a_port_held_by_another_process_is_one_line_naming_it(tmp_path, kind):
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        held = holder.getsockname()[1]
        worker, ps, chief = [f"127.0.0.1:{p}" for p in (held, *free_ports(2))]
        cluster = [f"cluster.workers=[{worker}]", "cluster.task_type=worker"]
        if kind == "parameter_server":
            cluster += [f"cluster.ps=[{ps}]", f"cluster.chief={chief}"]
        proc = zygote.run(
            tfdist_command("train", "--set", f"strategy.kind={kind}", *[f"--set={c}" for c in cluster]),
            cwd=ROOT, capture_output=True, text=True, timeout=patient(120),
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"tfdist: error: task worker:0 cannot listen on {worker}: another process holds the port. "
        "Give the job free ports (under Slurm: cluster.port_base)."
    ), proc.stderr[-2000:]


def test_a_peer_killed_mid_training_is_an_error_not_a_hang(tmp_path):
    procs = _start_workers(
        tmp_path,
        free_ports(2),
        2,
        ["--set", "train.epochs=1000", "--set", "train.verbose=2", "--set", "cluster.heartbeat_timeout_seconds=10"],
    )
    chief, worker = procs
    try:
        for line in chief.stdout:  # wait until training is under way
            if line.startswith("Epoch 3/"):
                break
        else:
            pytest.fail(f"the chief stopped before training: {chief.stderr.read()[-3000:]}")
        zygote.send_signal(worker, signal.SIGKILL)  # the worker itself, forked or not
        killed = time.monotonic()
        _, err = chief.communicate(timeout=patient(120))
        assert chief.returncode == 1
        # One line: not after 6 lines of gRPC errors, nor TensorFlow's start-up banner.
        assert err.startswith("tfdist: error: lost contact with /job:worker/replica:0/task:1 during training"), err
        assert err.count("\n") == 1, err
        assert time.monotonic() - killed < 90
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.parametrize("compression,accumulation,tolerance", [
    (None, 1, 1e-5),  # the gradients all-reduced last layer first: the same sums
    ("float16", 1, 1e-3),  # on the wire at half their bytes, as Horovod's fp16 compression test allows
    ("bfloat16", 1, 1e-2),  # 8 bits of mantissa
    (None, 4, 1e-5),  # Keras's gradient accumulation (keras-team/keras#20582), its own tf.cond inside Keras's
])
def test_steps_per_execution_over_two_workers_matches_one_device(tmp_path, compression, accumulation, tolerance):
    """Keras's multi-step loop puts each step in a tf.cond, where a multi-worker step's merge_call fails."""
    import numpy as np
    from multi_worker_steps import build, data

    script = os.path.join(SCENARIO_DIR, "multi_worker_steps.py")
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    out = tmp_path / "chief.npz"
    procs = [
        zygote.Popen(
            [sys.executable, script, json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}),
             str(out), compression or "none", str(accumulation)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    for code, _, err in _wait(procs, timeout=180):
        assert code == 0, err[-3000:]
    expected = keras_alone("fit", build(accumulation=accumulation), *data(), batch_size=8, epochs=2, shuffle=False)
    result = np.load(out)
    assert int(result["iterations"]) == expected["iterations"] == 2 * 8 // accumulation
    for index, weight in enumerate(expected["weights"]):
        np.testing.assert_allclose(result[f"arr_{index}"], weight, atol=tolerance, rtol=0)
    np.testing.assert_allclose(result["loss"], expected["history"]["loss"], atol=tolerance)


@pytest.mark.timeout(420)
def test_an_optimizer_split_over_two_workers_trains_the_unsplit_jobs_weights_and_saves_it_whole(tmp_path):
    """`shard_optimizer=1`, 2 and 3 across two processes, for each optimizer of the scenario: every worker holds the
    slots of its own slice only, the weights after 20 steps are the same job's unsplit ones (and one
    device's), and the checkpoint and the Keras file both workers wrote together (each slot gathered whole)
    resume in one plain process as if it had trained all along; a Keras file one worker saves is refused."""
    import numpy as np

    sys.path.insert(0, SCENARIO_DIR)
    from multi_worker_split import OPTIMIZERS, STAGE_2, data, train

    from tfdist import Checkpoint

    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = [
        zygote.Popen(
            [sys.executable, os.path.join(SCENARIO_DIR, "multi_worker_split.py"),
             json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}), str(tmp_path)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    for code, _, err in _wait(procs, timeout=360):
        assert code == 0, err[-3000:]
    for index in range(2):
        for name, result in json.loads((tmp_path / f"worker-{index}.json").read_text()).items():
            assert result["iterations"] == 20 and result["ranks"] == [index], (name, result)
            reports = [(result["report"], 1)] + ([(result[f"stage_{s}_report"], s) for s in (2, 3)]
                                                 if name in STAGE_2 else [])
            for report, stage in reports:
                assert report["slot_bytes_per_device"][0] <= 1.15 / 2 * report["unsplit_slot_bytes"], (name, report)
                if stage == 3:  # the kernels' 105 weights halved (53 of them), the biases' 10 whole
                    assert report["weight_bytes_per_device"] == [4 * (53 + 10)], (name, report)
                assert report["stage"] == stage and report["devices"] == 2, (name, report)
            assert result["slot_devices"] == [f"/job:worker/replica:0/task:{index}/device:CPU:0"], (name, result)
            assert "cannot be saved by one process into a Keras file" in result["keras_file_refused"]
    assert [path.name for path in tmp_path.glob("*.keras")] == ["together.keras"]  # one worker's: refused

    def max_diff(saved, weights):
        return max(float(np.abs(saved[f"arr_{i}"] - w).max()) for i, w in enumerate(weights))

    for name in OPTIMIZERS:
        alone = train(None, name).get_weights()
        for index in range(2):
            unsplit = np.load(tmp_path / f"worker-{index}-{name}-stage0.npz")
            files = [f"worker-{index}-{name}.npz"] + ([f"worker-{index}-{name}-stage{s}.npz" for s in (2, 3)]
                                                      if name in STAGE_2 else [])
            files += [f"worker-{index}-adam-stage3-remat.npz"] if name == "adam" else []
            for file in files:
                split = np.load(tmp_path / file)
                assert max_diff(split, [unsplit[k] for k in sorted(unsplit, key=lambda k: int(k[4:]))]) <= 1e-5, file
                # float16 products over half the batch per worker differ from one device's over all of it
                assert max_diff(split, alone) <= (2e-4 if "float16" in name else 1e-5), file
    resumed = Checkpoint(str(tmp_path / "checkpoint"), write=False)
    assert max_diff({f"arr_{i}": w for i, w in enumerate(train(None, "adam", epochs=5).get_weights())},
                    train(None, "adam", epochs=5, callbacks=[resumed]).get_weights()) <= 1e-5
    assert resumed.resumed_from_step == 20
    import keras

    from_file = keras.models.load_model(tmp_path / "together.keras")  # saved by both workers at once
    x, y = data()
    from_file.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_diff({f"arr_{i}": w for i, w in enumerate(train(None, "adam", epochs=5).get_weights())},
                    from_file.get_weights()) <= 1e-5
