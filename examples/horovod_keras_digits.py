"""A Horovod Keras script (Horovod's tensorflow2_keras_mnist example, on digits).

Written for `horovod.tensorflow.keras`; on Keras 3 only its import line changed:

    import horovod.tensorflow.keras as hvd   ->   import tfdist.horovod.tensorflow.keras as hvd

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_keras_digits.py
"""

import os

from absl import app, flags
import numpy as np
import tensorflow as tf

from tfdist.data import load_digits  # the digits data, which tfdist ships
import tfdist.horovod.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd

_EPOCHS = flags.DEFINE_integer("epochs", 24, "Passes over this rank's shard.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", "", "Rank 0 saves a checkpoint here every epoch.")
_RESULT = flags.DEFINE_string("result", "", "Rank 0 writes the final validation accuracy here.")


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

    pixels, labels = load_digits()
    images = (pixels / 16.0).astype("float32")[..., np.newaxis]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(images))
    train, val = order[:1400], order[1400:]

    # Horovod: each rank reads its own shard.
    dataset = tf.data.Dataset.from_tensor_slices((images[train], labels[train]))
    dataset = dataset.shard(hvd.size(), hvd.rank()).repeat().shuffle(1000, seed=hvd.rank()).batch(32)

    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.keras.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0 and _CHECKPOINT_DIR.value:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(_CHECKPOINT_DIR.value, "checkpoint-{epoch}.keras")))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    model.fit(dataset, steps_per_epoch=44 // hvd.size(), callbacks=callbacks, epochs=_EPOCHS.value,
              verbose=verbose)

    _, accuracy = model.evaluate(images[val], labels[val], verbose=0)
    if hvd.rank() == 0:
        print(f"ranks={hvd.size()} val_accuracy={accuracy:.4f}")
        if _RESULT.value:
            with open(_RESULT.value, "w") as f:
                f.write(f"{accuracy}\n")


if __name__ == "__main__":
    app.run(main)
