"""TensorFlow's "Parameter server training", with tfdist choosing the strategy.

The guide's two ways to train, on the chief of a cluster of workers and
parameter servers:

1. `Model.fit` on a dataset made by a dataset function, every worker
   reading its own copy (Keras 3 has no `DatasetCreator`: the function's
   dataset is passed as it is, and tfdist's strategy gives each worker one);
2. a custom loop: `ClusterCoordinator.create_per_worker_dataset`, a step
   function that runs `strategy.run` in a `tf.function`, `coordinator.schedule`
   for every step and `coordinator.join`, then the accuracy read from the
   metric the steps updated.

The one change from the guide is the line that makes the strategy; its
synthetic data is scikit-learn's digits, shipped with tfdist. Run it where
its cluster is:

    tfdist launch --workers 2 --ps 1 --set strategy.kind=parameter_server -- \\
        python examples/guide_parameter_server.py --set strategy.kind=parameter_server

(the chief runs this script; the workers and servers are `tfdist serve`).
With `strategy.kind=one_device` it runs in one process, for comparison.
"""

from absl import app, flags

import tfdist

_CONFIG = flags.DEFINE_string("config", None, "tfdist YAML config (the built-in defaults when omitted).")
_SET = flags.DEFINE_multi_string("set", [], "Config override: section.key=value (repeatable).")
_PART = flags.DEFINE_enum("part", "both", ["fit", "custom_loop", "both"], "Which of the guide's ways to train.")
_STEPS = flags.DEFINE_integer("steps_per_epoch", 10, "Steps per epoch (fit) and per loop epoch.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Epochs.")
_BATCH = flags.DEFINE_integer("global_batch_size", 64, "Examples a step.")
_WEIGHTS_OUT = flags.DEFINE_string("weights_out", None,
                                   "Write each part's final weights here (.npz, per part), from the chief.")


def dataset_fn(global_batch_size: int, input_context=None):
    import tensorflow as tf

    images, labels = tfdist.data.load_digits()
    x = (images.reshape(len(images), -1) / 16.0).astype("float32")
    batch = input_context.get_per_replica_batch_size(global_batch_size) if input_context else global_batch_size
    dataset = tf.data.Dataset.from_tensor_slices((x, labels))
    if input_context:
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.shuffle(2000, seed=1).repeat().batch(batch).prefetch(2)


def build_model():
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])


def train_with_fit(strategy):
    import keras

    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(dataset_fn(_BATCH.value), epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value, verbose=2)
    return model


def train_with_a_custom_loop(strategy):
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.1)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy) if _on_a_cluster(strategy) else None

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                loss = tf.nn.compute_average_loss(loss_object(y, predictions), global_batch_size=_BATCH.value)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            accuracy.update_state(y, predictions)
            return loss

        losses = strategy.run(replica_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    if coordinator:
        iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset_fn(_BATCH.value)))
    else:
        iterator = iter(strategy.experimental_distribute_dataset(dataset_fn(_BATCH.value)))
    for epoch in range(_EPOCHS.value):
        accuracy.reset_state()
        for _ in range(_STEPS.value):
            coordinator.schedule(step_fn, args=(iterator,)) if coordinator else step_fn(iterator)
        if coordinator:
            coordinator.join()
        print(f"Finished epoch {epoch}, accuracy is {float(accuracy.result()):.4f}")
    return model


def _on_a_cluster(strategy) -> bool:
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


def main(argv):
    del argv  # unused
    import numpy as np

    try:
        strategy = tfdist.make_strategy(tfdist.load_config(_CONFIG.value, _SET.value))  # the guide's one change
    except tfdist.ConfigError as e:
        raise app.UsageError(str(e)) from None
    parts = {"fit": train_with_fit, "custom_loop": train_with_a_custom_loop}
    for name in parts if _PART.value == "both" else [_PART.value]:
        model = parts[name](strategy)
        if _WEIGHTS_OUT.value and tfdist.is_chief(strategy):  # launched as several processes, one writes
            np.savez(_WEIGHTS_OUT.value.replace(".npz", f"-{name}.npz"), *model.get_weights())


if __name__ == "__main__":
    app.run(main)
