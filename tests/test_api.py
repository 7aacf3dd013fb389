"""The public API as the README uses it, from a fresh interpreter (nothing imported before)."""

import subprocess
import sys

from helpers import ROOT

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
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [name.rsplit(".", 1)[1] for name in ATTRIBUTES]


def test_an_unknown_attribute_is_still_an_attribute_error():
    proc = subprocess.run(
        [sys.executable, "-c", "import tfdist; tfdist.no_such_thing"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 1 and "module 'tfdist' has no attribute 'no_such_thing'" in proc.stderr
