"""TensorFlow's "Custom training with tf.distribute.Strategy", with tfdist choosing the strategy.

The guide's loop, step by step: the dataset batched to the global batch and
handed to `strategy.experimental_distribute_dataset`; the model, its loss
(per example, averaged over the global batch with
`tf.nn.compute_average_loss`), its metrics, the optimizer and a
`tf.train.Checkpoint` made under `strategy.scope()`; a training step run on
every replica by `strategy.run` inside a `tf.function`, its losses summed by
`strategy.reduce`; a checkpoint saved every epoch, then restored into a new
model made without the strategy, which must score as the trained one did.
The one change from the guide is the line that makes the strategy; its
Fashion-MNIST is scikit-learn's digits, shipped with tfdist. Launched as
several processes (multi-worker, Horovod), every process saves, as
TensorFlow's multi-worker custom-loop guide has them do: the chief to
`--checkpoint_dir`, each other process to a scratch directory of its own,
which it restores from and deletes.

    python examples/guide_custom_training_loop.py --set strategy.kind=mirrored --set strategy.logical_devices=2
"""

import os
import shutil
import tempfile

from absl import app, flags

import tfdist

_CONFIG = flags.DEFINE_string("config", None, "tfdist YAML config (the built-in defaults when omitted).")
_SET = flags.DEFINE_multi_string("set", [], "Config override: section.key=value (repeatable).")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Epochs.")
_BATCH_PER_REPLICA = flags.DEFINE_integer("batch_per_replica", 64, "Examples a step on each replica.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", "/tmp/training_checkpoints", "Where checkpoints go.")


def main(argv):
    del argv  # unused
    try:
        strategy = tfdist.make_strategy(tfdist.load_config(_CONFIG.value, _SET.value))  # the guide's one change
    except tfdist.ConfigError as e:
        raise app.UsageError(str(e)) from None
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    images, labels = tfdist.data.load_digits()
    x = (images / 16.0).astype("float32")[..., None]
    x_train, y_train, x_test, y_test = x[:1500], labels[:1500], x[1500:], labels[1500:]
    global_batch = _BATCH_PER_REPLICA.value * strategy.num_replicas_in_sync
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(1500, seed=1).batch(global_batch)
    test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    def create_model():
        return keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-4)),
            keras.layers.Dense(10),
        ])

    with strategy.scope():
        model = create_model()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        optimizer = keras.optimizers.Adam(learning_rate=0.01)  # built by its first step, inside `strategy.run`
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def compute_loss(labels, predictions, model_losses):
        loss = tf.nn.compute_average_loss(loss_object(labels, predictions), global_batch_size=global_batch)
        if model_losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        return loss

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        test_loss.update_state(loss_object(labels, predictions))
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    chief = tfdist.is_chief(strategy)  # one process writes --checkpoint_dir; the others' saves are scratch
    checkpoint_dir = _CHECKPOINT_DIR.value if chief else tempfile.mkdtemp(prefix="guide-checkpoint-")
    prefix = os.path.join(checkpoint_dir, "ckpt")
    for epoch in range(_EPOCHS.value):
        total_loss, batches = 0.0, 0
        for batch in train_dist_dataset:
            total_loss += distributed_train_step(batch)
            batches += 1
        for batch in test_dist_dataset:
            distributed_test_step(batch)
        checkpoint.save(prefix)
        print(f"Epoch {epoch + 1}, Loss: {float(total_loss / batches):.4f}, "
              f"Accuracy: {float(train_accuracy.result()):.4f}, Test Loss: {float(test_loss.result()):.4f}, "
              f"Test Accuracy: {float(test_accuracy.result()):.4f}")
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # The guide's last part: the latest checkpoint, restored into a model made without the strategy.
    new_model = create_model()
    tf.train.Checkpoint(model=new_model).restore(tf.train.latest_checkpoint(checkpoint_dir)).expect_partial()
    if not chief:
        shutil.rmtree(checkpoint_dir)
    restored = keras.metrics.SparseCategoricalAccuracy()
    restored.update_state(y_test, new_model(x_test, training=False))
    trained = keras.metrics.SparseCategoricalAccuracy()
    trained.update_state(y_test, np.concatenate([model(b, training=False) for b, _ in test_dataset]))
    print(f"Accuracy after restoring the saved model without strategy: {float(restored.result()):.4f} "
          f"(trained: {float(trained.result()):.4f})")


if __name__ == "__main__":
    app.run(main)
