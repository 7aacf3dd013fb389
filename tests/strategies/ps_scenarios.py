"""Parameter-server scenarios, each run in a fresh process by test_parameter_server.py.

A chief connects its TensorFlow runtime to the cluster for good, so these do not
run inside the pytest process. `python ps_scenarios.py NAME` prints one JSON line.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tensorflow as tf  # noqa: E402

from tfdist import ClusterError  # noqa: E402
from tfdist.layers import ShardedEmbedding  # noqa: E402
from tfdist.strategies.parameter_server import ParameterServerStrategy  # noqa: E402
from tfdist.strategies.ps_cluster import LocalCluster  # noqa: E402


def _data(n=512, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int32")
    return x, y


def _model(features=16, classes=4):
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(classes, activation="softmax"),
    ])


def _compile(model, learning_rate=0.1):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])


def _model_on(cluster, learning_rate=0.1):
    """The compiled, seeded model under a ParameterServerStrategy on `cluster`."""
    strategy = ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _model()
        _compile(model, learning_rate)
    return model


class _AtBatch(keras.callbacks.Callback):
    """Calls `action` once, at batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch, action):
        super().__init__()
        self.epoch, self.batch, self.action = epoch, batch, action
        self.current_epoch = 0
        self.done_at = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.done_at is None and (self.current_epoch, batch) == (self.epoch, self.batch):
            self.action()
            self.done_at = time.monotonic()


def one_worker_matches_single_device():
    x, y = _data()
    with LocalCluster(num_workers=1, num_ps=1, threads=1) as cluster:
        model = _model_on(cluster)
        reference = _model()
        reference.set_weights(model.get_weights())
        _compile(reference)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
        return {"max_abs_diff": diff, "iterations": int(model.optimizer.iterations.numpy()),
                "evaluate": model.evaluate(x, y, verbose=0), "reference_evaluate": reference.evaluate(x, y, verbose=0),
                "predict_diff": float(np.abs(model.predict(x[:64], verbose=0) - reference.predict(x[:64], verbose=0)).max())}


def short_epochs_all_report_their_metrics():
    """Epochs of 2 steps end well within the 0.25 s between log reads."""
    x, y = _data(64)
    with LocalCluster(num_workers=2, num_ps=1, threads=1) as cluster:
        model = _model_on(cluster)
        history = model.fit(x, y, batch_size=32, epochs=6, verbose=0).history
        # One batch for two workers: one worker's shard is empty.
        one_batch = model.fit(x[:32], y[:32], batch_size=32, epochs=8, verbose=0).history
        return {"loss": history.get("loss", []), "accuracy": history.get("accuracy", []),
                "one_batch_loss": one_batch.get("loss", []), "iterations": int(model.optimizer.iterations.numpy())}


def killed_worker_is_restarted():
    x, y = _data(2048)
    with LocalCluster(num_workers=2, num_ps=1, threads=1) as cluster:
        model = _model_on(cluster, learning_rate=0.05)
        kill = _AtBatch(1, 10, lambda: cluster.kill("worker", 1))
        history = model.fit(x, y, batch_size=32, epochs=3, validation_data=(x[:256], y[:256]),
                            verbose=0, callbacks=[kill])
        return {"epochs": len(history.history["loss"]), "restarts": cluster.restarts,
                "iterations": int(model.optimizer.iterations.numpy()), "steps": 3 * 2048 // 32,
                "val_accuracy": history.history["val_accuracy"][-1]}


def killed_ps_is_an_error():
    x, y = _data(2048)
    with LocalCluster(num_workers=2, num_ps=1, threads=1) as cluster:
        model = _model_on(cluster)
        kill = _AtBatch(0, 10, lambda: cluster.kill("ps", 0))
        try:
            model.fit(x, y, batch_size=32, epochs=50, verbose=0, callbacks=[kill])
        except ClusterError as error:
            return {"error": str(error), "seconds_after_kill": time.monotonic() - kill.done_at}
        return {"error": None}


def _token_data(n=512, vocab=300, length=6, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, length)).astype("int32")
    return x, (x % classes == 0).sum(axis=1).clip(max=classes - 1).astype("int32")


def _token_model(embedding, classes=4):
    return keras.Sequential([
        keras.Input((6,), dtype="int32"), embedding, keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(classes, activation="softmax"),
    ])


def sharded_embedding_matches_a_whole_one():
    """Two parameter servers, a table cut in two: each holds one shard, and training
    with one worker matches keras.layers.Embedding on one device."""
    x, y = _token_data()
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=4096, max_shards=2)
    with LocalCluster(num_workers=1, num_ps=2, threads=1) as cluster:
        strategy = ParameterServerStrategy(cluster.resolver(), variable_partitioner=partitioner)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = _token_model(ShardedEmbedding(300, 8))
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        sharded = model.layers[0]
        keras.utils.set_random_seed(0)
        reference = _token_model(keras.layers.Embedding(300, 8))
        reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        reference.layers[0].embeddings.assign(sharded.embeddings)
        reference.layers[-1].set_weights(model.layers[-1].get_weights())
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return {
            "shard_rows": [int(s.shape[0]) for s in sharded.shards],
            "shard_devices": [s.value.device for s in sharded.shards],
            "table_diff": float(np.abs(sharded.embeddings.numpy() - reference.layers[0].embeddings.numpy()).max()),
            "dense_diff": max(float(np.abs(a - b).max()) for a, b in
                              zip(model.layers[-1].get_weights(), reference.layers[-1].get_weights())),
            "reloaded_on_one_device_diff": _reload_diff(model, x[:64]),
        }


def _reload_diff(model, x):
    """Saves `model`, loads it outside the strategy (one shard) and compares predictions."""
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert len(loaded.layers[0].shards) == 1
    return float(np.abs(loaded.predict(x, verbose=0) - model.predict(x, verbose=0)).max())


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()), flush=True)
