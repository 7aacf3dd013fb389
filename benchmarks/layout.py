"""`tfdist bench layout`: keras-hub's Gemma and Llama split by their own layout maps, against one device.

Two logical CPU devices with single-threaded ops (intra-op 1, inter-op 2, as
`tensor_parallel`): a `GemmaCausalLM` and a `LlamaCausalLM` of the same size
(4 layers, hidden 512, feed-forward 2048, 8 heads of 64, vocabulary 4096,
random weights, batch 8 of 128 tokens) trained by `model.fit` with Adam on a
repeated batch of synthetic tokens, and `mlp`, the tensor_parallel
benchmark's MLP (2048 -> 8192 -> 2048, batch 256, SGD) as plain Dense layers
split by a user's LayoutMap (columns, then rows: one Megatron pair), each:

- `NAME_layout`: under `tfdist.LayoutStrategy` from its layout map on a
  1 x 2 mesh (data x model), each device holding half of every matched
  kernel and of its optimizer slots;
- `NAME_one_device`: the same model on `/cpu:0`.

Rounds alternate; medians are compared. Figures, per model: `speedup` =
one-device step time / layout step time (bound 2.0, the model axis);
`collectives` = the mesh's collectives one step makes on a device, by kind,
read from the step's graph (`tfdist.parallel.mesh_groups.collectives_of_a_step`;
a gather is two ops); `max_device_share` = the largest fraction of the matched
variables' and slots' bytes one device holds (target at most 1.15/2).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tfdist.callbacks.throughput import fit_round
from tfdist.timing import alternate, medians

__all__ = ["measure"]

DEVICES = ("/cpu:0", "/cpu:1")
MODEL = dict(vocabulary_size=4096, num_layers=4, num_query_heads=8, num_key_value_heads=8, hidden_dim=512,
             intermediate_dim=2048, dropout=0.0)
MODELS = {"gemma": ("GemmaBackbone", "GemmaCausalLM", {**MODEL, "head_dim": 64}),
          "llama": ("LlamaBackbone", "LlamaCausalLM", MODEL)}
MLP_BATCH = 256
SHARE_TARGET = 1.15 / len(DEVICES)


def measure(*, repeats: int = 5, batch: int = 8, length: int = 128, steps_per_round: int = 3) -> dict[str, Any]:
    """Times both variants in this process (call before TensorFlow has started)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    import keras
    import keras_hub

    from tfdist.parallel.mesh_groups import collectives_of_a_step
    from tfdist.parallel.split_variables import is_split, shards
    from tfdist.strategies.devices import ensure_logical_cpus
    from tfdist.strategies.layout import LayoutStrategy

    ensure_logical_cpus(len(DEVICES))
    tokens = np.random.default_rng(0).integers(1, MODEL["vocabulary_size"], size=(batch, length + 1))
    features = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch, length), bool)}
    x = np.random.default_rng(0).standard_normal((MLP_BATCH, 2048)).astype("float32")
    batches = {"gemma": ((features, tokens[:, 1:]), batch), "llama": ((features, tokens[:, 1:]), batch),
               "mlp": ((x, x), MLP_BATCH)}

    def build(name, strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            if name == "mlp":
                model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(8192, activation="relu", name="up"),
                                          keras.layers.Dense(2048, name="down")])
                model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
                return model
            backbone, causal_lm, settings = MODELS[name]
            model = getattr(keras_hub.models, causal_lm)(
                backbone=getattr(keras_hub.models, backbone)(**settings), preprocessor=None)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), weighted_metrics=[],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def layout_map(name, mesh):
        if name != "mlp":
            return getattr(keras_hub.models, MODELS[name][0]).get_layout_map(mesh)
        mlp = keras.distribution.LayoutMap(mesh)
        mlp[".*up/kernel"], mlp[".*up/bias"], mlp[".*down/kernel"] = (None, "model"), ("model",), ("model", None)
        return mlp

    mesh = keras.distribution.DeviceMesh((1, len(DEVICES)), ("batch", "model"), devices=[d[1:] for d in DEVICES])
    strategies, models, rounds = {}, {}, {}
    for name, (data, size) in batches.items():
        strategies[name] = LayoutStrategy(layout_map(name, mesh))
        dataset = tf.data.Dataset.from_tensors(data).repeat()
        one_device = tf.distribute.OneDeviceStrategy(DEVICES[0])
        for variant, strategy in ((f"{name}_layout", strategies[name]), (f"{name}_one_device", one_device)):
            models[variant] = build(name, strategy)
            rounds[variant] = fit_round(models[variant], dataset, batch=size, steps=steps_per_round)
    samples = alternate(rounds, repeats=repeats)
    step_ms = medians(samples)

    collectives, shares, figures = {}, {}, {}
    for name in batches:
        split = models[f"{name}_layout"]
        matched = [v for v in split.variables + split.optimizer.variables if is_split(v)]
        by_device: dict[str, int] = {}
        for variable in matched:
            for shard in shards(variable):
                device = shard.device.split("device:")[-1]
                by_device[device] = by_device.get(device, 0) + shard.shape.num_elements() * shard.dtype.size
        whole = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in matched)
        collectives[name] = collectives_of_a_step(split, strategies[name], batches[name][0])
        shares[name] = {"matched_bytes": whole, "by_device": by_device}
        speedup = step_ms[f"{name}_one_device"] / step_ms[f"{name}_layout"]
        figures.update({
            f"{name}_speedup": speedup,
            f"{name}_efficiency": speedup / len(DEVICES),
            f"{name}_collectives_per_step": sum(collectives[name].values()),
            f"{name}_max_device_share": max(by_device.values()) / whole,
        })
    figures["bound"] = float(len(DEVICES))
    figures["meets_share_target"] = all(figures[f"{name}_max_device_share"] <= SHARE_TARGET for name in batches)
    return {
        "benchmark": "layout",
        "strategy": "layout",
        "devices": list(DEVICES),
        "mesh": {"batch": 1, "model": len(DEVICES)},
        "global_batch_size": {"gemma": batch, "llama": batch, "mlp": MLP_BATCH},
        "models": {**{name: {"class": f"keras_hub.models.{lm}", "sequence_length": length, **settings}
                      for name, (_, lm, settings) in MODELS.items()},
                   "mlp": {"layers": "Dense 2048 -> 8192 (relu) -> 2048", "batch": MLP_BATCH, "optimizer": "SGD"}},
        "threads": {"intra_op": 1, "inter_op": 2},
        "steps_per_round": steps_per_round,
        "repeats": repeats,
        "step_time_ms": step_ms,
        "step": "model.fit step (Adam; the mlp's SGD)",
        "collectives": collectives,
        "matched_bytes": shares,
        "samples": samples,
        "figures": figures,
    }
