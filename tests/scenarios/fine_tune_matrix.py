"""keras-hub LLMs fine-tuned with LoRA under tfdist's memory options, and on one device by Keras alone, as JSON.

    python tests/scenarios/fine_tune_matrix.py OUT.json                  # Keras alone, one device: the reference
    python tests/scenarios/fine_tune_matrix.py OUT.json --kinds          # every kind of KINDS, 2 logical CPUs

Each cell is a backbone (Gemma, Llama 3, Mistral: tiny, random, nothing downloaded) in a precision (float32,
mixed_bfloat16) with keras-hub's LoRA (rank 4 on the query and value projections, every other weight frozen),
trained 4 steps with Adam as a causal LM on synthetic tokens, then asked for greedy continuations of two prompts
(float32 cells). Without `--kinds` the process never imports tfdist. OUT.json maps the kind ("keras" for the
reference) to "backbone|precision" to the cell's losses, weights, generated tokens and CPU-seconds; under a kind
also how many optimizer slots there are per LoRA weight, whether the frozen weights ended as they began, and whether
the LoRA weights saved by `save_lora_weights` load into a fresh model on one device as they were, and what that
model generates (float32 cells); or the error the cell failed with. A layout cell of a backbone keras-hub gives no
`get_layout_map` says so (`no_layout_map`).
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402
import keras_hub  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import references  # noqa: E402

VOCABULARY, LENGTH, BATCH, STEPS, RANK = 64, 16, 8, 4, 4
PRECISIONS = ("float32", "mixed_bfloat16")
KINDS = ("shard_optimizer 1", "shard_optimizer 2", "shard_optimizer 3, remat", "layout 1x2", "pipeline 2 stages")


def tokens():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCABULARY, size=(STEPS * BATCH, LENGTH + 1))
    prompts = {"token_ids": ids[:2, :LENGTH], "padding_mask": np.arange(LENGTH)[None, :].repeat(2, 0) < 6}
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones((len(ids), LENGTH), bool)}, ids[:, 1:], prompts


def causal_lm(backbone_name: str, strategy=None) -> keras.Model:
    with strategy.scope() if strategy else contextlib.nullcontext():
        return references.causal_lm(backbone_name, VOCABULARY, layers=1, lora_rank=RANK, learning_rate=1e-2)


def strategy_of(kind: str, backbone_name: str):
    import tfdist

    if kind.startswith("shard_optimizer"):
        # At stage 3 every trainable weight split, these tiny LoRA factors too (the default keeps them whole).
        return tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=int(kind.split()[1].rstrip(",")),
                                       keep_whole_below=0)
    if kind.startswith("pipeline"):
        return tfdist.PipelineStrategy(2, devices=["/cpu:0", "/cpu:1"], verbose=False)
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:0", "cpu:1"])
    layout_map = getattr(keras_hub.models, references.FINE_TUNED_LMS[backbone_name][0]).get_layout_map(mesh)
    return tfdist.strategy_from(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))


def cell(kind: str, backbone_name: str, precision: str) -> dict:
    x, y, prompts = tokens()
    keras.mixed_precision.set_global_policy(precision)
    try:
        strategy = None if kind == "keras" else strategy_of(kind, backbone_name)
        model = causal_lm(backbone_name, strategy)
        if kind.endswith("remat"):
            import tfdist

            tfdist.remat(model)
        frozen = {v.path: v.numpy() for v in model.non_trainable_variables}
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        result = {"loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()]}
        if precision == "float32":  # where greedy tokens are compared
            result["generated"] = generate(model, prompts)
        if kind != "keras":
            result.update(facts(model, frozen, backbone_name, precision, prompts))
        return result
    except Exception as error:  # noqa: BLE001  (the cell says how it ended)
        lines = str(error).strip().splitlines() or [""]
        return {"error": f"{type(error).__name__}: {lines[-1][:300]}"}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def generate(model, prompts) -> list:
    return np.asarray(model.generate(prompts, max_length=LENGTH, stop_token_ids=None)["token_ids"]).tolist()


def facts(model, frozen: dict, backbone_name: str, precision: str, prompts) -> dict:
    """Optimizer slots per LoRA weight (split ones counted whole), the frozen weights unchanged, the LoRA file
    loaded on one device and what that model generates."""
    from tfdist.parallel.optimizer_shards import checkpointed_variables

    lora = [v for v in model.trainable_variables if "lora_kernel" in v.path]
    slots = [v for v in checkpointed_variables(model.optimizer) if len(v.shape)]
    found = {"lora_weights": len(lora), "trainable_weights": len(model.trainable_variables),
             "slots_per_lora_weight": len(slots) / max(len(lora), 1),
             # exact: a frozen weight is never written
             "frozen_unchanged": all(np.array_equal(v.numpy(), frozen[v.path]) for v in model.non_trainable_variables)}
    if precision == "float32":
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "adapter.lora.h5")
            model.backbone.save_lora_weights(path)
            fresh = causal_lm(backbone_name)
            fresh.backbone.load_lora_weights(path)
            found["lora_file_loads_on_one_device"] = all(
                np.array_equal(mine.numpy(), theirs.numpy())  # exact: saving and loading copy the bytes
                for mine, theirs in zip(lora, [v for v in fresh.trainable_variables if "lora_kernel" in v.path]))
            found["generated_on_one_device"] = generate(fresh, prompts)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--kinds", action="store_true", help="train under every kind (default: Keras alone)")
    args = parser.parse_args()
    results = {}
    for kind in KINDS if args.kinds else ["keras"]:
        results[kind] = {}
        for backbone_name, (backbone, _, _) in references.FINE_TUNED_LMS.items():
            for precision in PRECISIONS:
                started = time.process_time()
                if kind.startswith("layout") and not hasattr(getattr(keras_hub.models, backbone), "get_layout_map"):
                    result = {"no_layout_map": True}  # keras-hub gives none to split it by
                else:
                    result = cell(kind, backbone_name, precision)
                results[kind][f"{backbone_name}|{precision}"] = {**result, "cpu_seconds": time.process_time() - started}
    assert args.kinds or "tfdist" not in sys.modules
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
