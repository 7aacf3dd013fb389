"""File sources in multi-process jobs: each worker trains on its own files, and the summary says so."""

import json
import os

import pytest

from helpers import ROOT, patient, tfdist_command, why_it_failed
import zygote
from sample_files import FEATURES, digits, write_image_folder, write_tfrecords

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _launch(tmp_path, *flags):
    metrics = tmp_path / "metrics.json"
    command = tfdist_command("launch", *flags, "--metrics_out", str(metrics), "--set", "train.verbose=0",
                             "--set", "train.epochs=8")
    proc = zygote.run(command, cwd=ROOT, capture_output=True, text=True, timeout=patient(240),
                      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, why_it_failed(proc.stderr)
    return proc, json.loads(metrics.read_text())


@pytest.mark.parametrize("kind_flags", [
    ["--workers", "2", "--config", "configs/default.yaml", "--set", "strategy.kind=multi_worker_mirrored"],
    ["--workers", "2", "--ps", "1", "--config", "configs/parameter_server.yaml"],
], ids=["multi_worker", "parameter_server"])
def test_tfrecord_shards_are_split_by_file_over_the_workers(tmp_path, kind_flags):
    x, y = digits()
    pattern = write_tfrecords(tmp_path / "records", 4, x, y)
    proc, result = _launch(tmp_path, *kind_flags, "--set", f"data.dataset=tfrecord:{pattern}",
                           "--set", f"data.features={FEATURES}")
    assert result["input_sharding"] == "file (2 input pipelines, 4 files)"
    assert "input sharding  file (2 input pipelines, 4 files)" in proc.stdout
    assert result["final"]["val_accuracy"] > 0.85


@pytest.mark.horovod
def test_an_image_folder_is_split_by_path_over_horovod_ranks(tmp_path):
    x, y = digits()
    directory = write_image_folder(tmp_path / "images", x, y)
    _, result = _launch(tmp_path, "--workers", "2", "--config", "configs/horovod.yaml",
                        "--set", f"data.dataset=images:{directory}", "--set", "data.image_size=8")
    assert result["input_sharding"].startswith("file (2 input pipelines, ")
    assert result["final"]["val_accuracy"] > 0.9
