"""TensorFlow's "Multi-worker training with Keras", with tfdist choosing the strategy.

The script keeps the guide's shape: a global batch of 64 examples per replica,
a small CNN built and compiled under `strategy.scope()`, `fit` with
`BackupAndRestore` (a rerun resumes from the last finished epoch), and the
model saved by every worker, the chief to `--model_path` and the others to a
scratch copy they delete (every worker must take part in the save). The one
change from the guide is the line that makes the strategy; the guide's MNIST
is scikit-learn's digits, shipped with tfdist.

    tfdist launch --workers 2 --set strategy.kind=multi_worker_mirrored -- \\
        python examples/guide_multi_worker_keras.py --set strategy.kind=multi_worker_mirrored
    python examples/guide_multi_worker_keras.py      # one process, the config's default strategy

Each task finds its cluster in TF_CONFIG, which `tfdist launch` (or a
Kubernetes operator) sets; `tfdist slurm -- COMMAND` and `tfdist k8s -- COMMAND`
set `cluster.resolver` instead.
"""

import os
import shutil
import tempfile

from absl import app, flags

import tfdist

_CONFIG = flags.DEFINE_string("config", None, "tfdist YAML config (the built-in defaults when omitted).")
_SET = flags.DEFINE_multi_string("set", [], "Config override: section.key=value (repeatable).")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs.")
_STEPS = flags.DEFINE_integer("steps_per_epoch", 10, "Steps per epoch.")
_MODEL_PATH = flags.DEFINE_string("model_path", "/tmp/keras-model.keras", "Where the chief saves the model.")
_BACKUP_DIR = flags.DEFINE_string("backup_dir", "/tmp/backup", "BackupAndRestore's directory.")
_PER_WORKER_BATCH = flags.DEFINE_integer("per_worker_batch", 64, "Examples a step on each worker (replica).")


def digits_dataset(global_batch: int):
    """The guide's input: shuffled, repeated, batched images scaled to [0, 1]."""
    import tensorflow as tf

    images, labels = tfdist.data.load_digits()
    x = (images / 16.0).astype("float32")[..., None]
    return tf.data.Dataset.from_tensor_slices((x, labels)).shuffle(2000, seed=1).repeat().batch(global_batch)


def build_and_compile_cnn_model():
    import keras

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(learning_rate=0.05), metrics=["accuracy"])
    return model


def write_path(path: str, task_type, task_id) -> str:
    """The chief saves to `path`; another worker to a scratch directory of its own, deleted after."""
    if task_type in (None, "chief") or (task_type == "worker" and task_id == 0):
        return path
    return os.path.join(tempfile.mkdtemp(prefix=f"workertemp_{task_id}_"), os.path.basename(path))


def main(argv):
    del argv  # unused
    try:
        strategy = tfdist.make_strategy(tfdist.load_config(_CONFIG.value, _SET.value))  # the guide's one change
    except tfdist.ConfigError as e:
        raise app.UsageError(str(e)) from None
    import keras

    keras.utils.set_random_seed(1)  # the same first weights on every worker
    dataset = digits_dataset(_PER_WORKER_BATCH.value * strategy.num_replicas_in_sync)
    with strategy.scope():
        model = build_and_compile_cnn_model()
    model.fit(dataset, epochs=_EPOCHS.value, steps_per_epoch=_STEPS.value, verbose=2,
              callbacks=[keras.callbacks.BackupAndRestore(backup_dir=_BACKUP_DIR.value)])

    resolver = getattr(strategy, "cluster_resolver", None)
    task_type, task_id = (resolver.task_type, resolver.task_id) if resolver else (None, None)
    path = write_path(_MODEL_PATH.value, task_type, task_id)
    model.save(path)
    if path != _MODEL_PATH.value:
        shutil.rmtree(os.path.dirname(path))


if __name__ == "__main__":
    app.run(main)
