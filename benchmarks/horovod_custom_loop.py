"""The custom-loop part of `tfdist bench horovod`: `tfdist.horovod.tensorflow`'s tape against a hand-written loop.

Run on every rank (`horovodrun -np 2 ... python benchmarks/horovod_custom_loop.py OUT ...`).
Both loops train the same model on the same synthetic images in the same
processes: one with `hvd.DistributedGradientTape` (Keras 3 variables, through
tfdist), one that calls Horovod's `grouped_allreduce` on the gradient tensors
itself. They take turns, `repeats` times each, in alternating order; rank 0
writes each timing's samples/sec (all ranks' samples) to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
import time

__all__ = ["main"]


def main(out: str, repeats: int, steps: int, per_rank_batch: int, image_size: int, width: int) -> None:
    import horovod.tensorflow as horovod
    import keras
    import tensorflow as tf

    import tfdist.horovod.tensorflow as hvd
    from tfdist import models
    from tfdist.config.schema import ModelConfig

    tf.config.threading.set_intra_op_parallelism_threads(1)  # as the Keras jobs: one core per rank
    tf.config.threading.set_inter_op_parallelism_threads(2)
    hvd.init()
    keras.utils.set_random_seed(0)
    model = models.build(ModelConfig(width=width), input_shape=(image_size, image_size, 1), num_classes=10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    optimizer = keras.optimizers.SGD(0.01)
    images = tf.random.uniform([per_rank_batch, image_size, image_size, 1], seed=hvd.rank())
    labels = tf.random.uniform([per_rank_batch], maxval=10, dtype=tf.int64, seed=hvd.rank())
    variables = model.trainable_variables

    @tf.function
    def tape_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))

    @tf.function
    def grouped_allreduce_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = horovod.grouped_allreduce(tape.gradient(loss, [v.value for v in variables]), op=horovod.Average)
        optimizer.apply_gradients(zip(grads, variables))

    loops = {"tape": tape_step, "grouped_allreduce": grouped_allreduce_step}
    samples = {name: [] for name in loops}
    for loop in loops.values():  # trace and warm up
        for _ in range(10):
            loop()
    for repeat in range(repeats):
        for name in (list(loops) if repeat % 2 == 0 else list(reversed(loops))):
            start = time.perf_counter()
            for _ in range(steps):
                loops[name]()
            samples[name].append(steps * per_rank_batch * hvd.size() / (time.perf_counter() - start))
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(samples, f)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
