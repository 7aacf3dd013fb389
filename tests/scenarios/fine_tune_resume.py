"""A keras-hub LLM fine-tuned with LoRA under ZeRO stage 3 and remat, with tfdist's Checkpoint after every step:
killed by SIGKILL, then run again, it must end with the weights of a run never killed.

    python tests/scenarios/fine_tune_resume.py CHECKPOINT_DIR OUT.npz [--sigkill-after STEP] [--layout BACKBONE]

Trains 2 epochs of 4 steps (tiny, random weights, synthetic tokens) and writes the final weights to OUT.npz. By
default a Gemma under tfdist's MirroredStrategy on 2 logical CPUs with remat, in float32. `--layout gemma|llama3`:
that backbone split by its own layout map over a 2 x 2 mesh of 4 logical CPUs ("batch" x "model"), its LoRA
factors split at stage 3 too, in mixed_bfloat16; the run then also writes the greedy tokens it
generates, those of a model on one device holding its weights, and those of a model on one device given its LoRA
file (and whether that file's weights are the trained ones). With `--sigkill-after STEP` the process sends itself
SIGKILL once the checkpoint of that step (counted from 1 over the whole run) is written: nothing of Python's runs
after it, as when a machine is lost.
"""

import argparse
import contextlib
import os
import signal
import sys
import tempfile

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 4)
import keras  # noqa: E402
import keras_hub  # noqa: E402

import tfdist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import references  # noqa: E402

VOCABULARY, LENGTH, BATCH, STEPS_PER_EPOCH, EPOCHS, RANK = 64, 16, 8, 4, 2, 4
BACKBONES = ("gemma", "llama3")  # of references.FINE_TUNED_LMS


class SigkillAfter(keras.callbacks.Callback):
    """SIGKILL to this process at the `step`-th batch's end, after the Checkpoint's (listed before it) saved it."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def causal_lm(name: str, strategy=None) -> keras.Model:
    with strategy.scope() if strategy else contextlib.nullcontext():
        return references.causal_lm(name, VOCABULARY, layers=1, lora_rank=RANK, learning_rate=1e-2)


def strategy_of(layout_backbone):
    """ZeRO stage 3 with every trainable weight split (the tiny LoRA factors too: `keep_whole_below=0`)."""
    if not layout_backbone:
        return tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=3, keep_whole_below=0)
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices=[f"cpu:{i}" for i in range(4)])
    layout_map = getattr(keras_hub.models, references.FINE_TUNED_LMS[layout_backbone][0]).get_layout_map(mesh)
    return tfdist.LayoutStrategy(layout_map, shard_optimizer=3, keep_whole_below=0)


def generated(model, prompts) -> np.ndarray:
    return np.asarray(model.generate(prompts, max_length=LENGTH, stop_token_ids=None)["token_ids"])


def on_one_device(model, name: str, prompts) -> dict:
    """Greedy tokens of the split model, of a model on one device holding its weights, and of one given its LoRA
    file; and whether that file holds the trained LoRA weights."""
    whole = causal_lm(name)
    whole.set_weights(model.get_weights())
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "adapter.lora.h5")
        model.backbone.save_lora_weights(path)
        adapted = causal_lm(name)
        adapted.backbone.load_lora_weights(path)
    lora = [[v.numpy() for v in m.trainable_variables] for m in (model, adapted)]
    return {"generated": generated(model, prompts), "generated_on_one_device": generated(whole, prompts),
            "generated_from_lora_file": generated(adapted, prompts),
            # exact: saving and loading copy the bytes
            "lora_file_loads": np.array(all(np.array_equal(a, b) for a, b in zip(*lora)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out")
    parser.add_argument("--sigkill-after", type=int)
    parser.add_argument("--layout", choices=BACKBONES, help="that backbone under its layout map, 2 x 2")
    args = parser.parse_args()
    if args.layout:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    ids = np.random.default_rng(0).integers(1, VOCABULARY, size=(STEPS_PER_EPOCH * BATCH, LENGTH + 1))
    tokens = tf.data.Dataset.from_tensor_slices(
        ({"token_ids": ids[:, :-1], "padding_mask": np.ones((len(ids), LENGTH), bool)}, ids[:, 1:]))
    model = causal_lm(args.layout or "gemma", strategy_of(args.layout))
    tfdist.remat(model)
    callbacks = [tfdist.callbacks.Checkpoint(args.checkpoint_dir, every_steps=1)]
    if args.sigkill_after:
        callbacks.append(SigkillAfter(args.sigkill_after))
    # One iterator for the whole run, as tfdist's Checkpoint asks for an exact resume.
    model.fit(tokens.batch(BATCH).repeat(), steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, verbose=0,
              callbacks=callbacks)
    found = {}
    if args.layout:
        prompts = {"token_ids": ids[:2, :LENGTH], "padding_mask": np.arange(LENGTH)[None, :].repeat(2, 0) < 6}
        found = on_one_device(model, args.layout, prompts)
    np.savez(args.out, *model.get_weights(), **found)


if __name__ == "__main__":
    main()
