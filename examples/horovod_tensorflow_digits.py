"""A Horovod custom training loop (the shape of Horovod's tensorflow2_mnist example), on digits.

Written for `horovod.tensorflow`; on Keras 3 only its import line changed, and
`opt.variables()` became `opt.variables` (a property in Keras 3):

    import horovod.tensorflow as hvd   ->   import tfdist.horovod.tensorflow as hvd

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_tensorflow_digits.py
"""

from absl import app, flags
import numpy as np
import tensorflow as tf

from tfdist.data import load_digits  # the digits data, which tfdist ships
import tfdist.horovod.tensorflow as hvd  # was: import horovod.tensorflow as hvd

_STEPS = flags.DEFINE_integer("steps", 1200, "Training steps, divided among the ranks.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", "", "Rank 0 saves a checkpoint here at the end.")
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

    pixels, classes = load_digits()
    images = (pixels / 16.0).astype("float32")[..., np.newaxis]
    order = np.random.default_rng(0).permutation(len(images))
    train, val = order[:1400], order[1400:]

    dataset = tf.data.Dataset.from_tensor_slices((images[train], classes[train]))
    dataset = dataset.repeat().shuffle(1000, seed=hvd.rank()).batch(32)

    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    loss = tf.keras.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.keras.optimizers.Adam(0.001 * hvd.size())

    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: was opt.variables()

        return loss_value

    # Horovod: adjust number of steps based on number of GPUs.
    for batch, (batch_images, labels) in enumerate(dataset.take(_STEPS.value // hvd.size())):
        loss_value = training_step(batch_images, labels, batch == 0)
        if batch % 50 == 0 and hvd.local_rank() == 0:
            print(f"Step #{batch}\tLoss: {loss_value:.6f}")

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting it.
    if hvd.rank() == 0 and _CHECKPOINT_DIR.value:
        checkpoint.save(_CHECKPOINT_DIR.value + "/checkpoint")

    predictions = np.argmax(model.predict(images[val], verbose=0), axis=1)
    accuracy = float(np.mean(predictions == classes[val]))
    if hvd.rank() == 0:
        print(f"ranks={hvd.size()} val_accuracy={accuracy:.4f}")
        if _RESULT.value:
            with open(_RESULT.value, "w") as f:
                f.write(f"{accuracy}\n")


if __name__ == "__main__":
    app.run(main)
