"""`tfdist train` and the example script, end to end."""

import os
import sys

import pytest

from helpers import ROOT, patient, train_with_metrics, why_it_failed
import zygote

pytestmark = pytest.mark.slow


def test_default_config_reaches_095_and_writes_the_metrics(tmp_path):
    proc, result = train_with_metrics(tmp_path, "configs/default.yaml", timeout=300)
    assert result["strategy"] == "mirrored"
    assert result["num_replicas"] == 4
    assert result["global_batch_size"] == 64
    assert result["samples_per_sec"] > 0
    assert result["final"]["val_accuracy"] >= 0.95
    summary = proc.stdout[proc.stdout.index("tfdist summary"):]
    for line in ("strategy        mirrored (4 replica(s))", "global batch    64 (16 per replica)",
                 "samples/sec", f"host cores      {result['host_cpu_busy']:.0%} busy over those steps", "val_accuracy"):
        assert line in summary
    assert 0 < result["host_cpu_busy"] <= 1.0
    assert "Epoch 1/" in proc.stdout  # the Keras progress bar was shown


def test_pipeline_config_reaches_095_and_reports_its_partition(tmp_path):
    proc, result = train_with_metrics(tmp_path, "configs/pipeline.yaml", timeout=600)
    assert result["strategy"] == "pipeline"
    assert result["final"]["val_accuracy"] >= 0.95
    report = result["pipeline"]
    assert report["num_stages"] == 2 and report["num_micro_batches"] == 4
    assert report["schedule"] == "1f1b"
    stages = report["partition"]["stages"]
    assert len(stages) == 2 and all(stage["layers"] and stage["params"] > 0 for stage in stages)
    # Each stage holds its own weights (4 bytes a parameter) and Adam's two slots for them.
    memory = report["stage_memory_bytes"]
    assert [m["params"] for m in memory] == [4 * stage["params"] for stage in stages]
    assert all(m["optimizer"] >= 2 * m["params"] for m in memory)
    assert "tfdist pipeline: 2 replica(s) x 2 stages, 4 micro-batches, 1f1b" in proc.stdout
    assert "Epoch 1/" in proc.stdout


@pytest.mark.parametrize("config, expected", [
    ("configs/default.yaml", "strategy=mirrored replicas=4 val_accuracy="),
    ("configs/pipeline.yaml", "strategy=pipeline replicas=2 val_accuracy="),
])
def test_example_script_reads_the_same_config(config, expected):
    proc = zygote.run(
        [sys.executable, "examples/train_digits.py", "--config", config,
         "--set", "train.epochs=2", "--set", "train.verbose=0"],
        capture_output=True, text=True, timeout=patient(300), cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    assert expected in proc.stdout
    accuracy = float(proc.stdout.rsplit("val_accuracy=", 1)[1].split()[0])
    assert accuracy > 0.5  # two epochs: well above chance (0.1)


def test_example_script_bad_config_is_a_usage_error():
    proc = zygote.run(
        [sys.executable, "examples/train_digits.py", "--set", "train.epochs=-1"],
        capture_output=True, text=True, timeout=patient(120), cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "`train.epochs` must be >= 1. Received: -1." in proc.stderr
    assert "Traceback" not in proc.stderr
