"""The public API: the names docs/api.md lists, exported by each facade and documented there; and the API
as the README uses it, from a fresh interpreter (nothing imported before)."""

import ast
import importlib
import os
import re
import subprocess
import sys
import types

import pytest

from helpers import ROOT, patient

# The public API, facade by facade: each one's `__all__`. Everything else under tfdist/ is internal. The Horovod
# facades' names are Horovod's own modules' (tests/horovod/test_port_names.py).
HOROVOD_FACADES = ["tfdist.horovod.tensorflow", "tfdist.horovod.tensorflow.keras"]
PUBLIC = {
    "tfdist": ["Checkpoint", "ClusterError", "Config", "ConfigError", "HorovodStrategy", "LayoutStrategy",
               "MirroredStrategy", "MultiWorkerMirroredStrategy", "ParameterServerStrategy", "PipelineStrategy",
               "TensorParallelStrategy", "Throughput", "__version__", "fix_tensorflow_strategies", "is_chief",
               "load_config", "make_strategy", "prepare", "remat", "run", "set_distribution", "strategy_from"],
    "tfdist.layers": ["ColumnParallelDense", "ParallelMLP", "ParallelMultiHeadAttention", "RowParallelDense",
                      "ShardedEmbedding", "shard_placement"],
    "tfdist.callbacks": ["Checkpoint", "DeviceMetrics", "EXIT_PREEMPTED", "EXIT_TERMINATED", "InputStalls",
                         "Preemption", "Throughput", "weights_digest"],
    "tfdist.data": ["Digits", "Examples", "Source", "Split", "dataset_fn", "input_pipeline", "load_digits",
                    "load_source", "steps_per_epoch", "training_dataset", "validation_dataset"],
    "tfdist.parallel": ["DeviceGroup"],
}
API_PAGE = os.path.join(ROOT, "docs", "api.md")


def _declared_all(module: str) -> list[str]:
    """A facade's `__all__`, read from its source."""
    path = os.path.join(ROOT, *module.split("."), "__init__.py")
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            return sorted(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


@pytest.mark.parametrize("facade", list(PUBLIC))
def test_each_facade_exports_exactly_the_public_names(facade):
    assert _declared_all(facade) == sorted(PUBLIC[facade])


def _documented() -> dict[int, str]:
    """id -> path of each object docs/api.md documents (its `::: module.Name` lines)."""
    documented = {}
    for path in re.findall(r"^::: (\S+)$", open(API_PAGE).read(), re.M):
        module, _, name = path.rpartition(".")
        try:
            target = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError:  # a name defined in a package's __init__
            target = getattr(importlib.import_module(module.rpartition(".")[0]), module.rpartition(".")[2])
        documented[id(target)] = path
    return documented


def _documented_by_horovod_or_in_text(value) -> bool:
    """A name Horovod defines, passed through unchanged (Horovod documents it), a module, or a plain value
    (`__version__`, the exit codes, Horovod's reduction ops), which the page names in its text."""
    return (isinstance(value, (int, str, types.ModuleType))
            or getattr(value, "__module__", "").startswith("horovod.") or type(value).__module__.startswith("horovod."))


@pytest.mark.horovod
def test_the_api_page_documents_every_public_name_of_tfdists_own_and_nothing_else():
    documented = _documented()
    public = {}  # id -> (facade.name, the object)
    for facade, names in {**PUBLIC, **{facade: _declared_all(facade) for facade in HOROVOD_FACADES}}.items():
        module = importlib.import_module(facade)
        public.update({id(getattr(module, name)): (f"{facade}.{name}", getattr(module, name)) for name in names})
    undocumented = [name for key, (name, value) in public.items()
                    if key not in documented and not _documented_by_horovod_or_in_text(value)]
    assert undocumented == []
    assert [path for key, path in documented.items() if key not in public] == []  # nothing internal


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
