"""Keras's own tf.distribute tests, as installed with Keras, with TensorFlow's MirroredStrategy swapped for a kind of
tfdist's; prints one JSON line: kind -> test id -> "passed", "failed: ERROR" or "skipped".

    python tests/scenarios/keras_own_tests.py KIND...

KIND: `tensorflow` (Keras's tests as they are), `tensorflow_one_replica` (TensorFlow's strategy on the first
device only), `mirrored`, `shard_optimizer_1`, `shard_optimizer_2`, `layout_data`, `layout_model`, `pipeline`,
`tensor_parallel`. Keras's tests make `tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])`; in this process that
name makes the kind's strategy over the same devices. Nothing of Keras's tests is copied: pytest runs the installed modules.
"""

import json
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

KERAS_TESTS = ("keras.src.backend.tensorflow.optimizer_distribute_test",
               "keras.src.backend.tensorflow.distribute_test",
               "keras.src.callbacks.swap_ema_weights_test")


def _strategy_of(kind: str):
    import tfdist

    tfdist.MirroredStrategy  # imported before the name is swapped: tfdist's class extends TensorFlow's

    if kind in ("layout_data", "layout_model"):  # Keras's DataParallel, or its ModelParallel on 2 devices
        from tfdist.parallel.layout import Layout

        layout = Layout(model=1, data=2) if kind == "layout_data" else Layout(model=2, data=1)
        return lambda devices=None, **kwargs: tfdist.LayoutStrategy(layout, devices)
    if kind == "pipeline":  # one replica of 2 stages
        return lambda devices=None, **kwargs: tfdist.PipelineStrategy(2, 2, devices=devices, verbose=False)
    if kind == "tensor_parallel":  # one group of 2: Megatron's split found in the model
        return lambda devices=None, **kwargs: tfdist.TensorParallelStrategy(devices)
    stage = {"mirrored": 0, "shard_optimizer_1": 1, "shard_optimizer_2": 2}[kind]
    return lambda devices=None, **kwargs: tfdist.MirroredStrategy(devices, shard_optimizer=stage, **kwargs)


class _Outcomes:
    def __init__(self):
        self.found = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            outcome = {"passed": "passed", "failed": "failed", "skipped": "skipped"}[report.outcome]
            if outcome == "failed":
                crash = getattr(report.longrepr, "reprcrash", None)
                outcome += ": " + (crash.message if crash else str(report.longrepr)).splitlines()[0][:300]
            self.found.setdefault(report.nodeid.split("::", 1)[1], outcome)


def main():
    tensorflows = tf.distribute.MirroredStrategy
    modules = [__import__(name, fromlist=["_"]).__file__ for name in KERAS_TESTS]
    found = {}
    for kind in sys.argv[1:]:
        tf.distribute.MirroredStrategy = {
            "tensorflow": tensorflows,
            # One replica on the first device: the reference of the kinds that train one replica on both.
            "tensorflow_one_replica": lambda devices=None, **kwargs: tensorflows(devices[:1], **kwargs),
        }.get(kind) or _strategy_of(kind)
        outcomes = _Outcomes()
        pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", os.path.dirname(modules[0]), *modules],
                     plugins=[outcomes])
        found[kind] = outcomes.found
    print(json.dumps(found))


if __name__ == "__main__":
    main()
