"""`tfdist bench remat`: activations recomputed (`train.remat: full`) against kept, on tfdist's own transformer
and on keras-hub's Gemma.

One logical CPU device (intra-op 1, inter-op 2 threads), two models with
random weights, each trained by `model.fit` with SGD on a repeated synthetic
batch, as it is (`kept`) and with `tfdist.remat(model, "full")` (`remat`):

- `transformer`: `model.name: transformer` (tfdist's pre-norm blocks, every
  layer at the model's top level) of width 256, depth 4, 8 heads, on
  sequences of 256 rows of 16 features, batch 8;
- `gemma`: `keras_hub.models.GemmaCausalLM` (4 decoder blocks, hidden 256,
  feed-forward 1024, 8 heads of 32, vocabulary 4096) on 4 sequences of 256
  tokens; `full` recomputes each decoder block (the backbone is a model
  nested in the task model).

Figures, per model: `kept_bytes` (the activation bytes a step's backward
pass reads of its forward tensors, the planner's probe,
`tfdist.plan.profile.kept_bytes`) and `kept_share` = remat / kept;
`peak_bytes` (TensorFlow's CPU allocator, its BFC kind on every machine
(`tfdist.bench.allocator`, named in the JSON's `memory_measured_by`): the peak of a few steps over what
was in use before the model was built, every allocation rounded up to the
allocator's bins) and `peak_share`; `time_ratio` = remat / kept step time (alternated
rounds, medians); `max_abs_diff`, the weights after 10 steps from the same
start, remat against kept (target 1e-6). The anchors: Chen et al. 2016 cut
memory 7x for 30% more time, and a full recompute costs about one forward
pass, a third of a step (1.33).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

from tfdist.bench import allocator
from tfdist.callbacks.throughput import fit_round
from tfdist.timing import alternate, medians

__all__ = ["measure"]

TRANSFORMER = dict(width=256, depth=4, heads=8, rows=256, features=16, batch=8)
GEMMA = dict(vocabulary_size=4096, num_layers=4, num_query_heads=8, num_key_value_heads=8, hidden_dim=256,
             intermediate_dim=1024, head_dim=32, dropout=0.0)
GEMMA_BATCH, GEMMA_LENGTH = 4, 256
STEPS_COMPARED = 10
TARGET_DIFF = 1e-6


def measure(*, repeats: int = 5, steps_per_round: int = 3, scale: float = 1.0) -> dict[str, Any]:
    """Times and measures both variants of both models in this process (call before TensorFlow has started).
    `scale` < 1 shrinks the sequences (a test's run)."""
    allocator.count_allocations()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    import keras
    import keras_hub

    from tfdist import models
    from tfdist.config.schema import ModelConfig
    from tfdist.parallel.recompute import remat
    from tfdist.plan.profile import kept_bytes

    rows, length = max(int(TRANSFORMER["rows"] * scale), 8), max(int(GEMMA_LENGTH * scale), 8)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((TRANSFORMER["batch"], rows, TRANSFORMER["features"], 1)).astype("float32")
    labels = rng.integers(0, 10, TRANSFORMER["batch"])
    tokens = rng.integers(1, GEMMA["vocabulary_size"], size=(GEMMA_BATCH, length + 1))
    features = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((GEMMA_BATCH, length), bool)}
    data = {"transformer": (images, labels), "gemma": (features, tokens[:, 1:])}
    specs = {"transformer": tf.TensorSpec(images.shape, "float32"),
             "gemma": {"token_ids": tf.TensorSpec(features["token_ids"].shape, "int32"),
                       "padding_mask": tf.TensorSpec(features["padding_mask"].shape, "bool")}}

    def build(name, variant):
        keras.utils.set_random_seed(0)
        with tf.device("/cpu:0"):
            if name == "transformer":
                config = ModelConfig(name="transformer", width=TRANSFORMER["width"], depth=TRANSFORMER["depth"],
                                     heads=TRANSFORMER["heads"], dropout=0.0)
                model = models.build(config, input_shape=images.shape[1:], num_classes=10)
            else:
                model = keras_hub.models.GemmaCausalLM(backbone=keras_hub.models.GemmaBackbone(**GEMMA),
                                                       preprocessor=None)
            chosen = remat(model, "full" if variant == "remat" else "none")
            model.compile(optimizer=keras.optimizers.SGD(1e-3), weighted_metrics=[],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=name == "gemma"))
        return model, chosen

    results, rounds, figures = {}, {}, {}
    for name in data:
        dataset = tf.data.Dataset.from_tensors(data[name]).repeat()
        batch = len(data[name][1])
        for variant in ("kept", "remat"):
            gc.collect()
            before = allocator.current_bytes()
            model, chosen = build(name, variant)
            probe = kept_bytes(model, specs[name])
            allocator.reset_peak()
            model.fit(dataset, epochs=1, steps_per_epoch=STEPS_COMPARED, verbose=0)
            peak = allocator.peak_bytes() - before
            results[f"{name}_{variant}"] = {"kept_bytes": probe, "peak_bytes": peak, "recomputed_layers": chosen,
                                            "weights": model.get_weights()}
            rounds[f"{name}_{variant}"] = fit_round(model, dataset, batch=batch, steps=steps_per_round)
    step_ms = medians(samples := alternate(rounds, repeats=repeats))
    for name in data:
        kept, again = results[f"{name}_kept"], results[f"{name}_remat"]
        figures[f"{name}_kept_share"] = again["kept_bytes"] / kept["kept_bytes"]
        figures[f"{name}_peak_share"] = again["peak_bytes"] / kept["peak_bytes"] if kept["peak_bytes"] > 0 else None
        figures[f"{name}_time_ratio"] = step_ms[f"{name}_remat"] / step_ms[f"{name}_kept"]
        figures[f"{name}_max_abs_diff"] = max(float(np.abs(a - b).max())
                                              for a, b in zip(kept.pop("weights"), again.pop("weights")))
        figures[f"{name}_meets_diff_target"] = figures[f"{name}_max_abs_diff"] <= TARGET_DIFF
    return {
        "benchmark": "remat",
        "models": {"transformer": {**TRANSFORMER, "rows": rows},
                   "gemma": {"class": "keras_hub.models.GemmaCausalLM", **GEMMA, "batch": GEMMA_BATCH,
                             "sequence_length": length}},
        "threads": {"intra_op": 1, "inter_op": 2},
        "optimizer": "sgd 1e-3", "steps_compared": STEPS_COMPARED,
        "variants": results,  # each one's weights compared above, and left out
        "speed": {"steps_per_round": steps_per_round, "repeats": repeats, "step_time_ms": step_ms, "samples": samples},
        "anchors": {"chen_2016_memory_cut": 7.0, "chen_2016_time_ratio": 1.3, "one_forward_pass_time_ratio": 1.33},
        "memory_measured_by": allocator.describe(),
        "figures": figures,
    }
