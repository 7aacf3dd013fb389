"""The `tfdist` command: exit codes and one-line errors."""

import pytest
import yaml

from helpers import run_tfdist
from tfdist.config import Config, from_dict


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
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_tfdist(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("tfdist: error:")]
    assert len(error_lines) == 1, proc.stderr
    assert message in error_lines[0]


def test_yaml_tag_in_file_is_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    proc = run_tfdist("config", "--config", str(path))
    assert proc.returncode == 2
    assert "may not use YAML tags" in proc.stderr
    assert not marker.exists()
