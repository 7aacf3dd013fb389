"""`tfdist bench sharded_optimizer`: a mirrored job's optimizer state split over its devices (ZeRO stage 1)
against a whole copy of it on every device.

The model is an MLP (784 -> width -> width -> 10) trained with Adam, whose
two slots per weight are the state that is split, under tfdist's
`MirroredStrategy` on logical CPU devices (intra-op 1, inter-op 2 threads).

- **Memory**, on 2 and 4 devices: every optimizer slot variable's bytes,
  summed by the device the variable lives on (after one training step, so
  the optimizer is built). `slot_bytes_share_N` = the fullest device's slot
  bytes split / unsplit; the target is at most 1.15/N.
- **Bytes on the wire** per device and step, from the payloads a step hands
  its collectives and the ring algorithm's traffic for them: unsplit, one
  all-reduce of the gradients (2(N-1)/N of their bytes); split, the same
  all-reduce of the gradients packed slice by slice (padded to N equal
  slices) plus the all-gather of the updated slices ((N-1)/N). TensorFlow has
  no reduce-scatter kernel on CPUs (NCCL only), which would halve the
  all-reduce's share. `wire_bytes_ratio_N` = split / unsplit.
- **Speed**, on 2 devices: samples/sec of `model.fit`, the two jobs in
  alternated rounds, medians compared: `speed_ratio` = split / unsplit
  (target at least 0.95).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tfdist.bench.timing import alternate, fit_round, medians

__all__ = ["measure"]

DEVICE_COUNTS = (2, 4)
TARGET_SLOT_SHARE = 1.15  # / N
TARGET_SPEED = 0.95


def measure(*, repeats: int = 5, width: int = 1024, batch: int = 256, steps_per_round: int = 20) -> dict[str, Any]:
    """Builds and times both layouts in this process (call before TensorFlow has started)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    import keras

    from tfdist.parallel.optimizer_shards import shards_of
    from tfdist.strategies.data_parallel import MirroredStrategy
    from tfdist.strategies.devices import ensure_logical_cpus

    ensure_logical_cpus(max(DEVICE_COUNTS))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 784)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()

    def build(devices: int, split: bool):
        strategy = MirroredStrategy([f"/cpu:{i}" for i in range(devices)], shard_optimizer=int(split))
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(width, activation="relu"),
                                      keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)  # builds the optimizer
        return model

    gradient_bytes = None
    memory, wire = {}, {}
    figures: dict[str, Any] = {}
    models = {}
    for n in DEVICE_COUNTS:
        whole, split = build(n, split=False), build(n, split=True)
        models[n] = {"unsplit": whole, "split": split}
        shards = shards_of(split.optimizer)
        memory[n] = {"unsplit": _slot_bytes_by_device(whole.optimizer.variables),
                     "split": _slot_bytes_by_device(v for copy in shards.copies for v in copy.variables)}
        gradient_bytes = sum(math.prod(v.shape) * 4 for v in whole.trainable_variables)
        packed = n * sum(piece.shape[0] for piece in shards.slices[0]) * 4  # every slice, padded
        wire[n] = {"unsplit": 2 * (n - 1) / n * gradient_bytes,
                   "split": 2 * (n - 1) / n * packed + (n - 1) / n * packed}
        figures[f"slot_bytes_share_{n}"] = max(memory[n]["split"].values()) / max(memory[n]["unsplit"].values())
        figures[f"meets_memory_target_{n}"] = figures[f"slot_bytes_share_{n}"] <= TARGET_SLOT_SHARE / n
        figures[f"wire_bytes_ratio_{n}"] = wire[n]["split"] / wire[n]["unsplit"]

    rounds = {name: fit_round(model, dataset, batch=batch, steps=steps_per_round)
              for name, model in models[DEVICE_COUNTS[0]].items()}
    samples = alternate(rounds, repeats=repeats)
    step_ms = medians(samples)
    figures["speed_ratio"] = step_ms["unsplit"] / step_ms["split"]
    figures["meets_speed_target"] = figures["speed_ratio"] >= TARGET_SPEED
    return {
        "benchmark": "sharded_optimizer",
        "strategy": "mirrored",
        "stage": 1,
        "model": {"mlp": [784, width, width, 10], "optimizer": "adam", "gradient_bytes": gradient_bytes},
        "threads": {"intra_op": 1, "inter_op": 2},
        "slot_bytes_by_device": {str(n): m for n, m in memory.items()},
        "wire_bytes_per_device_and_step": {str(n): w for n, w in wire.items()},
        "speed": {"devices": DEVICE_COUNTS[0], "global_batch_size": batch, "steps_per_round": steps_per_round,
                  "repeats": repeats, "step_time_ms": step_ms,
                  "samples_per_sec": {k: 1000 * batch / v for k, v in step_ms.items()}, "samples": samples},
        "figures": figures,
    }


def _slot_bytes_by_device(variables) -> dict[str, int]:
    """Bytes of the optimizer's slot variables (its scalars left out) by the device each copy lives on."""
    totals: dict[str, int] = {}
    for variable in variables:
        if len(variable.shape) == 0:
            continue
        for value in getattr(variable.value, "values", (variable.value,)):  # a mirrored variable: each copy
            device = value.device.split("device:")[-1]
            totals[device] = totals.get(device, 0) + math.prod(value.shape) * value.dtype.size
    return totals
