"""A Horovod custom-loop synthetic benchmark (the shape of Horovod's tensorflow2_synthetic_benchmark).

A `keras.applications` model (random weights, `weights=None`) trains on random
images with `hvd.DistributedGradientTape`; the script prints images/sec per
rank and in total. Written for `horovod.tensorflow`; on Keras 3 only its import
line changed, and `opt.variables()` became `opt.variables`:

    import horovod.tensorflow as hvd   ->   import tfdist.horovod.tensorflow as hvd

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_synthetic_benchmark.py \
        --model ResNet50 --image_size 64 --batch_size 16

`--image_size` (224 in Horovod's script) lets a CPU finish in minutes.
"""

import json
import timeit

from absl import app, flags
import numpy as np
import tensorflow as tf

import tfdist.horovod.tensorflow as hvd  # was: import horovod.tensorflow as hvd

_MODEL = flags.DEFINE_string("model", "ResNet50", "A model of keras.applications.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Images per rank per step.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Height and width of the random images.")
_FP16_ALLREDUCE = flags.DEFINE_boolean("fp16_allreduce", False, "All-reduce the gradients in float16.")
_WARMUP_BATCHES = flags.DEFINE_integer("num_warmup_batches", 10, "Steps before timing starts.")
_BATCHES_PER_ITER = flags.DEFINE_integer("num_batches_per_iter", 10, "Steps per timed iteration.")
_ITERS = flags.DEFINE_integer("num_iters", 10, "Timed iterations.")
_RESULT = flags.DEFINE_string("result", "", "Rank 0 writes the images/sec figures here (JSON).")


def main(argv):
    del argv  # unused
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    size = _IMAGE_SIZE.value
    model = getattr(tf.keras.applications, _MODEL.value)(weights=None, input_shape=(size, size, 3))
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy()
    compression = hvd.Compression.fp16 if _FP16_ALLREDUCE.value else hvd.Compression.none

    images = tf.random.uniform([_BATCH_SIZE.value, size, size, 3])
    labels = tf.random.uniform([_BATCH_SIZE.value, 1], minval=0, maxval=999, dtype=tf.int64)

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes,
        # after the first step, when the optimizer's variables exist.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: was opt.variables()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {_MODEL.value}, batch size: {_BATCH_SIZE.value}, image size: {size}, ranks: {hvd.size()}")
    log("Running warmup...")
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=_WARMUP_BATCHES.value)

    log("Running benchmark...")
    rates = []
    for i in range(_ITERS.value):
        seconds = timeit.timeit(lambda: benchmark_step(first_batch=False), number=_BATCHES_PER_ITER.value)
        rates.append(_BATCH_SIZE.value * _BATCHES_PER_ITER.value / seconds)
        log(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank")

    mean, spread = np.mean(rates), 1.96 * np.std(rates)
    log(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
    if hvd.rank() == 0 and _RESULT.value:
        with open(_RESULT.value, "w") as f:
            json.dump({"model": _MODEL.value, "ranks": hvd.size(), "images_per_sec_per_rank": float(mean),
                       "images_per_sec_total": float(hvd.size() * mean)}, f)


if __name__ == "__main__":
    app.run(main)
