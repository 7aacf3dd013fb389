"""A keras-hub Gemma fine-tuned with LoRA under ZeRO stage 3 and remat, with tfdist's Checkpoint after every step:
killed by SIGKILL, then run again, it must end with the weights of a run never killed.

    python tests/scenarios/fine_tune_resume.py CHECKPOINT_DIR OUT.npz [--sigkill-after STEP]

Trains 2 epochs of 4 steps (tiny Gemma, random weights, synthetic tokens) on 2 logical CPUs; writes the final
weights to OUT.npz. With `--sigkill-after STEP` the process sends itself SIGKILL once the checkpoint of that step (counted
from 1 over the whole run) is written: nothing of Python's runs after it, as when a machine is lost.
"""

import argparse
import os
import signal

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402
import keras_hub  # noqa: E402

import tfdist  # noqa: E402

VOCABULARY, LENGTH, BATCH, STEPS_PER_EPOCH, EPOCHS = 64, 16, 8, 4, 2


class SigkillAfter(keras.callbacks.Callback):
    """SIGKILL to this process at the `step`-th batch's end, after the Checkpoint's (listed before it) saved it."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out")
    parser.add_argument("--sigkill-after", type=int)
    args = parser.parse_args()
    ids = np.random.default_rng(0).integers(1, VOCABULARY, size=(STEPS_PER_EPOCH * BATCH, LENGTH + 1))
    tokens = tf.data.Dataset.from_tensor_slices(
        ({"token_ids": ids[:, :-1], "padding_mask": np.ones((len(ids), LENGTH), bool)}, ids[:, 1:]))
    keras.utils.set_random_seed(1)
    strategy = tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=3)
    with strategy.scope():
        gemma = keras_hub.models.GemmaCausalLM(backbone=keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCABULARY, num_layers=1, num_query_heads=4, num_key_value_heads=4, hidden_dim=32,
            intermediate_dim=64, head_dim=8, dropout=0.0), preprocessor=None)
        gemma.backbone.enable_lora(rank=4)
        gemma.compile(optimizer=keras.optimizers.Adam(1e-2), weighted_metrics=[],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tfdist.remat(gemma)
    callbacks = [tfdist.callbacks.Checkpoint(args.checkpoint_dir, every_steps=1)]
    if args.sigkill_after:
        callbacks.append(SigkillAfter(args.sigkill_after))
    # One iterator for the whole run, as tfdist's Checkpoint asks for an exact resume.
    gemma.fit(tokens.batch(BATCH).repeat(), steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, verbose=0,
              callbacks=callbacks)
    np.savez(args.out, *gemma.get_weights())


if __name__ == "__main__":
    main()
