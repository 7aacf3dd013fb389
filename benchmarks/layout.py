"""`tfdist bench layout`: keras-hub's Llama backbone split by its own layout map, against one device.

Two logical CPU devices with single-threaded ops (intra-op 1, inter-op 2, as
`tensor_parallel`): a `LlamaCausalLM` (4 layers, hidden 512, feed-forward 2048,
8 heads, vocabulary 4096, random weights) trained by `model.fit` with Adam on
a repeated batch of synthetic tokens:

- `layout`: under `tfdist.LayoutStrategy` from `LlamaBackbone.get_layout_map`
  on a 1 x 2 mesh (data x model), each device holding half of every matched
  kernel and of its Adam slots;
- `one_device`: the same model on `/cpu:0`.

Rounds alternate; medians are compared. Figures: `speedup` = one-device step
time / layout step time (bound 2.0, the model axis); `collectives` = the mesh's
collectives one step makes on a device, by kind, read from the step's graph
(`tfdist.parallel.mesh_groups.collectives_of_a_step`); `max_device_share` = the
largest fraction of the matched variables' and slots' bytes one device holds
(target at most 1.15/2).
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
    dataset = tf.data.Dataset.from_tensors((features, tokens[:, 1:])).repeat()

    def build(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(**MODEL),
                                                   preprocessor=None)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), weighted_metrics=[],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    mesh = keras.distribution.DeviceMesh((1, len(DEVICES)), ("batch", "model"), devices=[d[1:] for d in DEVICES])
    strategy = LayoutStrategy(keras_hub.models.LlamaBackbone.get_layout_map(mesh))
    models = {"layout": build(strategy), "one_device": build(tf.distribute.OneDeviceStrategy(DEVICES[0]))}
    rounds = {name: fit_round(model, dataset, batch=batch, steps=steps_per_round) for name, model in models.items()}
    samples = alternate(rounds, repeats=repeats)
    step_ms = medians(samples)

    split = models["layout"]
    matched = [v for v in split.variables + split.optimizer.variables if is_split(v)]
    by_device: dict[str, int] = {}
    for variable in matched:
        for shard in shards(variable):
            name = shard.device.split("device:")[-1]
            by_device[name] = by_device.get(name, 0) + shard.shape.num_elements() * shard.dtype.size
    whole = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in matched)
    collectives = collectives_of_a_step(split, strategy, (features, tokens[:, 1:]))
    share = max(by_device.values()) / whole
    speedup = step_ms["one_device"] / step_ms["layout"]
    figures = {
        "speedup": speedup,
        "bound": float(len(DEVICES)),
        "efficiency": speedup / len(DEVICES),
        "collectives_per_step": sum(collectives.values()),
        "max_device_share": share,
        "meets_share_target": share <= SHARE_TARGET,
    }
    return {
        "benchmark": "layout",
        "strategy": "layout",
        "devices": list(DEVICES),
        "mesh": {"batch": 1, "model": len(DEVICES)},
        "global_batch_size": batch,
        "model": {"class": "keras_hub.models.LlamaCausalLM", "sequence_length": length, **MODEL},
        "threads": {"intra_op": 1, "inter_op": 2},
        "steps_per_round": steps_per_round,
        "repeats": repeats,
        "step_time_ms": step_ms,
        "step": "model.fit step with Adam",
        "collectives": collectives,
        "matched_bytes_per_device": by_device,
        "matched_bytes": whole,
        "samples": samples,
        "figures": figures,
    }
