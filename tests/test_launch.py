"""`tfdist launch`: every task of a job from one command, its output, its failures, its signals."""

import json
import os
import pty
import re
import signal
import subprocess
import time

import pytest

from helpers import ROOT, processes_with, run_tfdist, task_pid, tfdist_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

MULTI_WORKER = ["--config", "configs/default.yaml", "--set", "strategy.kind=multi_worker_mirrored",
                "--set", "train.steps_per_epoch=6"]


def _launch(metrics, *flags, terminal=False):
    """`tfdist launch FLAGS --metrics_out METRICS`; with `terminal`, its stdout is a pseudo-terminal."""
    command = tfdist_command("launch", *flags, "--metrics_out", str(metrics))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not terminal:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reader, writer = pty.openpty()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=writer, stderr=subprocess.PIPE, text=True, env=env)
    os.close(writer)
    proc.terminal = reader
    return proc


def _finish(proc, timeout=240):
    """(stdout, stderr) once the launcher has exited; a pseudo-terminal's end reads as EOF."""
    if hasattr(proc, "terminal"):
        out = b""
        while True:
            try:
                chunk = os.read(proc.terminal, 4096)
            except OSError:  # the pseudo-terminal's writer has gone
                break
            if not chunk:
                break
            out += chunk
        os.close(proc.terminal)
        out = out.decode(errors="replace")
    else:
        out = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=timeout)
    return out, err


def _wait_for(proc, text):
    """Reads the launcher's stdout until `text` appears; returns what was read."""
    seen = ""
    while text not in seen:
        chunk = proc.stdout.readline()
        if not chunk:
            pytest.fail(f"the launcher ended before {text!r}: {seen[-2000:]} {proc.stderr.read()[-2000:]}")
        seen += chunk
    return seen


def test_a_multi_worker_job_runs_from_one_command_with_its_progress_bar_and_leaves_nothing(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = _launch(metrics, "--workers", "2", *MULTI_WORKER, "--set", "train.epochs=2", terminal=True)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(metrics.read_text())
    assert result["strategy"] == "multi_worker_mirrored" and result["num_replicas"] == 2
    # The chief's bar redraws in place (a carriage return not ending a line) and its summary shows once.
    assert re.search(r"\r(?!\n)", out) and out.count("tfdist summary") == 1
    assert processes_with(str(metrics)) == []


def test_a_parameter_server_job_stops_its_servers_when_the_chief_is_done(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = _launch(metrics, "--workers", "2", "--ps", "1", "--config", "configs/parameter_server.yaml",
                   "--set", "train.epochs=3")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(metrics.read_text())
    assert result["cluster"] == "2 worker(s), 1 parameter server(s)"  # the launcher's, not a local cluster
    assert result["final"]["val_accuracy"] >= 0.9
    assert processes_with(str(metrics)) == []


@pytest.mark.horovod
def test_a_horovod_job_runs_horovodrun_for_you(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = _launch(metrics, "--workers", "2", "--config", "configs/horovod.yaml", "--set", "train.epochs=2")
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(metrics.read_text())["num_replicas"] == 2
    assert out.count("tfdist summary") == 1 and "<stdout>" not in out  # rank 0 unprefixed, as a plain run
    assert processes_with(str(metrics)) == []


@pytest.mark.parametrize("flags,variable,value,expected", [
    (["--workers", "2", *MULTI_WORKER], "TF_CONFIG", '"index": 1', "worker 1 failed (killed by SIGKILL)"),
    pytest.param(["--workers", "2", "--config", "configs/horovod.yaml"], "HOROVOD_RANK", "1",
                 "rank 1 failed (exit code 137, SIGKILL)", marks=pytest.mark.horovod),
])
def test_the_first_task_that_fails_ends_the_job_with_one_line_naming_it(tmp_path, flags, variable, value, expected):
    metrics = tmp_path / "metrics.json"
    proc = _launch(metrics, *flags, "--set", "train.epochs=100", "--set", "train.verbose=2")
    try:
        _wait_for(proc, "Epoch 3/")
        os.kill(task_pid(str(metrics), variable, value), signal.SIGKILL)
        killed = time.monotonic()
        out, err = _finish(proc, timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 137 and time.monotonic() - killed < 60, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith("tfdist launch: error: " + expected), err[-3000:]
    assert "Traceback" not in err  # not horovodrun's, not a task's
    assert processes_with(str(metrics)) == []


def test_sigterm_to_the_launcher_reaches_every_task(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = _launch(metrics, "--workers", "2", "--ps", "1", "--config", "configs/parameter_server.yaml",
                   "--set", "train.epochs=100", "--set", "train.verbose=2")
    try:
        _wait_for(proc, "Epoch 2/")
        proc.send_signal(signal.SIGTERM)
        out, err = _finish(proc, timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "tfdist launch: stopped by SIGTERM; stopping every task"
    assert processes_with(str(metrics)) == []


@pytest.mark.parametrize("flags,message", [
    (["--workers", "2"], "`--workers` must be 1: strategy.kind=mirrored runs in one process"),
    (["--workers", "0", *MULTI_WORKER], "`--workers` must be at least 1"),
    (["--workers", "2", "--ps", "1", *MULTI_WORKER], "`--ps` only applies with strategy.kind=parameter_server"),
    (["--workers", "2", *MULTI_WORKER, "--set", "cluster.workers=[127.0.0.1:1]"], "`cluster.workers` must be empty"),
])
def test_counts_that_do_not_fit_the_kind_are_one_line(flags, message):
    proc = run_tfdist("launch", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tfdist: error: " + message), lines
