"""The `tfdist` command: exit codes and one-line errors."""

import pytest
import yaml

import os
import subprocess
import sys

from helpers import ROOT, patient, run_tfdist
from tfdist.config import Config, from_dict

# The console script a user runs (absl took its wrapper for the main module and showed no help).
TFDIST = os.path.join(os.path.dirname(sys.executable), "tfdist")
JOB = ["--config", "--set"]
COMMAND_FLAGS = {
    "train": [*JOB, "--metrics_out"],
    "config": JOB,
    "bench": ["--json", *JOB, "--repeats", "--plot", "--model", "--image_size", "--batch_per_device", "--links",
              "--kinds"],
    "launch": ["--workers", "--ps", "--chief", "--hosts", "--link", "--max_restarts", "--stalled_seconds",
               "--every_task", *JOB, "--metrics_out"],
    "slurm": ["--tasks", "--nodes", "--gpus-per-node", "--partition", "--time", "--overcommit", "--requeue",
              "--every_task", *JOB, "--metrics_out"],
    "k8s": ["--image", "--workers", "--ps", "--out", "--flavor", "--gpus-per-worker", "--cpu", "--memory", "--queue",
            "--namespace", "--priority-class", "--name", "--every_task", *JOB, "--metrics_out"],
    "serve": JOB,
}


def test_config_prints_resolved_yaml():
    proc = run_tfdist("config", "--config", "configs/default.yaml", "--set", "train.epochs=3")
    assert proc.returncode == 0, proc.stderr
    config = from_dict(yaml.safe_load(proc.stdout))
    assert isinstance(config, Config)
    assert config.train.epochs == 3


@pytest.mark.parametrize(
    "args,message",
    [
        (["config", "--set", "train.epoch=3"], "`train.epoch` is not a known key. Did you mean `train.epochs`?"),
        (["config", "--set", "strategy.kind=tensor_parallel"], "`model.name` must be transformer with strategy.kind=tensor_parallel"),
        (["train", "--config", "configs/tensor_parallel.yaml", "--set", "placement.layers=[nope=/cpu:1]"],
         "`placement.layers` must name layers of the transformer model (block0_attention, "),
        (["train", "--config", "configs/tensor_parallel.yaml", "--set", "strategy.logical_devices=3"],
         "`strategy.logical_devices` must give a number of devices that divides model.heads (4)"),
        (["config", "--config", "does/not/exist.yaml"], "`config` must name an existing YAML file"),
        (["train", "--set", "train.global_batch_size=0"], "`train.global_batch_size` must be >= 1"),
        (["train", "--set", "strategy.devices=[/gpu:0]"], "`strategy.devices[0]` names a device that does not exist"),
        (["train", "--set", "train.global_batch_size=66"], "`train.global_batch_size` must be divisible by the number of replicas (4)"),
        (["train", "--config", "configs/pipeline.yaml", "--set", "pipeline.recompute=true"],
         "`pipeline.recompute` cannot be used with the digits_cnn model: its layers dropout draw random numbers"),
        (["train", "--config", "configs/pipeline.yaml", "--set", "pipeline.boundaries=[nope]"],
         "`pipeline.boundaries` must name layers of the digits_cnn model (conv2d, "),
        (["bench", "nope"], "`bench` takes one benchmark name"),
        (["frobnicate"], "the command must be one of train, config, bench"),
        (["config", "extra"], "`config` takes no arguments"),
        (["launch", "--workers", "two"], "flag --workers=two: invalid literal for int()"),
        (["k8s", "--flavor", "tfjobs"], "flag --flavor=tfjobs: value should be one of <jobs|jobset|tfjob>"),
        (["train", "--nope"], "Unknown command line flag 'nope'"),
        (["config", "--workers", "2", "--image", "foo"], "`config` does not take --image, --workers; its flags are"),
        (["train", "--tasks", "2"], "`train` does not take --tasks"),
        (["slurm", "--tasks", "2", "--verbosity", "1"], "`slurm` does not take --verbosity"),
        # A command of the user's goes after --, and takes none of tfdist train's own flags.
        (["launch", "--workers", "2", "python", "train.py"], "`launch` takes no arguments; a command of your own "
         "goes after --: `tfdist launch [flags] -- python train.py`. Received: python train.py"),
        (["launch", "--"], "`launch` needs a command after --"),
        (["train", "--", "python", "train.py"], "`train` takes no arguments"),
        (["slurm", "--tasks", "2", "--metrics_out", "m.json", "--", "python", "train.py"],
         "--metrics_out is tfdist train's; a command of your own writes its own results"),
        (["launch", "--every_task"], "--every_task runs a command of your own on every task: give one after --"),
        (["serve"], "`serve` runs a worker or parameter server of a parameter-server job"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_tfdist(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("tfdist: error:")]
    assert len(error_lines) == 1, proc.stderr
    assert message in error_lines[0]


@pytest.mark.parametrize("args, message", [
    (["train", "--set", "train.epochs=-1"], "`train.epochs` must be >= 1. Received: -1."),
    (["bench", "horovod", "--set", "train.epochs=2"], "`config` is not used by the horovod benchmark"),
    (["bench", "overhead", "--plot", "p.png"], "`plot` only applies to"),
    (["bench", "nothing"], "`bench` takes one benchmark name"),
])
def test_a_wrong_command_line_is_refused_before_tensorflow_loads(args, message):
    """A wrong key, value or benchmark is one line at once, not after the seconds TensorFlow takes to import."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tfdist.cli", *args],
                          capture_output=True, text=True, timeout=patient(60), cwd=ROOT)
    assert proc.returncode == 2
    assert f"tfdist: error: {message}" in proc.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "tfdist.config" in imported and "tensorflow" not in imported


def test_a_benchmark_of_tfdist_itself_outside_a_checkout_is_one_line(monkeypatch, tmp_path):
    """An installed tfdist has no benchmarks/: `bench baselines` says where it runs, before TensorFlow loads;
    the benchmarks of a user's own job come with the package."""
    import tfdist.bench
    from tfdist.bench import jobs
    from tfdist.errors import ConfigError

    monkeypatch.setattr(jobs, "BENCHMARKS", str(tmp_path / "benchmarks"))
    with pytest.raises(ConfigError, match=r"`benchmark` baselines checks tfdist itself and runs from a source "
                                          r"checkout \(benchmarks/baselines.py beside the package\)"):
        tfdist.bench.run("baselines")
    assert all(module.startswith(("tfdist.bench.", "benchmarks.")) for module in tfdist.bench.BENCHMARKS.values())
    assert {name for name, module in tfdist.bench.BENCHMARKS.items() if module.startswith("tfdist.")} == {
        "synthetic", "scaling", "network", "overhead"}


def test_yaml_tag_in_file_is_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    proc = run_tfdist("config", "--config", str(path))
    assert proc.returncode == 2
    assert "may not use YAML tags" in proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"]])
def test_help_lists_the_commands(args):
    proc = subprocess.run([TFDIST, *args], capture_output=True, text=True, timeout=patient(60), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for name in COMMAND_FLAGS:
        assert f"\n  {name} " in proc.stdout


@pytest.mark.parametrize("command", list(COMMAND_FLAGS))
@pytest.mark.parametrize("help_flag", ["--help", "-h"])
def test_each_commands_help_lists_its_own_flags_and_no_others(command, help_flag):
    proc = subprocess.run([TFDIST, command, help_flag], capture_output=True, text=True, timeout=patient(60), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    listed = [line.split(":")[0].strip() for line in proc.stdout.splitlines() if line.startswith("  --")]
    assert listed == COMMAND_FLAGS[command]
    assert all(len(line.split(": ", 1)[1]) > 10 for line in proc.stdout.splitlines() if line.startswith("  --"))
    assert "logtostderr" not in proc.stdout and "verbosity" not in proc.stdout


def test_a_tf_config_task_outside_its_cluster_is_one_line():
    tf_config = '{"cluster": {"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]}, "task": {"type": "worker", "index": 2}}'
    proc = run_tfdist("train", "--set", "strategy.kind=multi_worker_mirrored", env={"TF_CONFIG": tf_config})
    assert proc.returncode == 2, proc.stderr
    # Nothing else: TensorFlow's start-up lines ("oneDNN custom operations are on") are not passed on.
    assert proc.stderr.strip().splitlines() == [
        "tfdist: error: `TF_CONFIG.task.index` must be below the number of worker tasks (2). Received: 2."]
