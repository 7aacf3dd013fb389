"""Pipeline and tensor parallelism inside each process, data parallel across processes
(`strategy.data_parallel`): real multi-worker tasks on loopback and real horovodrun ranks."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import HOROVODRUN, ROOT, SCENARIO_DIR, free_ports, horovod_rank_pid, patient, tfdist_command, why_it_failed
import zygote

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

SCENARIOS = os.path.join(SCENARIO_DIR, "process_group_scenarios.py")
def _env():
    """The test's environment now (it names the running test, so the CPU of the jobs it starts counts for it)."""
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


def _tf_config(ports, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _wait_all(procs, timeout):
    try:
        return [(proc.wait(timeout=patient(timeout)), proc) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


def _run(backend, layout, out, *shard):
    """The scenario on 2 processes of `backend`, or on one device; returns the chief's saved arrays."""
    arguments = [SCENARIOS, backend, layout, out, *shard]
    if backend == "one_device":
        procs = [zygote.Popen([sys.executable, *arguments], cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)]
    elif backend == "horovod":
        procs = [zygote.Popen([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, *arguments],
                                  cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)]
    else:
        ports = free_ports(2)
        procs = [zygote.Popen([sys.executable, *arguments], cwd=ROOT,
                              env={**_env(), "TF_CONFIG": _tf_config(ports, i)}, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
    for code, proc in _wait_all(procs, timeout=300):
        assert code == 0, why_it_failed(proc.stderr.read())
    return np.load(out)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    directory = tmp_path_factory.mktemp("one_device")
    return {layout: _run("one_device", layout, str(directory / f"{layout}.npz"))
            for layout in ("pipeline_layout", "tensor_parallel", "layout_gemma")}


@pytest.mark.xdist_group("process_groups_one_device")  # one pytest worker: the reference runs once
@pytest.mark.parametrize("layout", ["pipeline_layout", "tensor_parallel", "layout_gemma"])
@pytest.mark.parametrize("backend", ["multi_worker", pytest.param("horovod", marks=pytest.mark.horovod)])
def test_two_processes_of_two_devices_match_one_device(tmp_path, one_device, backend, layout):
    result = _run(backend, layout, str(tmp_path / "chief.npz"))
    reference = one_device[layout]
    weights = sorted(k for k in result.files if k.startswith("arr_"))
    assert weights == sorted(k for k in reference.files if k.startswith("arr_"))
    for key in weights:
        np.testing.assert_allclose(result[key], reference[key], atol=1e-5, rtol=0, err_msg=key)
    np.testing.assert_allclose(result["loss"], reference["loss"], atol=1e-5)
    # Evaluation covers every process's examples; predict returns all of them, in order, on each process.
    np.testing.assert_allclose(result["evaluated"], reference["evaluated"], atol=1e-5)
    np.testing.assert_allclose(result["predictions"], reference["predictions"], atol=1e-5)
    assert int(result["replicas"]) == 4  # split by a layout (tensor_parallel: Megatron's split): a replica per device
    # Each gradient crosses processes on the device that holds its variable: stage 1's (or shard 1's)
    # on /cpu:1 (a pipeline split by a layout: its stages' on /cpu:0-1 and /cpu:2-3), never gathered on the first.
    devices = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"] if layout == "pipeline_layout" else ["CPU:0", "CPU:1"]
    assert list(result["reduced_on"]) == devices
    if layout == "layout_gemma" and backend == "horovod":  # horovodrun's ranks also ran a Keras DataParallel
        assert (str(result["data_parallel_strategy"]), int(result["data_parallel_replicas"])) == ("HorovodStrategy", 2)
        np.testing.assert_allclose(result["data_parallel_weights"], result["one_device_weights"], atol=1e-5)


@pytest.fixture(scope="module")
def one_device_adam(tmp_path_factory):
    directory = tmp_path_factory.mktemp("one_device_adam")
    return {layout: _run("one_device", layout, str(directory / f"{layout}.npz"), "0")
            for layout in ("pipeline",)}


@pytest.mark.xdist_group("process_groups_one_device")
@pytest.mark.parametrize("backend, layout, stage", [
    ("multi_worker", "pipeline", 2), ("multi_worker", "pipeline_2x2", 3), ("multi_worker", "layout_split", 3),
    pytest.param("horovod", "pipeline", 1, marks=pytest.mark.horovod),
    pytest.param("horovod", "pipeline", 3, marks=pytest.mark.horovod),
])
def test_an_optimizer_split_over_every_processs_replicas_trains_the_one_device_weights(
        tmp_path, one_device_adam, backend, layout, stage):
    """`shard_optimizer` with `data_parallel`: each replica of each process (1, or 2 of 2 stages each in
    `pipeline_2x2`) keeps the slots of its own slice of every variable, beside the variable (its
    stage's device), and the job trains one device's weights; the model saved by both processes at once
    holds the state whole. At stage 3 each replica's copy of a kernel is its slice too, gathered among the
    stage's devices of both processes; split by a layout (`layout_split`), each device's own shard is split
    between the processes."""
    out = tmp_path / "split"
    result = _run(backend, layout, f"{out}.npz", str(stage))
    reference = one_device_adam["pipeline"]  # 2 replicas a process, or split by a layout: the same model
    replicas = 2 if layout.endswith("2x2") else 1
    for key in (k for k in reference.files if k.startswith("arr_")):
        np.testing.assert_allclose(result[key], reference[key], atol=1e-5, rtol=0, err_msg=key)
    for index in range(2):
        held = json.loads((tmp_path / f"split-p{index}.json").read_text())
        parts = 2 * replicas  # every replica of both processes (a layout's: every row of the mesh)
        # A layout's 2 devices are one row, each splitting its own shard: both hold the process's slice.
        ranks = [index] * 2 if layout == "layout_split" else [index * replicas + r for r in range(replicas)]
        assert held["ranks"] == ranks, held
        assert held["report"]["devices"] == parts and held["report"]["stage"] == stage
        # Adam keeps two slots the size of each weight: unsplit, twice the weights' bytes on each device.
        assert set(held["slots"]) == set(held["weights"]) == {f"CPU:{i}" for i in range(2 * replicas)}, held
        report = held["report"]
        for device, nbytes in held["slots"].items():
            assert nbytes <= 1.15 / parts * 2 * (report.get("unsplit_weight_bytes") or held["weights"][device])
        if stage == 3:  # each replica: 1/parts of the split kernels, and the rest (15% of the model) whole
            for nbytes in report["weight_bytes_per_device"]:
                assert nbytes <= (1 / parts + 0.15) * report["unsplit_weight_bytes"], report
    import keras

    saved = keras.models.load_model(f"{out}.keras")  # one plain process reads the state whole
    state = np.concatenate([np.ravel(v.numpy()) for v in saved.optimizer.variables])
    np.testing.assert_allclose(state, reference["optimizer"], atol=1e-5, rtol=0)


def _workers(tmp_path, overrides_per_task, *common):
    ports = free_ports(len(overrides_per_task))
    workers = ", ".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for index, own in enumerate(overrides_per_task):
        command = tfdist_command(
            "train", "--config", "configs/pipeline.yaml", "--set", "strategy.data_parallel=multi_worker",
            "--set", f"cluster.workers=[{workers}]", "--set", f"cluster.task_index={index}",
            "--metrics_out", str(tmp_path / f"metrics{index}.json"), *common, *own)
        procs.append(zygote.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
    return procs


def test_processes_with_different_device_counts_are_a_config_error(tmp_path):
    procs = _workers(tmp_path, [["--set", "strategy.logical_devices=2"], ["--set", "strategy.logical_devices=4"]])
    for code, proc in _wait_all(procs, timeout=180):
        err = proc.stderr.read()
        assert code == 2, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("tfdist: error: `strategy.logical_devices` must give every process as many devices"), last
        assert "process 0: 1 x 2, process 1: 2 x 2" in last


def test_a_killed_process_ends_the_job_with_one_line(tmp_path):
    common = ["--set", "strategy.logical_devices=2", "--set", "train.epochs=1000", "--set", "train.verbose=2",
              "--set", "cluster.heartbeat_timeout_seconds=10"]
    chief, worker = procs = _workers(tmp_path, [[], []], *common)
    try:
        for line in chief.stdout:
            if line.startswith("Epoch 2/"):
                break
        else:
            pytest.fail(f"the chief stopped before training: {chief.stderr.read()[-3000:]}")
        zygote.send_signal(worker, signal.SIGKILL)  # the worker itself, forked or not
        killed = time.monotonic()
        _, err = chief.communicate(timeout=patient(120))
        assert chief.returncode == 1, err[-3000:]
        assert err.strip().splitlines()[-1].startswith(
            "tfdist: error: lost contact with /job:worker/replica:0/task:1 during training"), err[-3000:]
        assert time.monotonic() - killed < 90
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.horovod
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_killed_or_stopped_horovod_rank_ends_the_job(fault):
    command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", *tfdist_command(
        "train", "--config", "configs/pipeline.yaml", "--set", "strategy.data_parallel=horovod",
        "--set", "strategy.logical_devices=2", "--set", "train.epochs=1000", "--set", "train.verbose=2",
        "--set", "horovod.stall_shutdown_seconds=10")]
    job = zygote.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in job.stdout:
            lines.append(line)
            if "Epoch 2/" in line:
                os.kill(horovod_rank_pid(job.pid, 1), fault)
                faulted = time.monotonic()
                break
        else:
            pytest.fail("".join(lines)[-3000:])
        lines += job.stdout.readlines()
        job.wait(timeout=patient(120))
    finally:
        job.kill()
    output = "".join(lines)[-4000:]
    assert job.returncode != 0 and time.monotonic() - faulted < 90, output
    rank0 = [line.split(":", 1)[1].strip() for line in lines if line.startswith("[0]<stderr>:") and line[12:].strip()]
    errors = [line for line in rank0 if line.startswith("tfdist: error:")]
    assert not any(line.startswith("Traceback") for line in rank0), output
    if fault == signal.SIGSTOP:
        # Rank 1 is alive but stuck: only rank 0's step watchdog can end the job, with one line.
        assert len(errors) == 1 and "stuck" in errors[0], output
    elif errors:
        assert len(errors) == 1 and "Horovod stopped: another rank failed or exited" in errors[0], output
    else:
        # horovodrun SIGTERMs the other ranks as soon as one exits; when that beats rank 0's next
        # all-reduce, horovodrun's own message names the rank that failed.
        assert "Terminating remaining workers after failure of Process 1" in output, output


@pytest.mark.slow
@pytest.mark.horovod
def test_digits_train_to_095_under_horovodrun(tmp_path):
    metrics = tmp_path / "metrics.json"
    command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", *tfdist_command(
        "train", "--config", "configs/pipeline.yaml", "--set", "strategy.data_parallel=horovod",
        "--set", "strategy.logical_devices=2", "--metrics_out", str(metrics))]
    done = zygote.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=patient(600))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(metrics.read_text())
    assert result["final"]["val_accuracy"] >= 0.95
    assert result["layout"]["text"] == "2 process(es) x 1 replica(s) x 2 stage(s) x 1 tensor-parallel"
    assert result["num_replicas"] == 2 and result["micro_batch_size"] == 64 // 2 // 4
    assert "  layout          2 process(es) x 1 replica(s) x 2 stage(s) x 1 tensor-parallel" in done.stdout
    # Only rank 0 reports the partition and the summary.
    assert done.stdout.count("tfdist pipeline: 2 process(es) (horovod) x 1 replica(s) x 2 stages") == 1
    assert done.stdout.count("tfdist summary") == 1


@pytest.mark.slow
def test_digits_train_to_095_under_the_launcher_and_resume_from_the_chiefs_checkpoint(tmp_path):
    metrics, ckpt = tmp_path / "metrics.json", tmp_path / "ckpt"
    launch = ["launch", "--workers", "2", "--config", "configs/pipeline.yaml", "--set",
              "strategy.data_parallel=multi_worker", "--set", "strategy.logical_devices=2",
              "--set", f"checkpoint.dir={ckpt}", "--metrics_out", str(metrics)]
    first = zygote.run(tfdist_command(*launch, "--set", "train.epochs=2"), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=patient(400))
    assert first.returncode == 0, why_it_failed(first.stderr)
    saved = sorted(os.listdir(ckpt))
    second = zygote.run(tfdist_command(*launch), cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=patient(600))
    assert second.returncode == 0, why_it_failed(second.stderr)
    result = json.loads(metrics.read_text())
    assert result["final"]["val_accuracy"] >= 0.95
    assert result["resumed_from_step"] == 2 * result["steps_per_epoch"]
    assert re.fullmatch(r"step-0*%d" % (2 * result["steps_per_epoch"]), saved[-1])  # the chief's, in checkpoint.dir
    assert result["layout"]["processes"] == 2 and result["layout"]["data_parallel"] == "multi_worker"
