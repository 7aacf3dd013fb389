"""Config loading: defaults, presets, overrides, and every kind of bad input."""

import dataclasses
import glob
import os

import pytest
import yaml

from tfdist import ConfigError
from tfdist.config import Config, from_dict, load_config, to_dict
from tfdist.config.validation import check_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_are_data_parallel():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.strategy.kind == "mirrored" and cfg.strategy.kind.value == "mirrored"  # as when it was an enum
    assert cfg.strategy.logical_devices == 4


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_preset_loads(path):
    assert isinstance(load_config(path), Config)


def test_overrides_are_parsed_as_yaml_and_applied_last(tmp_path):
    path = _write(tmp_path, "train:\n  epochs: 7\n")
    cfg = load_config(
        path,
        [
            "train.epochs=3",
            "strategy.devices=[/cpu:0, /cpu:1]",
            "precision.policy=mixed_bfloat16",
            "train.learning_rate=1e-3",
        ],
    )
    assert cfg.train.epochs == 3
    assert cfg.strategy.devices == ("/cpu:0", "/cpu:1")
    assert cfg.precision.policy.value == "mixed_bfloat16"
    assert cfg.train.learning_rate == pytest.approx(1e-3)


def test_to_dict_round_trips_through_yaml():
    cfg = load_config(None, ["strategy.devices=[/cpu:0]", "precision.loss_scale=128"])
    again = from_dict(yaml.safe_load(yaml.safe_dump(to_dict(cfg))))
    assert again == cfg


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_config(None).train.epochs = 3


def test_float_fields_accept_integers():
    assert load_config(None, ["train.learning_rate=1"]).train.learning_rate == 1.0


def test_loss_scale_number():
    cfg = load_config(None, ["precision.policy=mixed_float16", "precision.loss_scale=1024"])
    assert cfg.precision.loss_scale == 1024.0


def test_unscaled_float16_with_opt_in():
    cfg = load_config(
        None,
        [
            "precision.policy=mixed_float16",
            "precision.loss_scale=none",
            "precision.allow_unscaled_float16=true",
        ],
    )
    assert cfg.precision.loss_scale == "none"


def test_data_parallel_pipelines_take_their_backends_settings():
    # A pipeline or tensor-parallel job with data_parallel starts like that backend's jobs and takes its settings.
    horovod = load_config(None, ["strategy.kind=pipeline", "strategy.data_parallel=horovod",
                                 "horovod.fusion_threshold_bytes=0", "pipeline.num_micro_batches=8"])
    assert horovod.strategy.launched_as.name == "horovod"
    workers = load_config(None, ["strategy.kind=tensor_parallel", "model.name=transformer",
                                 "strategy.data_parallel=multi_worker", "cluster.workers=[127.0.0.1:2222]",
                                 "strategy.bytes_per_pack=1024"])
    assert workers.strategy.launched_as.name == "multi_worker_mirrored"
    assert load_config(None, ["strategy.kind=pipeline"]).strategy.launched_as.name == "pipeline"


def test_loopback_cluster_and_explicit_opt_in():
    workers = "cluster.workers=[127.0.0.1:2222, 'localhost:2223']"
    cfg = load_config(None, ["strategy.kind=multi_worker_mirrored", workers])
    assert len(cfg.cluster.workers) == 2
    cfg = load_config(
        None,
        [
            "strategy.kind=multi_worker_mirrored",
            "cluster.workers=[10.1.2.3:2222]",
            "cluster.allow_non_loopback=true",
        ],
    )
    assert cfg.cluster.workers == ("10.1.2.3:2222",)


# (overrides, dotted key in the message, a phrase of the rule)
BAD_OVERRIDES = [
    (["train.epoch=3"], "train.epoch", "Did you mean `train.epochs`"),
    (["trian.epochs=3"], "trian", "Did you mean `train`"),
    (["strategy.kindd=mirrored"], "strategy.kindd", "Did you mean `strategy.kind`"),
    (["train.epochs=ten"], "train.epochs", "must be an integer"),
    (["train.epochs=2.5"], "train.epochs", "must be an integer"),
    (["train.epochs=true"], "train.epochs", "must be an integer"),
    (["train.learning_rate=fast"], "train.learning_rate", "must be a number"),
    (["train.learning_rate=.nan"], "train.learning_rate", "finite number"),
    (["train.learning_rate=inf"], "train.learning_rate", "must be a number"),
    (["callbacks.tensorboard_dir=[a]"], "callbacks.tensorboard_dir", "must be a string"),
    (["precision.allow_unscaled_float16=yes please"], "precision.allow_unscaled_float16", "true or false"),
    (["strategy.devices=/cpu:0"], "strategy.devices", "must be a list"),
    (["strategy.devices=[1]"], "strategy.devices[0]", "must be a string"),
    (["train.epochs=0"], "train.epochs", ">= 1"),
    (["train.global_batch_size=-8"], "train.global_batch_size", ">= 1"),
    (["train.learning_rate=0"], "train.learning_rate", "> 0"),
    (["data.validation_fraction=0.95"], "data.validation_fraction", "<= 0.9"),
    (["strategy.logical_devices=1000"], "strategy.logical_devices", "<= 64"),
    (["train.verbose=3"], "train.verbose", "<= 2"),
    (["strategy.kind=mirored"], "strategy.kind", "Did you mean 'mirrored'"),
    (["precision.policy=float16"], "precision.policy", "must be one of float32"),
    (["train.optimizer=adagrad"], "train.optimizer", "must be one of sgd"),
    (["strategy.all_reduce=ring"], "strategy.all_reduce", "with strategy.kind=mirrored"),
    (
        ["strategy.kind=multi_worker_mirrored", "strategy.all_reduce=hierarchical_copy"],
        "strategy.all_reduce",
        "auto, ring, nccl",
    ),
    (["placement.balance_by_memory=true"], "placement", "only applies with strategy.kind=tensor_parallel"),
    (["strategy.kind=tensor_parallel", "model.name=transformer", "placement.layers=[embed]"],
     "placement.layers[0]", "must be `layer_name=device`"),
    (["strategy.kind=tensor_parallel", "model.name=transformer", "placement.layers=[embed=/cpu:1]",
      "placement.balance_by_memory=true"], "placement.balance_by_memory", "exclude each other"),
    (["strategy.num_packs=4"], "strategy.num_packs", "only applies to all_reduce nccl"),
    (["strategy.bytes_per_pack=1024"], "strategy.bytes_per_pack", "multi_worker_mirrored"),
    (["strategy.devices=[gpu0]"], "strategy.devices[0]", "local device name"),
    (["strategy.devices=[/cpu:0, /CPU:0]"], "strategy.devices", "twice"),
    (["strategy.kind=one_device", "strategy.devices=[/cpu:0, /cpu:1]"], "strategy.devices", "at most 1 device with"),
    (["precision.policy=mixed_float16", "precision.loss_scale=none"], "precision.loss_scale", "allow_unscaled_float16"),
    (["precision.loss_scale=-4"], "precision.loss_scale", "positive number"),
    (["precision.loss_scale=huge"], "precision.loss_scale", "dynamic, none or a positive number"),
    (["precision.loss_scale=true"], "precision.loss_scale", "must be a str or float"),
    (["train.warmup_epochs=2"], "train.warmup_epochs", "scale_learning_rate"),
    (["train.scale_learning_rate=true", "train.warmup_epochs=50"], "train.warmup_epochs", "must not exceed"),
    (
        ["strategy.kind=multi_worker_mirrored", "cluster.workers=[10.0.0.5:2222]"],
        "cluster.workers[0]",
        "loopback",
    ),
    (
        ["strategy.kind=multi_worker_mirrored", "cluster.workers=[127.0.0.1]"],
        "cluster.workers[0]",
        "host:port",
    ),
    (
        ["strategy.kind=multi_worker_mirrored", "cluster.workers=[127.0.0.1:1]", "cluster.task_index=1"],
        "cluster.task_index",
        "below the number",
    ),
    (["cluster.workers=[127.0.0.1:2222]"], "cluster.workers", "only used by the kinds whose processes find each other through it"),
    (["cluster.resolver=kubernetes"], "cluster.resolver", "kubernetes applies to multi_worker_mirrored"),
    (["strategy.kind=multi_worker_mirrored", "cluster.resolver=kubernetes", "cluster.workers=[127.0.0.1:1]"],
     "cluster.resolver", "kubernetes finds the tasks itself"),
    (["checkpoint.dir=c", "callbacks.backup_dir=b"], "checkpoint.dir", "both resume a job; keep one"),
    (["strategy.kind=horovod", "checkpoint.every_seconds=60"], "checkpoint.every_seconds",
     "saves at the same step in every process"),
    (["checkpoint.keep=0"], "checkpoint.keep", ">= 1"),
    (["strategy.data_parallel=horovod"], "strategy.data_parallel",
     "only applies to strategy.kind=pipeline, tensor_parallel or layout"),
    (["strategy.data_parallel=everywhere"], "strategy.data_parallel", "one of"),
    (["strategy.kind=pipeline", "strategy.data_parallel=horovod", "horovod.backward_passes_per_step=2"],
     "horovod.backward_passes_per_step", "accumulates over pipeline.num_micro_batches"),
    (["strategy.kind=pipeline", "horovod.fusion_threshold_bytes=0"], "horovod", "only applies with strategy.kind=horovod"),
    (["strategy.kind=horovod", "horovod.elastic=true", "horovod.cycle_time_ms=5"], "horovod.cycle_time_ms",
     "crashes .segmentation fault. re-forming its ranks"),
    (["strategy.kind=pipeline", "strategy.data_parallel=horovod", "horovod.elastic=true"], "horovod.elastic",
     "tensor-parallel job over Horovod ranks is not elastic"),
    (["strategy.kind=horovod", "horovod.elastic_commit_batches=0"], "horovod.elastic_commit_batches", ">= 1"),
    (["strategy.kind=pipeline", "strategy.data_parallel=multi_worker", "checkpoint.every_seconds=60"],
     "checkpoint.every_seconds", "saves at the same step in every process"),
    (["strategy.kind=tpu", "strategy.devices=[/cpu:0]"], "strategy.devices", "cannot be set"),
    (["train.epochs.max=3"], "train.epochs", "must be an integer"),
    (["epochs=3"], "--set", "section.key=value"),
    (["train.epochs"], "--set", "section.key=value"),
    (["train.epochs=[1"], "train.epochs", "not a valid YAML scalar"),
]


@pytest.mark.parametrize("overrides,key,rule", BAD_OVERRIDES)
def test_bad_override_names_key_rule_and_value(overrides, key, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith(f"`{key}`")
    assert "Received:" in message
    assert info.value.key == key


@pytest.mark.parametrize("overrides,key,rule", [
    (["strategy.kind=tensor_parallel"], "model.name", "must be transformer with strategy.kind=tensor_parallel"),
    (["model.name=transformer", "model.width=30", "model.heads=4"], "model.width", "must divide by model.heads"),
])
def test_the_model_of_tfdist_train_is_checked_for_its_job_not_for_a_strategy(overrides, key, rule):
    config = load_config(None, overrides)  # a user's own script under tensor_parallel builds its own model
    with pytest.raises(ConfigError, match=f"^`{key}` {rule}"):
        check_job(config)


BAD_FILES = [
    ("", "is empty"),
    ("   \n\n", "is empty"),
    ("# just a comment\n", "holds no settings"),
    ("- a\n- b\n", "not a list"),
    ("just a string\n", "not a str"),
    ("train: [1, 2\n", "not valid YAML at line"),
    ("train:\n  epochs: 3\n bad indent: 1\n", "not valid YAML"),
    ("!!python/object/apply:os.system ['echo hacked']\n", "may not use YAML tags"),
    ("train: !!python/object:tfdist.config.schema.TrainConfig {}\n", "may not use YAML tags"),
    ("train:\n  epochs: !custom 3\n", "may not use YAML tags"),
]


@pytest.mark.parametrize("text,rule", BAD_FILES)
def test_bad_file(tmp_path, text, rule):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rule) as info:
        load_config(path)
    assert str(info.value).startswith("`config`")
    assert f"Received: {path!r}" in str(info.value)


def test_section_that_is_not_a_mapping(tmp_path):
    path = _write(tmp_path, "train: 3\n")
    with pytest.raises(ConfigError, match=r"^`train` must be a mapping of keys to values\. Received: 3\.$"):
        load_config(path)


def test_override_into_a_scalar_section(tmp_path):
    path = _write(tmp_path, "train: 3\n")
    with pytest.raises(ConfigError, match=r"^`train` must be a mapping to set a key inside it"):
        load_config(path, ["train.epochs=2"])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="must name an existing YAML file"):
        load_config(str(tmp_path / "nope.yaml"))


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError, match="must name an existing YAML file"):
        load_config(str(tmp_path))


def test_unknown_top_level_key_in_file(tmp_path):
    path = _write(tmp_path, "strategy:\n  kind: mirrored\nmodle:\n  name: mlp\n")
    with pytest.raises(ConfigError, match=r"`modle` is not a known key\. Did you mean `model`\?"):
        load_config(path)


def test_nothing_is_constructed_by_a_python_tag(tmp_path):
    marker = tmp_path / "marker"
    path = _write(tmp_path, f"!!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError):
        load_config(path)
    assert not marker.exists()


BAD_PIPELINE = [
    (["pipeline.num_stages=3"], "pipeline", "only applies with strategy.kind=pipeline"),
    (["parameter_server.num_workers=3"], "parameter_server", "only applies with strategy.kind=parameter_server"),
    (["strategy.kind=parameter_server", "cluster.ps=[127.0.0.1:2222]"], "cluster.chief", "must be set too"),
    (["strategy.kind=parameter_server", "cluster.chief=10.1.2.3:2222", "cluster.ps=[127.0.0.1:1]",
      "cluster.workers=[127.0.0.1:2]"], "cluster.chief", "must be a loopback address"),
    (["strategy.kind=parameter_server", "cluster.chief=127.0.0.1:1", "cluster.ps=[127.0.0.1:2]",
      "cluster.workers=[127.0.0.1:3]", "cluster.task_type=ps", "cluster.task_index=1"],
     "cluster.task_index", "below the number of ps tasks \\(1\\)"),
    (["strategy.kind=multi_worker_mirrored", "cluster.ps=[127.0.0.1:2]"], "cluster.ps",
     "only applies to strategy.kind=parameter_server"),
    (["cluster.task_type=boss"], "cluster.task_type", "chief"),
    (["strategy.kind=pipeline", "pipeline.boundaries=[a, b]"], "pipeline.boundaries", "must name 1 layer"),
    (["strategy.kind=pipeline", "pipeline.num_stages=3", "pipeline.boundaries=[a, a]"], "pipeline.boundaries", "twice"),
    (["strategy.kind=pipeline", "pipeline.schedule=1f2b"], "pipeline.schedule", "Did you mean '1f1b'"),
    (["strategy.kind=pipeline", "pipeline.num_micro_batches=0"], "pipeline.num_micro_batches", ">= 1"),
    (["strategy.kind=pipeline", "pipeline.balance_by=flops"], "pipeline.balance_by", "time, params"),
    (["horovod.fp16_compression=true"], "horovod", "only applies with strategy.kind=horovod"),
    (["strategy.kind=horovod", "horovod.op=mean"], "horovod.op", "average, sum, adasum"),
    (["strategy.kind=horovod", "horovod.backward_passes_per_step=0"], "horovod.backward_passes_per_step", ">= 1"),
    (["strategy.kind=horovod", "horovod.cycle_time_ms=0"], "horovod.cycle_time_ms", "> 0"),
    (["strategy.kind=horovod", "strategy.devices=[/cpu:0]"], "strategy.devices", "cannot be set"),
]


@pytest.mark.parametrize("overrides,key,rule", BAD_PIPELINE)
def test_bad_pipeline_config(overrides, key, rule):
    with pytest.raises(ConfigError, match=rule) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(f"`{key}`")


@pytest.mark.parametrize(
    "text,key,lines",
    [
        ("train:\n  epochs: 3\n  epochs: 5\n", "train.epochs", "lines 2 and 3"),
        ("train:\n  epochs: 3\nmodel:\n  width: 8\ntrain:\n  epochs: 5\n", "train", "lines 1 and 5"),
    ],
)
def test_a_key_set_twice_is_refused_naming_it(tmp_path, text, key, lines):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^`{key}` is set twice in .*twice.yaml \\({lines}\\); keep one."):
        load_config(str(path))
