"""A Horovod Keras synthetic benchmark (the shape of Horovod's tensorflow2_keras_synthetic_benchmark).

`model.fit` on random images with `hvd.DistributedOptimizer`; each epoch is one
timed iteration of `--num_batches_per_iter` steps, the first
`--num_warmup_batches` epochs untimed. Written for `horovod.tensorflow.keras`; on
Keras 3 only its import line changed, and `compile` lost
`experimental_run_tf_function` (Keras 3 has no such argument):

    import horovod.tensorflow.keras as hvd   ->   import tfdist.horovod.tensorflow.keras as hvd

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_keras_synthetic_benchmark.py \
        --model ResNet50 --image_size 64 --batch_size 16
"""

import json
import time

from absl import app, flags
import numpy as np
import tensorflow as tf

import tfdist.horovod.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd

_MODEL = flags.DEFINE_string("model", "ResNet50", "A model of keras.applications.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Images per rank per step.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 224, "Height and width of the random images.")
_FP16_ALLREDUCE = flags.DEFINE_boolean("fp16_allreduce", False, "All-reduce the gradients in float16.")
_WARMUP_BATCHES = flags.DEFINE_integer("num_warmup_batches", 1, "Untimed epochs (of num_batches_per_iter steps).")
_BATCHES_PER_ITER = flags.DEFINE_integer("num_batches_per_iter", 10, "Steps per timed iteration.")
_ITERS = flags.DEFINE_integer("num_iters", 10, "Timed iterations.")
_RESULT = flags.DEFINE_string("result", "", "Rank 0 writes the images/sec figures here (JSON).")


class TimingCallback(tf.keras.callbacks.Callback):
    """Images/sec of each epoch after the warm-up ones."""

    def __init__(self, batch_size, warmup_epochs):
        super().__init__()
        self.batch_size, self.warmup_epochs = batch_size, warmup_epochs
        self.rates = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        rate = self.batch_size * self.params["steps"] / (time.perf_counter() - self.start)
        if epoch >= self.warmup_epochs:
            self.rates.append(rate)
            if hvd.rank() == 0:
                print(f"Iter #{epoch - self.warmup_epochs}: {rate:.1f} img/sec per rank", flush=True)


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

    size, batch_size = _IMAGE_SIZE.value, _BATCH_SIZE.value
    model = getattr(tf.keras.applications, _MODEL.value)(weights=None, input_shape=(size, size, 3))
    opt = tf.keras.optimizers.SGD(0.01)
    compression = hvd.Compression.fp16 if _FP16_ALLREDUCE.value else hvd.Compression.none

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, compression=compression)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt)

    images = tf.random.uniform([batch_size, size, size, 3])
    labels = tf.random.uniform([batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()

    timing = TimingCallback(batch_size, _WARMUP_BATCHES.value)
    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        timing,
    ]
    if hvd.rank() == 0:
        print(f"Model: {_MODEL.value}, batch size: {batch_size}, image size: {size}, ranks: {hvd.size()}")
    model.fit(dataset, steps_per_epoch=_BATCHES_PER_ITER.value, epochs=_WARMUP_BATCHES.value + _ITERS.value,
              callbacks=callbacks, verbose=0)

    mean, spread = np.mean(timing.rates), 1.96 * np.std(timing.rates)
    if hvd.rank() == 0:
        print(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
        print(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
        if _RESULT.value:
            with open(_RESULT.value, "w") as f:
                json.dump({"model": _MODEL.value, "ranks": hvd.size(), "images_per_sec_per_rank": float(mean),
                           "images_per_sec_total": float(hvd.size() * mean)}, f)


if __name__ == "__main__":
    app.run(main)
