"""Slurm: roles, the sbatch script, and jobs trained through a real one-node Slurm."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ROOT, free_port_block, free_ports, patient, run_tfdist
from local_slurm import LocalSlurm

from tfdist.config import load_config
from tfdist.config.kinds import PARAMETER_SERVERS, WORKERS
from tfdist.errors import ConfigError
from tfdist.cluster.roles import roles


def test_roles_follow_the_strategy():
    assert roles(WORKERS, 3) == ["worker"] * 3
    assert roles(PARAMETER_SERVERS, 5, num_ps=2) == ["ps", "ps", "chief", "worker", "worker"]
    with pytest.raises(ConfigError, match="needs num_ps \\+ 2 tasks"):
        roles(PARAMETER_SERVERS, 2, num_ps=1)


def test_the_script_asks_slurm_for_what_the_flags_say():
    proc = run_tfdist("slurm", "--tasks", "4", "--nodes", "2", "--gpus-per-node", "2", "--partition", "gpu",
                      "--time", "1:00:00", "--config", "configs/parameter_server.yaml", "--set", "train.epochs=3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for option in ("--ntasks=4", "--nodes=2", "--gpus-per-node=2", "--partition=gpu", "--time=1:00:00"):
        assert f"#SBATCH {option}" in lines
    # A task that ends first (a preempted one, exiting 75) does not have the others killed mid-save.
    assert lines[-1].startswith("srun --kill-on-bad-exit=0 --wait=60 ") and "--set=cluster.resolver=slurm" in lines[-1]
    assert "--set=train.epochs=3" in lines[-1] and f"--config {ROOT}/configs/parameter_server.yaml" in lines[-1]
    # Two nodes are not loopback: the script says what to set, and so does a warning.
    warning = "tfdist refuses addresses off loopback until the job sets cluster.allow_non_loopback=true"
    assert any(warning in line for line in lines if line.startswith("# "))
    assert proc.stderr.startswith("tfdist: warning: ") and warning in proc.stderr
    allowed = run_tfdist("slurm", "--tasks", "4", "--nodes", "2", "--config", "configs/parameter_server.yaml",
                         "--set", "cluster.allow_non_loopback=true")
    assert allowed.returncode == 0 and warning not in allowed.stdout + allowed.stderr


def test_requeue_makes_the_script_requeue_a_preempted_job():
    plain = run_tfdist("slurm", "--tasks", "2", "--config", "configs/horovod.yaml").stdout
    assert "scontrol requeue" not in plain
    proc = run_tfdist("slurm", "--tasks", "2", "--requeue", "--config", "configs/horovod.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --requeue" in proc.stdout and "#SBATCH --open-mode=append" in proc.stdout
    assert '[ "${code:-0}" -eq 75 ]' in proc.stdout and 'scontrol requeue "$SLURM_JOB_ID"' in proc.stdout


def test_horovod_runs_horovodrun_over_the_jobs_nodes():
    proc = run_tfdist("slurm", "--tasks", "4", "--nodes", "2", "--config", "configs/horovod.yaml")
    assert proc.returncode == 0, proc.stderr
    assert 'sed "s/$/:2/"' in proc.stdout and "horovodrun -np 4 --gloo -H \"$hosts\"" in proc.stdout


@pytest.mark.parametrize("flags,message", [
    (["--config", "configs/default.yaml"], "`slurm` needs --tasks"),
    (["--tasks", "2", "--config", "configs/default.yaml"], "`strategy.kind` runs in one process"),
    (["--tasks", "2", "--config", "configs/parameter_server.yaml"], "`parameter_server.num_ps` leaves no chief"),
    (["--tasks", "3", "--nodes", "2", "--config", "configs/horovod.yaml"], "`--tasks` must divide evenly"),
])
def test_bad_counts_are_one_line(flags, message):
    proc = run_tfdist("slurm", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tfdist: error: " + message), lines


def test_several_tasks_and_no_kind_given_make_a_multi_worker_job_and_say_so():
    proc = run_tfdist("slurm", "--tasks", "2")  # a config of mirrored itself is refused above
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("tfdist slurm: no strategy.kind given: 2 tasks as strategy.kind=multi_worker_mirrored "
                           "(--set strategy.kind=... chooses another)\n")
    assert "--set=strategy.kind=multi_worker_mirrored" in proc.stdout


def test_the_slurm_resolver_only_runs_in_a_job_step(monkeypatch):
    from tfdist.cluster.resolver import cluster_resolver

    for variable in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    config = load_config(None, ["strategy.kind=multi_worker_mirrored", "cluster.resolver=slurm"])
    with pytest.raises(ConfigError, match="slurm needs a Slurm job step: run every task with srun"):
        cluster_resolver(config)


# The tests that use it run on one pytest-xdist worker: one Slurm cluster, started once.
slurm_cluster = pytest.mark.xdist_group("slurm")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if shutil.which("slurmctld") is None:
        pytest.fail("Slurm is not installed: `make setup` installs slurm-wlm and munge")
    with LocalSlurm(tmp_path_factory.mktemp("slurm"), *free_ports(2)) as cluster:
        yield cluster


@slurm_cluster
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tasks,flags", [
    ("2", ["--config", "configs/default.yaml", "--set", "strategy.kind=multi_worker_mirrored"]),
    ("4", ["--config", "configs/parameter_server.yaml", "--overcommit"]),  # 1 ps, the chief, 2 workers
])
def test_a_job_trains_digits_through_sbatch(slurm, tmp_path, tasks, flags):
    metrics = tmp_path / "metrics.json"
    port_base = free_port_block(int(tasks))
    script = run_tfdist("slurm", "--tasks", tasks, *flags, "--set", f"cluster.port_base={port_base}",
                        "--metrics_out", str(metrics)).stdout
    code, output = slurm.sbatch_wait(script, cwd=tmp_path, timeout=patient(540))
    assert code == 0, output[-4000:] + slurm.log()
    result = json.loads(metrics.read_text())
    assert result["final"]["val_accuracy"] >= 0.95
    assert output.count("tfdist summary") == 1  # only the chief (or worker 0) reports


@slurm_cluster
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_users_own_script_runs_through_sbatch_on_the_chief_and_tfdist_serves_it(slurm, tmp_path):
    """TensorFlow's multi-worker guide under parameter servers: the chief's task runs it, the others are
    `tfdist serve`; the script finds the job step's cluster as `tfdist train` does (cluster.resolver: slurm)."""
    model = tmp_path / "model.keras"
    kind = "strategy.kind=parameter_server"
    script = run_tfdist("slurm", "--tasks", "3", "--overcommit", "--set", kind, "--set",
                        f"cluster.port_base={free_port_block(3)}", "--",
                        sys.executable, os.path.join(ROOT, "examples", "guide_multi_worker_keras.py"), "--set", kind,
                        "--epochs", "1", "--steps_per_epoch", "3", "--model_path", str(model),
                        "--backup_dir", str(tmp_path / "backup")).stdout
    assert 'if [ $SLURM_PROCID -eq 1 ]; then exec' in script and "-m tfdist.cli serve" in script
    code, output = slurm.sbatch_wait(script, cwd=tmp_path, timeout=patient(540))
    assert code == 0, output[-4000:] + slurm.log()
    assert model.exists() and "3/3 - " in output  # the chief's three steps


def _wait_until(condition, what, timeout):
    timeout = patient(timeout)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.5)


@slurm_cluster
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_preempted_job_is_requeued_and_resumes_where_it_stopped(slurm, tmp_path):
    metrics, checkpoints = tmp_path / "metrics.json", tmp_path / "checkpoints"
    script = run_tfdist(
        "slurm", "--tasks", "2", "--requeue", "--config", "configs/default.yaml",
        "--set", "strategy.kind=multi_worker_mirrored", "--set", f"cluster.port_base={free_port_block(2)}",
        "--set", "train.epochs=4", "--set", "train.verbose=2", "--set", f"checkpoint.dir={checkpoints}",
        "--metrics_out", str(metrics)).stdout
    job = slurm.submit(script, cwd=tmp_path)
    output = slurm.output_path(tmp_path, job)
    _wait_until(lambda: os.path.exists(output) and "Epoch 2/4" in open(output).read(), "epoch 2", 240)
    # What a scheduler's preemption sends every task of the job first.
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm.env, check=True)
    _wait_until(lambda: slurm.state(job) == "PENDING BeginTime", "requeue", 120)
    slurm.start_now(job)
    code = slurm.wait(job, timeout=patient(300))
    text = open(output).read()
    assert code == 0, text[-4000:] + slurm.log()
    assert f"tfdist: preempted; requeueing job {job}" in text
    saved = int(re.search(r"saved the checkpoint of step (\d+)", text).group(1))
    result = json.loads(metrics.read_text())
    assert result["resumed_from_step"] == saved > 0
    assert text.count("Epoch 1/4") == 1 and "Epoch 4/4" in text  # resumed, not started over
    assert result["final"]["val_accuracy"] >= 0.9
