"""`tfdist bench sharded_optimizer`: a mirrored job's optimizer state split over its devices (ZeRO stages
1 and 2), and its weights too (stage 3), against a whole copy of them on every device.

The model is an MLP (784 -> width -> width -> 10) trained with Adam, whose
two slots per weight are the state that is split, under tfdist's
`MirroredStrategy` on logical CPU devices (intra-op 1, inter-op 2 threads),
in four layouts: `unsplit`, `stage_1` (`shard_optimizer=1`: the gradients
all-reduced, each device keeping its slice of the sum), `stage_2`
(`shard_optimizer=2`: the gradients reduce-scattered) and `stage_3`
(`shard_optimizer=3`: the kernels split too, the biases whole).

- **Memory**, on 2 and 4 devices: every optimizer slot variable's bytes,
  summed by the device the variable lives on (after one training step, so
  the optimizer is built); and the gradient bytes each device holds once they
  are reduced, read from a traced training step (an all-reduce's output, or
  the sum of what an all-to-all brought: the reduce-scatter's output).
  `slot_bytes_share_N` and `gradient_bytes_share_N` = the fullest device's
  bytes split / unsplit, per stage; the target is at most 1.15/N. At stage 3
  also the weight bytes by device, and what TensorFlow's allocator measured (its BFC
  kind on every machine, `tfdist.bench.allocator`, named in `memory_measured_by`):
  the peak of a few training steps over the memory in use before the model
  was built, per device (the devices share one process's allocator: divided
  by N). `state_bytes_per_device` counts weights, gradients and Adam's slots
  whole; `peak_bytes_per_device_N` holds each layout's measured peak. The
  stage-3 target: its peak, less what the unsplit job's peak holds beyond its
  state (activations, temporaries), at most 1.15/N of the state plus the
  largest layer's gathered weights.
- **Bytes on the wire** per device and step, from the payloads of the
  collectives in the same traced step and each algorithm's traffic: a ring
  all-reduce sends 2(N-1)/N of its input, a ring all-gather N-1 times its
  input (the other devices' pieces), an all-to-all (N-1)/N of its input. `wire_bytes_ratio_N` = split /
  unsplit, per stage (target: within 10% of unsplit at stage 2; stage 3's
  algorithm moves 3(N-1)/N of the weights against the all-reduce's 2(N-1)/N:
  1.5).
- **Speed**, on 2 devices: samples/sec of `model.fit`, the four layouts in
  alternated rounds, medians compared: `speed_ratio` = split / unsplit, per
  stage (target at least 0.95 at stage 2).
"""

from __future__ import annotations

import collections
import gc
import math
from typing import Any

import numpy as np

from tfdist import _compat
from tfdist.bench import allocator
from tfdist.callbacks.throughput import fit_round
from tfdist.timing import alternate, medians

__all__ = ["measure", "step_collectives"]

DEVICE_COUNTS = (2, 4)
LAYOUTS = {"unsplit": 0, "stage_1": 1, "stage_2": 2, "stage_3": 3}  # shard_optimizer
TARGET_SLOT_SHARE = 1.15  # / N
TARGET_WIRE_RATIO = 1.1
TARGET_SPEED = 0.95


def measure(*, repeats: int = 5, width: int = 1024, batch: int = 256, steps_per_round: int = 20,
            keep_whole_below: int = 10_000) -> dict[str, Any]:
    """Builds and times the four layouts in this process (call before TensorFlow has started).
    `keep_whole_below`: stage 3's threshold (the default splits the kernels, keeps the biases whole)."""
    allocator.count_allocations()
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

    def build(devices: int, stage: int):
        strategy = MirroredStrategy([f"/cpu:{i}" for i in range(devices)], shard_optimizer=stage,
                                    keep_whole_below=keep_whole_below)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(width, activation="relu"),
                                      keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)  # builds the optimizer
        return model

    def slots(model):
        shards = shards_of(model.optimizer)
        return model.optimizer.variables if shards is None else [v for copy in shards.copies for v in copy.variables]

    def measured(devices: int, stage: int):
        """The model, and the peak bytes a few of its training steps took per device over what was in use
        before it was built (the devices share one allocator)."""
        gc.collect()
        before = allocator.current_bytes()
        model = build(devices, stage)
        allocator.reset_peak()
        model.fit(dataset, epochs=1, steps_per_epoch=3, verbose=0)
        return model, (allocator.peak_bytes() - before) / devices

    memory, gradients, wire, peaks, weights = {}, {}, {}, {}, {}
    figures: dict[str, Any] = {}
    models = {}
    for n in DEVICE_COUNTS:
        models[n], peaks[n] = {}, {}
        for name, stage in LAYOUTS.items():
            models[n][name], peaks[n][name] = measured(n, stage)
        weights[n] = {name: _slot_bytes_by_device(model.trainable_variables) for name, model in models[n].items()}
        memory[n] = {name: _slot_bytes_by_device(slots(model)) for name, model in models[n].items()}
        steps = {name: step_collectives(model, (x[:8], y[:8])) for name, model in models[n].items()}
        gradients[n] = {name: step["reduced_bytes_by_device"] for name, step in steps.items()}
        wire[n] = {name: step["wire_bytes_per_device"] for name, step in steps.items()}
        for name in ("stage_1", "stage_2", "stage_3"):
            slot_share = max(memory[n][name].values()) / max(memory[n]["unsplit"].values())
            figures[f"slot_bytes_share_{n}_{name}"] = slot_share
            figures[f"gradient_bytes_share_{n}_{name}"] = (max(gradients[n][name].values())
                                                            / max(gradients[n]["unsplit"].values()))
            figures[f"wire_bytes_ratio_{n}_{name}"] = wire[n][name] / wire[n]["unsplit"]
        figures[f"meets_memory_target_{n}"] = all(
            figures[f"{kind}_bytes_share_{n}_stage_2"] <= TARGET_SLOT_SHARE / n for kind in ("slot", "gradient"))
        figures[f"meets_wire_target_{n}"] = figures[f"wire_bytes_ratio_{n}_stage_2"] <= TARGET_WIRE_RATIO
        figures[f"weight_bytes_share_{n}_stage_3"] = (max(weights[n]["stage_3"].values())
                                                      / max(weights[n]["unsplit"].values()))
        state = 4 * max(weights[n]["unsplit"].values())  # weights, gradients and Adam's two slots
        beyond_state = peaks[n]["unsplit"] - state  # activations and temporaries, alike in every layout
        figures[f"peak_share_{n}_stage_3"] = peaks[n]["stage_3"] / peaks[n]["unsplit"]
        gathered = 4 * max(math.prod(v.shape) for v in models[n]["unsplit"].trainable_variables)  # the largest layer
        figures[f"meets_weight_memory_target_{n}"] = (
            peaks[n]["stage_3"] - beyond_state <= TARGET_SLOT_SHARE / n * state + gathered)

    rounds = {name: fit_round(model, dataset, batch=batch, steps=steps_per_round)
              for name, model in models[DEVICE_COUNTS[0]].items()}
    samples = alternate(rounds, repeats=repeats)
    step_ms = medians(samples)
    for name in ("stage_1", "stage_2", "stage_3"):
        figures[f"speed_ratio_{name}"] = step_ms["unsplit"] / step_ms[name]
    figures["meets_speed_target"] = figures["speed_ratio_stage_2"] >= TARGET_SPEED
    gradient_bytes = sum(math.prod(v.shape) * 4 for v in models[DEVICE_COUNTS[0]]["unsplit"].trainable_variables)
    return {
        "benchmark": "sharded_optimizer",
        "strategy": "mirrored",
        "layouts": LAYOUTS,
        "model": {"mlp": [784, width, width, 10], "optimizer": "adam", "gradient_bytes": gradient_bytes},
        "threads": {"intra_op": 1, "inter_op": 2},
        "slot_bytes_by_device": {str(n): m for n, m in memory.items()},
        "weight_bytes_by_device": {str(n): w for n, w in weights.items()},
        "peak_bytes_per_device": {str(n): p for n, p in peaks.items()},
        "keep_whole_below": keep_whole_below,
        "reduced_gradient_bytes_by_device": {str(n): g for n, g in gradients.items()},
        "wire_bytes_per_device_and_step": {str(n): w for n, w in wire.items()},
        "speed": {"devices": DEVICE_COUNTS[0], "global_batch_size": batch, "steps_per_round": steps_per_round,
                  "repeats": repeats, "step_time_ms": step_ms,
                  "samples_per_sec": {k: 1000 * batch / v for k, v in step_ms.items()}, "samples": samples},
        "memory_measured_by": allocator.describe(),
        "figures": figures,
    }


def step_collectives(model, batch) -> dict[str, Any]:
    """What the collectives of one traced training step of `model` (under a mirrored strategy) hold and
    move: `reduced_bytes_by_device`, the gradient bytes each device holds once they are reduced (an
    all-reduce's output, or the sum of what an all-to-all brought), and `wire_bytes_per_device`, the bytes
    a device sends per step by each algorithm's traffic (the devices send alike)."""
    import tensorflow as tf

    strategy = model.distribute_strategy
    n = strategy.num_replicas_in_sync
    inputs = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch))))
    graph = tf.function(lambda data: strategy.run(model.train_step, args=(data,))).get_concrete_function(inputs).graph
    ops = list(graph.get_operations())
    for function_graph in _compat.graph_functions(graph):
        ops += list(function_graph.get_operations())

    def nbytes(tensors):
        return sum(math.prod(t.shape) * t.dtype.size for t in tensors)

    held, sent = collections.Counter(), collections.Counter()
    for op in ops:
        device = op.device.split("device:")[-1]
        if op.type == "CollectiveReduceV2":  # a ring all-reduce
            held[device] += nbytes(op.outputs)
            sent[device] += 2 * (n - 1) / n * nbytes(op.inputs[:1])
        elif op.type == "CollectiveAllToAllV2":  # a reduce-scatter: each device sums the slices it receives
            held[device] += nbytes([consumer.outputs[0] for consumer in op.outputs[0].consumers()])
            sent[device] += (n - 1) / n * nbytes(op.inputs[:1])
        elif op.type == "CollectiveGatherV2":  # a ring all-gather passes on the other devices' pieces
            sent[device] += (n - 1) * nbytes(op.inputs[:1])
    return {"reduced_bytes_by_device": dict(held), "wire_bytes_per_device": max(sent.values())}


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
