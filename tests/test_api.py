"""The public API as the README uses it, from a fresh interpreter (nothing imported before)."""

import subprocess
import sys

import pytest

from helpers import ROOT, patient

ATTRIBUTES = [
    "tfdist.layers.ColumnParallelDense",
    "tfdist.callbacks.DeviceMetrics",
    "tfdist.data.input_pipeline",
    "tfdist.strategies.MirroredStrategy",
    "tfdist.parallel.DeviceGroup",
    "tfdist.MirroredStrategy",
    "tfdist.MultiWorkerMirroredStrategy",
    "tfdist.PipelineStrategy",
]


def test_subpackages_and_strategies_are_reachable_after_import_tfdist():
    script = "import tfdist\n" + "".join(f"print({name}.__name__)\n" for name in ATTRIBUTES)
    proc = _fresh(script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [name.rsplit(".", 1)[1] for name in ATTRIBUTES]


def test_an_unknown_attribute_is_still_an_attribute_error():
    proc = _fresh("import tfdist; tfdist.no_such_thing")
    assert proc.returncode == 1 and "module 'tfdist' has no attribute 'no_such_thing'" in proc.stderr


def _fresh(script):
    """`python -c SCRIPT` in a process of its own."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=patient(120),
                          cwd=ROOT)


def _skip_with_gpus():
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("about hosts without GPUs; this one has GPUs, which strategies use instead")


def test_a_pipeline_on_a_cpu_only_host_splits_the_cpu_when_it_still_can():
    _skip_with_gpus()
    proc = _fresh("import tfdist; s = tfdist.PipelineStrategy(2, 4, verbose=False); print(len(s.devices))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "2"


def test_a_pipeline_after_tensorflow_started_names_the_fix():
    _skip_with_gpus()
    proc = _fresh("import tensorflow as tf, tfdist; tf.constant(1); tfdist.PipelineStrategy(2, 4)")
    assert proc.returncode == 1
    assert "ValueError: this strategy needs 2 devices and TensorFlow already started with 1 CPU" in proc.stderr
    assert "tfdist.strategies.devices.ensure_logical_cpus(2)" in proc.stderr
