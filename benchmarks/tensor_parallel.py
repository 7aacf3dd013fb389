"""`tfdist bench tensor_parallel`: a column-then-row-parallel MLP against the same MLP on one device.

Two logical CPU devices with single-threaded ops (intra-op 1, inter-op 2:
DESIGN.md shows that ops on two such devices run concurrently). The model is
one large `ParallelMLP` block (input width -> hidden -> input width, Megatron's
MLP) trained by `model.fit` with SGD on a repeated batch, so no input work
competes for the cores:

- `tensor_parallel`: under `TensorParallelStrategy` on `/cpu:0` and `/cpu:1`
  (Megatron's split: a replica per device, each holding half of both
  kernels, one sum forward and one backward);
- `one_device`: the identical block under a one-device strategy, i.e. two
  plain Dense matmuls on `/cpu:0`.

Rounds alternate; medians are compared. Figures: `speedup` = one-device
training step time / tensor-parallel step time; `bound` = 2.0 (the group
size); `efficiency` = speedup / bound; `speedup_forward` = the same ratio for
the forward pass alone (`model.predict_on_batch`, Keras's predict step under
the strategy); `max_device_share` = the largest fraction of the MLP's
variable bytes that one device holds (1/N when split evenly; the output
bias is whole on each). Target: speedup >= 1.8.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tfdist.callbacks.throughput import fit_round
from tfdist.timing import alternate, medians

__all__ = ["measure"]

DEVICES = ("/cpu:0", "/cpu:1")
TARGET_SPEEDUP = 1.8


def measure(
    *, repeats: int = 5, width: int = 2048, hidden: int = 8192, batch: int = 256, steps_per_round: int = 5
) -> dict[str, Any]:
    """Times both variants in this process (call before TensorFlow has started)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    import keras

    from tfdist.layers import ParallelMLP
    from tfdist.strategies.devices import ensure_logical_cpus
    from tfdist.strategies.tensor_parallel import TensorParallelStrategy

    ensure_logical_cpus(len(DEVICES))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype("float32")
    dataset = tf.data.Dataset.from_tensors((x, x)).repeat()

    def build(scope):
        with scope:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((width,)), ParallelMLP(hidden, activation="relu")])
            model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        return model

    models = {
        "tensor_parallel": build(TensorParallelStrategy(list(DEVICES)).scope()),
        "one_device": build(tf.distribute.OneDeviceStrategy(DEVICES[0]).scope()),
    }

    def forward_round(model):
        model.predict_on_batch(x)  # traced outside the timing

        def one_round() -> float:
            start = time.perf_counter()
            for _ in range(steps_per_round):
                model.predict_on_batch(x)
            return 1000 * (time.perf_counter() - start) / steps_per_round

        return one_round

    rounds = {name: fit_round(model, dataset, batch=batch, steps=steps_per_round) for name, model in models.items()}
    rounds.update({f"{name}_forward": forward_round(model) for name, model in models.items()})
    samples = alternate(rounds, repeats=repeats)
    step_ms = medians(samples)
    bytes_per_device = _variable_bytes_per_device(models["tensor_parallel"])
    speedup = step_ms["one_device"] / step_ms["tensor_parallel"]
    figures = {
        "speedup": speedup,
        "bound": float(len(DEVICES)),
        "efficiency": speedup / len(DEVICES),
        "speedup_forward": step_ms["one_device_forward"] / step_ms["tensor_parallel_forward"],
        "max_device_share": max(bytes_per_device.values()) / sum(np.asarray(v).nbytes
                                                                 for v in models["tensor_parallel"].weights),
        "meets_speedup_target": speedup >= TARGET_SPEEDUP,
    }
    return {
        "benchmark": "tensor_parallel",
        "strategy": "tensor_parallel",
        "devices": list(DEVICES),
        "global_batch_size": batch,
        "model": {"block": "ParallelMLP", "width": width, "hidden": hidden},
        "threads": {"intra_op": 1, "inter_op": 2},
        "steps_per_round": steps_per_round,
        "repeats": repeats,
        "step_time_ms": step_ms,
        "samples_per_sec": {k: 1000 * batch / v for k, v in step_ms.items()},
        "step": "train: model.fit step with SGD; *_forward: model.predict_on_batch(x)",
        "variable_bytes_per_device": bytes_per_device,
        "samples": samples,
        "figures": figures,
    }


def _variable_bytes_per_device(model) -> dict[str, int]:
    """Bytes of the model's variables by device, every copy and shard (optimizer state excluded)."""
    from tfdist.strategies.replica_groups import bytes_by_device

    return bytes_by_device(model.weights)
