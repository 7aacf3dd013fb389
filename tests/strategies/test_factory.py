"""Config -> strategy, and the machine-dependent config errors."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf
from tensorflow.python.framework.config import is_op_determinism_enabled  # no public getter in TF 2.21

from tfdist import ConfigError, load_config, make_strategy
from tfdist.config.kinds import KINDS
from tfdist.strategies import MultiWorkerMirroredStrategy, factory
from tfdist.strategies.replica_groups import make_process_group
from tfdist.cluster.resolver import cluster_resolver

from helpers import patient, run_tfdist
import zygote


def _strategy(*overrides):
    return make_strategy(load_config(None, list(overrides)))


def _cross_device_ops(strategy):
    return strategy.extended._cross_device_ops  # what MirroredStrategy was given


def test_default_is_mirrored_over_the_logical_cpus():
    strategy = _strategy()
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 4
    assert [d.split(":")[-2:] for d in strategy.extended.worker_devices] == [
        ["CPU", str(i)] for i in range(4)
    ]


def test_one_device():
    strategy = _strategy("strategy.kind=one_device", "strategy.devices=[/cpu:1]")
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.extended.worker_devices[0].endswith("CPU:1")


@pytest.mark.parametrize(
    "all_reduce,ops_type",
    [
        ("hierarchical_copy", tf.distribute.HierarchicalCopyAllReduce),
        ("reduction_to_one_device", tf.distribute.ReductionToOneDevice),
    ],
)
def test_mirrored_uses_the_chosen_cross_device_ops(all_reduce, ops_type):
    strategy = _strategy(f"strategy.all_reduce={all_reduce}", "strategy.devices=[/cpu:0, /cpu:1]")
    assert isinstance(_cross_device_ops(strategy), ops_type)
    assert strategy.num_replicas_in_sync == 2


def test_hierarchical_copy_num_packs():
    strategy = _strategy("strategy.all_reduce=hierarchical_copy", "strategy.num_packs=2")
    assert _cross_device_ops(strategy)._num_packs == 2


def test_nccl_without_gpus_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^`strategy.all_reduce` nccl needs GPUs"):
        _strategy("strategy.all_reduce=nccl")


def test_devices_that_do_not_exist():
    with pytest.raises(ConfigError, match=r"^`strategy.devices\[1\]` names a device that does not exist.*4 CPU"):
        _strategy("strategy.devices=[/cpu:0, /cpu:9]")
    with pytest.raises(ConfigError, match=r"^`strategy.devices\[0\]` names a device that does not exist.*0 GPU"):
        _strategy("strategy.devices=[/gpu:0]")


def test_batch_must_split_over_replicas():
    with pytest.raises(ConfigError, match=r"^`train.global_batch_size` must be divisible .* \(4\)"):
        _strategy("train.global_batch_size=30")


def test_logical_devices_cannot_grow_after_tensorflow_started():
    tf.constant(1.0)  # make sure the runtime is initialised
    with pytest.raises(ConfigError, match=r"^`strategy.logical_devices` cannot be raised to 8"):
        _strategy("strategy.logical_devices=8")


def test_tpu_without_a_tpu_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^`strategy.kind` tpu needs a TPU, and none was found"):
        _strategy("strategy.kind=tpu")


def test_every_kind_in_the_table_has_a_builder_and_a_row_without_one_is_a_config_error(monkeypatch):
    assert set(factory._BUILDERS) == set(KINDS)
    monkeypatch.setitem(KINDS, "unbuilt", dataclasses.replace(KINDS["mirrored"], name="unbuilt"))
    with pytest.raises(ConfigError, match="^`strategy.kind` unbuilt is in the kinds table but has no builder"):
        _strategy("strategy.kind=unbuilt")


def test_only_a_strategy_over_processes_is_a_process_group():
    # `process_group()` is the contract's: a one-process strategy answers with its default, a clear refusal.
    with pytest.raises(ValueError, match="Received: a OneDeviceStrategy"):
        make_process_group(tf.distribute.OneDeviceStrategy("/cpu:0"))
    with pytest.raises(ValueError, match="`data_parallel` must be one of local, multi_worker, horovod"):
        make_process_group("ring")
    assert make_process_group("local") is None


def test_single_worker_multi_worker_mirrored(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = _strategy("strategy.kind=multi_worker_mirrored", "strategy.all_reduce=ring")
    assert isinstance(strategy, MultiWorkerMirroredStrategy)
    assert strategy.num_replicas_in_sync == 1


def test_cluster_section_becomes_the_resolver(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = load_config(
        None,
        [
            "strategy.kind=multi_worker_mirrored",
            "cluster.workers=[127.0.0.1:2001, 127.0.0.1:2002]",
            "cluster.task_index=1",
        ],
    )
    resolver = cluster_resolver(config)
    assert resolver.cluster_spec().as_dict() == {"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_tf_config_is_used_and_checked(monkeypatch):
    kind = "strategy.kind=multi_worker_mirrored"
    cluster = {"cluster": {"worker": ["localhost:2001", "localhost:2002"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    resolver = cluster_resolver(load_config(None, [kind]))
    assert resolver.cluster_spec().as_dict()["worker"] == ["localhost:2001", "localhost:2002"]

    with pytest.raises(ConfigError, match=r"^`cluster.workers` conflicts with the TF_CONFIG"):
        cluster_resolver(load_config(None, [kind, "cluster.workers=[127.0.0.1:1]"]))

    cluster["cluster"]["worker"][1] = "192.168.1.7:2002"
    monkeypatch.setenv("TF_CONFIG", json.dumps(cluster))
    with pytest.raises(ConfigError, match=r"^`TF_CONFIG.cluster.worker\[1\]` must be a loopback address"):
        cluster_resolver(load_config(None, [kind]))

    cluster["cluster"]["worker"][1] = "localhost:2002"
    for task, message in [({"type": "worker", "index": 2}, r"^`TF_CONFIG.task.index` must be below the number of "
                                                             r"worker tasks \(2\)\. Received: 2\."),
                          ({"type": "ps", "index": 0}, r"^`TF_CONFIG.task.type` must be a job of TF_CONFIG.cluster")]:
        monkeypatch.setenv("TF_CONFIG", json.dumps({**cluster, "task": task}))
        with pytest.raises(ConfigError, match=message):
            cluster_resolver(load_config(None, [kind]))

    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ConfigError, match=r"^`TF_CONFIG` must be JSON"):
        cluster_resolver(load_config(None, [kind]))


def test_precision_policy_is_applied():
    import keras

    _strategy("precision.policy=mixed_bfloat16")
    assert keras.mixed_precision.dtype_policy().name == "mixed_bfloat16"


def test_missing_horovod_is_one_clear_line(tmp_path):
    fake = tmp_path / "horovod"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('simulated: no horovod here')\n")
    proc = run_tfdist(
        "train", "--config", "configs/horovod.yaml",
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "horovod needs Horovod" in proc.stderr and "tools/install_horovod.sh" in proc.stderr


def test_an_unknown_op_is_refused_before_horovod_starts():
    from tfdist import HorovodStrategy

    with pytest.raises(ValueError, match="`op` must be one of average, sum, adasum"):
        HorovodStrategy(op="mean")


def test_deterministic_ops_switches_on_op_determinism():
    # Op determinism is process-wide and cannot be switched off again, so it is tried in a process of its own.
    code = ("from tensorflow.python.framework.config import is_op_determinism_enabled; "
            "from tfdist import load_config, make_strategy; "
            "make_strategy(load_config(None, ['runtime.deterministic_ops=true'])); print(is_op_determinism_enabled())")
    proc = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
    assert not is_op_determinism_enabled()  # off unless asked for


def test_a_mirrored_strategy_makes_the_cpus_it_names_or_says_it_cannot():
    """Its replicas would otherwise wait forever on a CPU device that does not exist."""
    code = ("import tfdist; s = tfdist.MirroredStrategy(['/cpu:0', '/cpu:2']); "
            "import tensorflow as tf; print(len(tf.config.list_logical_devices('CPU')), s.num_replicas_in_sync); "
            "tfdist.MirroredStrategy(['/cpu:0', '/cpu:5'])")
    proc = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120))
    assert proc.stdout.strip().splitlines()[-1] == "3 2"
    assert proc.returncode == 1
    assert ("ConfigError: `strategy.logical_devices` cannot be raised to 6: TensorFlow already initialised "
            "with 3 CPU device(s)") in proc.stderr


def _faults_per_step(trim: str) -> float:
    script = os.path.join(os.path.dirname(__file__), "..", "scenarios", "allocator_faults.py")
    proc = subprocess.run([sys.executable, script, trim], capture_output=True, text=True, timeout=patient(300),
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["faults_per_step"]


def test_the_strategy_takes_back_tensorflows_allocator_trimming_unless_asked_to_keep_it():
    """TensorFlow's generator datasets (every fit under a strategy) set glibc's trim threshold, which maps
    and unmaps every tensor of 128 KB or more each step; tfdist sets the allocator back, so the default
    job's steps (half-megabyte activations) reuse their memory instead of faulting it in again."""
    kept, trimmed = _faults_per_step("false"), _faults_per_step("true")
    assert trimmed > 1000 and kept < 0.2 * trimmed, (kept, trimmed)
