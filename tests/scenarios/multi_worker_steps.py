"""One worker of a two-process MultiWorkerMirroredStrategy job that fits with steps_per_execution=3.

`python multi_worker_steps.py TF_CONFIG OUT [COMPRESSION [ACCUMULATION]]` saves the trained weights
and the History to OUT (.npz) when this task is the chief; COMPRESSION (float16, bfloat16, or none)
is the gradients' dtype on the wire, ACCUMULATION the optimizer's gradient_accumulation_steps.
test_multi_worker.py starts two.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist import MultiWorkerMirroredStrategy  # noqa: E402


def data():
    """64 examples in batches of 8: an epoch is 3 + 3 + 2 steps."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal((64, 2)).astype("float32")


def build(steps_per_execution=3, accumulation=1):
    """The seeded, compiled model, in the strategy scope the caller opened."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    accumulating = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1, **accumulating),
                  steps_per_execution=steps_per_execution)
    return model


def train(strategy, accumulation=1):
    with strategy.scope():
        model = build(accumulation=accumulation)
    history = model.fit(*data(), batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return model, history

if __name__ == "__main__":
    os.environ["TF_CONFIG"] = sys.argv[1]
    compression = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
    accumulation = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    model, history = train(MultiWorkerMirroredStrategy(gradient_compression=compression), accumulation=accumulation)
    if json.loads(sys.argv[1])["task"]["index"] == 0:
        np.savez(sys.argv[2], *model.get_weights(), loss=np.array(history["loss"]),
                 iterations=int(model.optimizer.iterations.numpy()))
