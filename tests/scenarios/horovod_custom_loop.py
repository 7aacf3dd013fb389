"""A `horovod.tensorflow` custom training loop, written the way Horovod's TF2 examples are, on Keras 3.

`python horovod_custom_loop.py OUT MODE ...` under `horovodrun -np N` (or
alone: one rank, the reference) trains a fresh model for each mode in turn (one
job, as its processes are the slow part to start). Each rank trains on its
share of every global batch of 32 digits with `DistributedGradientTape`,
broadcasts the model and optimizer variables after its first step, and writes
its final weights, their checksum and what Horovod's tensor functions returned
to OUT.MODE.rank<R>.npz. Modes: `plain` is the loop as Horovod writes it;
`seed_by_rank` starts each rank from other weights (so only the broadcast can
make them equal); `partial` keeps the last layer's gradients rank-local
(`PartialDistributedGradientTape`); `tape_options` gives the tape fp16
compression, a gradient predivide factor and explicit groups of Keras
variables; `optimizer` all-reduces in `hvd.DistributedOptimizer` instead of
the tape.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import hashlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tfdist.data import load_digits  # noqa: E402  (the digits data, which tfdist ships)

import tfdist.horovod.tensorflow as hvd  # noqa: E402  (was: import horovod.tensorflow as hvd)

GLOBAL_BATCH = 32
STEPS = 12
MODES = ("plain", "seed_by_rank", "partial", "tape_options", "optimizer")


def main(out, modes):
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; known: {MODES}")
    hvd.init()
    pixels, labels = load_digits()
    data = (pixels.reshape(len(pixels), -1) / 16.0).astype("float32"), labels.astype("int64")
    for mode in modes:
        train(f"{out}.{mode}", mode, *data)


def train(out, mode, x, y):
    """A fresh model trained by `mode`'s loop; this rank's results to OUT.rank<R>.npz."""
    per_rank = GLOBAL_BATCH // hvd.size()
    keras.utils.set_random_seed(hvd.rank() if mode == "seed_by_rank" else 0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax", name="head")])
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    if mode == "optimizer":
        opt = hvd.DistributedOptimizer(opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(labels, model(images, training=True))
        if mode == "partial":
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.get_layer("head")])
        elif mode == "tape_options":
            hidden, head = model.layers
            tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16, gradient_predivide_factor=2.0,
                                               groups=[hidden.trainable_weights, head.trainable_weights])
        elif mode != "optimizer":
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:  # after the first step, when the optimizer's variables exist
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: a property, not opt.variables()
        return loss_value

    for step in range(STEPS):
        start = step * GLOBAL_BATCH + hvd.rank() * per_rank
        training_step(x[start:start + per_rank], y[start:start + per_rank], step == 0)

    weights = model.get_weights()
    checksum = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
    rank = tf.constant([hvd.rank()] * hvd.size())
    np.savez(f"{out}.rank{hvd.rank()}.npz", *weights, checksum=checksum, size=hvd.size(),
             allgather=hvd.allgather(rank[:1]).numpy(), broadcast=hvd.broadcast(rank, root_rank=0).numpy(),
             alltoall=hvd.alltoall(rank).numpy(), allreduce=hvd.allreduce(rank, op=hvd.Sum).numpy(),
             join=hvd.join())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
