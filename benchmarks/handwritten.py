"""The jobs `tfdist bench baselines` compares tfdist with, written the way each framework's docs write them.

Every job trains the digits CNN (built here layer by layer, as `tfdist`'s
`digits_cnn`) on the handwritten digits (`tfdist.data.load_digits`) with Adam,
tracks accuracy, pins its threads as tfdist's jobs do (intra-op 1, inter-op 2),
runs `warmup` steps and then times `steps` steps by wall clock. The chief (rank 0) writes
`{"samples_per_sec": ...}` to `--out`.

- `multi_worker` (TensorFlow's "Custom training loop with Keras and
  MultiWorkerMirroredStrategy" tutorial; its `model.fit` tutorial fails on
  Keras 3 with two workers, keras-team/keras#20585): `MultiWorkerMirroredStrategy`
  from TF_CONFIG, `distribute_datasets_from_function` sharding by input
  pipeline, a `tf.function` step that `strategy.run`s a `GradientTape` step and
  reduces the loss; timed from after warm-up to after the last step.
- `parameter_server` (TensorFlow's "Parameter server training" tutorial, custom
  loop): `ParameterServerStrategy` and a `ClusterCoordinator` from TF_CONFIG,
  per-worker datasets, a `tf.function` of `steps_per_function` steps scheduled
  onto the workers; timed from the `coordinator.join()` after warm-up to the
  one after the last step.
- `horovod` (Horovod's TensorFlow 2 example): `hvd.init()`, a dataset sharded by
  rank, a `tf.function` step with a `GradientTape` and
  `hvd.grouped_allreduce(gradients, op=hvd.Average)`, variables broadcast from
  rank 0 after the first step; timed from after warm-up to after the last step.

    python benchmarks/handwritten.py --kind horovod --out OUT --per_replica_batch 64 ...
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from absl import app, flags

__all__ = ["digits_cnn", "gradient_step"]

_KIND = flags.DEFINE_enum("kind", None, ["multi_worker", "parameter_server", "horovod"], "Which job.")
_OUT = flags.DEFINE_string("out", None, "Where the chief writes its samples/sec (JSON).")
_PER_REPLICA_BATCH = flags.DEFINE_integer("per_replica_batch", 64, "Examples per replica per step.")
_WIDTH = flags.DEFINE_integer("width", 32, "The CNN's width (as model.width).")
_WARMUP = flags.DEFINE_integer("warmup", 8, "Steps before the clock starts.")
_STEPS = flags.DEFINE_integer("steps", 400, "Timed steps.")
_STEPS_PER_FUNCTION = flags.DEFINE_integer("steps_per_function", 4, "parameter_server: steps per scheduled function.")

LEARNING_RATE = 0.002
DROPOUT = 0.1


def digits_cnn(input_shape, num_classes: int, width: int, dropout: float = DROPOUT):
    """tfdist's `digits_cnn`, written out in Keras."""
    import keras

    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(width, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(4 * width, activation="relu"),
        keras.layers.Dropout(dropout),
        keras.layers.Dense(num_classes),
        keras.layers.Activation("softmax", dtype="float32"),
    ])


def gradient_step(model, optimizer, accuracy, loss_of, all_reduce=lambda gradients: gradients):
    """The step every hand-written job writes: a `GradientTape` over `loss_of(labels, predictions)`,
    the gradients through `all_reduce`, the optimizer's update and the accuracy; returns the loss."""
    import tensorflow as tf

    def step(images, labels):
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = loss_of(labels, predictions)
        gradients = all_reduce(tape.gradient(loss, model.trainable_variables))
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        accuracy.update_state(labels, predictions)
        return loss

    return step


def _digits():
    from tfdist.config.schema import DataConfig
    from tfdist.data.sources import load

    return load(DataConfig(), seed=0)


def _batches(split, shards: int, index: int, batch: int):
    """This input pipeline's shard of the training examples, shuffled, repeated and batched."""
    import tensorflow as tf

    examples = tf.data.Dataset.from_tensor_slices((split.x_train, split.y_train))
    examples = examples.shard(shards, index).shuffle(len(split.x_train)).repeat()
    return examples.batch(batch).prefetch(tf.data.AUTOTUNE)


def multi_worker() -> tuple[float, bool]:
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch = _PER_REPLICA_BATCH.value * strategy.num_replicas_in_sync
    split = _digits()

    def dataset_fn(input_context):
        return _batches(split, input_context.num_input_pipelines, input_context.input_pipeline_id,
                        input_context.get_per_replica_batch_size(global_batch))

    with strategy.scope():
        model = digits_cnn(split.input_shape, split.num_classes, _WIDTH.value)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        optimizer.build(model.trainable_variables)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    batches = iter(strategy.distribute_datasets_from_function(dataset_fn))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)
    step_fn = gradient_step(model, optimizer, accuracy, lambda labels, predictions: tf.nn.compute_average_loss(
        loss_fn(labels, predictions), global_batch_size=global_batch))

    @tf.function
    def train_step(iterator):
        losses = strategy.run(step_fn, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    seconds = _timed(lambda: train_step(batches))
    chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
    return global_batch * _STEPS.value / seconds, chief


def parameter_server() -> tuple[float, bool]:
    import keras
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    split = _digits()
    batch = _PER_REPLICA_BATCH.value

    def dataset_fn(input_context):
        return _batches(split, input_context.num_input_pipelines, input_context.input_pipeline_id, batch)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    with strategy.scope():
        model = digits_cnn(split.input_shape, split.num_classes, _WIDTH.value)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        optimizer.build(model.trainable_variables)  # Keras 3 makes its slots lazily, off the parameter servers
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="sum")
    replica_fn = gradient_step(model, optimizer, accuracy,
                               lambda labels, predictions: loss_fn(labels, predictions) / batch)

    @tf.function
    def step_fn(iterator):
        for _ in range(_STEPS_PER_FUNCTION.value):
            loss = strategy.run(replica_fn, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    def run(steps: int) -> None:
        for _ in range(steps // _STEPS_PER_FUNCTION.value):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()

    run(_WARMUP.value)
    start = time.perf_counter()
    run(_STEPS.value)
    return batch * _STEPS.value / (time.perf_counter() - start), True


def horovod() -> tuple[float, bool]:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    split = _digits()
    batch = _PER_REPLICA_BATCH.value
    dataset = _batches(split, hvd.size(), hvd.rank(), batch)
    model = digits_cnn(split.input_shape, split.num_classes, _WIDTH.value)
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    training_step = tf.function(gradient_step(model, optimizer, accuracy, loss_fn,
                                              all_reduce=lambda g: hvd.grouped_allreduce(g, op=hvd.Average)))

    batches = iter(dataset)
    training_step(*next(batches))
    for variable in model.variables + optimizer.variables:  # every rank goes on from rank 0's state
        variable.assign(hvd.broadcast(variable.value, root_rank=0))
    seconds = _timed(lambda: training_step(*next(batches)), warmup=_WARMUP.value - 1)
    return batch * hvd.size() * _STEPS.value / seconds, hvd.rank() == 0


def _timed(step, warmup: Optional[int] = None) -> float:
    """Seconds of `_STEPS` calls of `step`, after `warmup` (default `_WARMUP`) untimed ones; the
    last step's loss is read before the clock stops."""
    for _ in range(_WARMUP.value if warmup is None else warmup):
        step()
    start = time.perf_counter()
    for _ in range(_STEPS.value):
        loss = step()
    float(loss)
    return time.perf_counter() - start


def main(argv) -> None:
    del argv
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    samples_per_sec, chief = {"multi_worker": multi_worker, "parameter_server": parameter_server,
                              "horovod": horovod}[_KIND.value]()
    if chief:
        with open(_OUT.value, "w") as f:
            json.dump({"samples_per_sec": samples_per_sec}, f)


if __name__ == "__main__":
    flags.mark_flags_as_required(["kind", "out"])
    app.run(main)
