"""Parameter-server scenarios, each run in a fresh process by test_parameter_server.py.

A chief connects its TensorFlow runtime to the cluster for good, so these do not
run inside the pytest process. `python ps_scenarios.py NAME` prints one JSON line.
"""

import contextlib
import copy
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
from tfdist.callbacks import Checkpoint  # noqa: E402
from tfdist.layers import ShardedEmbedding  # noqa: E402
from tfdist.strategies.parameter_server import ParameterServerStrategy  # noqa: E402
from tfdist.cluster.servers import LocalCluster  # noqa: E402


def _data(n=512, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int32")
    return x, y


def _model(features=16, classes=4, dtype=None):
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(32, activation="relu", dtype=dtype),
        keras.layers.Dense(classes, activation="softmax", dtype=dtype),
    ])


def _compile(model, learning_rate=0.1):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])


def _model_on(strategy, learning_rate=0.1):
    """The compiled, seeded model under `strategy`."""
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


def _short_epochs(strategy):
    """Epochs of 2 steps end well within the 0.25 s between log reads."""
    x, y = _data(64)
    model = _model_on(strategy)
    history = model.fit(x, y, batch_size=32, epochs=6, verbose=0).history
    # One batch for two workers: one worker's shard is empty.
    one_batch = model.fit(x[:32], y[:32], batch_size=32, epochs=8, verbose=0).history
    return {"loss": history.get("loss", []), "accuracy": history.get("accuracy", []),
            "one_batch_loss": one_batch.get("loss", []), "iterations": int(model.optimizer.iterations.numpy())}


class _SlowCount(keras.metrics.Metric):
    """Counts the examples twice: in `total` at once, in `count` after slow arithmetic. Its result is
    exactly 1 whenever the two hold the same steps, and above 1 when the total holds a step the
    count lacks."""

    def __init__(self):
        super().__init__(name="same_steps")
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        examples = tf.cast(tf.shape(y_true)[0], "float32")
        self.total.assign_add(examples)
        slow = tf.random.uniform((192, 192))  # random: nothing to fold away before it runs
        for _ in range(24):
            slow = tf.matmul(slow, slow) / 192.0
        self.count.assign_add(examples + 0.0 * tf.reduce_sum(slow))

    def result(self):
        return self.total / tf.maximum(self.count, 1.0)


def mid_epoch_metric_reads():
    """Every step's logs, read from the parameter servers while two workers update the metrics."""
    from tfdist.strategies import parameter_server

    parameter_server.LOG_INTERVAL_SECONDS = 0.0  # read at every step the chief schedules
    x, y = _data(2048)
    reads = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: reads.append(logs))
    with LocalCluster(num_workers=2, num_ps=2, threads=1) as cluster:
        with ParameterServerStrategy(cluster.resolver()).scope():
            model = _model()
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=[_SlowCount()])
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[record])
    ratios = [float(logs["same_steps"]) for logs in reads if "same_steps" in logs]
    return {"reads": len(ratios), "max_ratio": max(ratios), "epoch_ratios": history.history["same_steps"]}


def killed_worker_is_restarted():
    x, y = _data(2048)
    with LocalCluster(num_workers=2, num_ps=1, threads=1) as cluster:
        model = _model_on(ParameterServerStrategy(cluster.resolver()), learning_rate=0.05)
        kill = _AtBatch(1, 10, lambda: cluster.kill("worker", 1))
        history = model.fit(x, y, batch_size=32, epochs=3, validation_data=(x[:256], y[:256]),
                            verbose=0, callbacks=[kill])
        deadline = time.monotonic() + 60  # the restart is an event to wait for: on a busy machine
        while cluster.restarts == 0 and time.monotonic() < deadline:  # training may end before it
            time.sleep(0.1)
        return {"epochs": len(history.history["loss"]), "restarts": cluster.restarts,
                "iterations": int(model.optimizer.iterations.numpy()), "steps": 3 * 2048 // 32,
                "val_accuracy": history.history["val_accuracy"][-1]}


def killed_ps_is_an_error():
    x, y = _data(2048)
    with LocalCluster(num_workers=2, num_ps=1, threads=1) as cluster:
        model = _model_on(ParameterServerStrategy(cluster.resolver()))
        kill = _AtBatch(0, 10, lambda: cluster.kill("ps", 0))
        try:
            model.fit(x, y, batch_size=32, epochs=50, verbose=0, callbacks=[kill])
        except ClusterError as error:
            return {"error": str(error), "seconds_after_kill": time.monotonic() - kill.done_at}
        return {"error": None}


def ps_lost_before_a_save():
    """A parameter server killed just before a checkpoint reads its variables: the error that
    `tfdist train` turns into its one line (strategy.job_error) names the lost server."""
    x, y = _data(2048)
    with LocalCluster(num_workers=1, num_ps=1, threads=1) as cluster:
        model = _model_on(ParameterServerStrategy(cluster.resolver()))
        kill = _AtBatch(0, 9, lambda: cluster.kill("ps", 0))  # then the save at step 10, in the same batch end
        save = Checkpoint(tempfile.mkdtemp(), every_steps=10)
        try:
            model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[kill, save])
        except ClusterError as error:
            return {"raised": "ClusterError", "error": str(error)}
        except tf.errors.OpError as error:
            lost = model.distribute_strategy.job_error(error)
            return {"raised": type(error).__name__, "error": None if lost is None else str(lost)}
        return {"raised": None, "error": None}


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


def float16_gradients_match_one_device():
    """One worker sending its gradients as float16 (a dense layer's, and an embedding's rows as
    IndexedSlices) trains as one device does, to float16's precision, and not exactly as it does."""
    x, y = _token_data()

    def build():
        keras.utils.set_random_seed(0)
        model = _token_model(keras.layers.Embedding(300, 8))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
        return model

    with LocalCluster(num_workers=1, num_ps=1, threads=1) as cluster:
        strategy = ParameterServerStrategy(cluster.resolver(), gradient_compression="float16")
        with strategy.scope():
            model = build()
        reference = build()
        reference.set_weights(model.get_weights())
        before = reference.get_weights()
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return {
            "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights())),
            "max_change": max(float(np.abs(a - b).max()) for a, b in zip(reference.get_weights(), before)),
        }


def _reload_diff(model, x):
    """Saves `model`, loads it outside the strategy (one shard) and compares predictions."""
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert len(loaded.layers[0].shards) == 1
    return float(np.abs(loaded.predict(x, verbose=0) - model.predict(x, verbose=0)).max())


# --- The Keras feature matrix: one worker is sequential, so each feature must match one device.

@keras.saving.register_keras_serializable(package="tfdist_tests")
class HalfLossModel(keras.Model):
    """A custom train_step, as users write one: its own tape, loss and metric updates."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = 0.5 * self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else None
        return {m.name: m.result() for m in self.metrics}


def _feature_cases():
    """name -> (build, compile kwargs, fit(model) -> History). Every model is seeded the same."""
    x, y = _data(704)  # 22 batches of 32
    w = np.linspace(0.2, 2.0, len(x)).astype("float32")
    sgd = lambda **kw: keras.optimizers.SGD(0.1, **kw)  # noqa: E731
    cce = "sparse_categorical_crossentropy"

    def two_inputs_two_outputs():
        a, b = keras.Input((8,), name="a"), keras.Input((8,), name="b")
        h = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([a, b]))
        return keras.Model([a, b], {"cls": keras.layers.Dense(4, activation="softmax", name="cls")(h),
                                    "reg": keras.layers.Dense(1, name="reg")(h)})

    def batch_norm():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                                 keras.layers.Activation("relu"), keras.layers.Dense(4, activation="softmax")])

    def custom_train_step():
        inputs = keras.Input((16,))
        return HalfLossModel(inputs, keras.layers.Dense(4, activation="softmax")(keras.layers.Dense(32)(inputs)))

    def fit(**kwargs):
        return lambda model: model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **kwargs)

    def fit_two_inputs(model):
        return model.fit({"a": x[:, :8], "b": x[:, 8:]}, {"cls": y, "reg": x[:, :1]},
                         batch_size=32, epochs=2, shuffle=False, verbose=0)

    def fit_tf_data(model):
        return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2, verbose=0,
                         validation_data=tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).batch(32))

    def fit_unknown_size(model):
        return model.fit(tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(32),
                         epochs=2, verbose=0)

    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    return {
        "multi_input_output": (two_inputs_two_outputs, dict(optimizer=sgd(), loss={"cls": cce, "reg": "mse"},
                                                            loss_weights={"cls": 1.0, "reg": 0.5},
                                                            metrics={"cls": ["accuracy"]}), fit_two_inputs),
        "sample_weight": (_model, dict(optimizer=sgd(), loss=cce), fit(sample_weight=w)),
        "class_weight": (_model, dict(optimizer=sgd(), loss=cce), fit(class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.0})),
        "validation_split": (_model, dict(optimizer=sgd(), loss=cce, metrics=["accuracy"]), fit(validation_split=0.25)),
        "tf_data": (_model, dict(optimizer=sgd(), loss=cce, metrics=["accuracy"]), fit_tf_data),
        "tf_data_unknown_size": (_model, dict(optimizer=sgd(), loss=cce), fit_unknown_size),
        "steps_per_execution": (_model, dict(optimizer=sgd(), loss=cce, steps_per_execution=4), fit()),
        "callbacks": (_model, dict(optimizer=sgd(), loss=cce), fit(callbacks=[halve])),
        "mixed_precision": (lambda: _model(dtype="mixed_float16"), dict(optimizer=sgd(), loss=cce), fit()),
        "batch_norm": (batch_norm, dict(optimizer=sgd(), loss=cce), fit()),
        "custom_train_step": (custom_train_step, dict(optimizer=sgd(), loss=cce), fit()),
        "clipnorm": (_model, dict(optimizer=sgd(clipnorm=0.05), loss=cce), fit()),
        "gradient_accumulation": (_model, dict(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=4),
                                               loss=cce), fit()),
        "lr_schedule": (_model, dict(optimizer=keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=8, decay_rate=0.5)), loss=cce), fit()),
    }


def keras_usage():
    """Keras's features and any dataset size with one and with two workers (one ps), against the same
    on one device, and short epochs with two: one cluster per worker count, since each is 2-3
    TensorFlow processes to start."""
    from any_size_job import dense, run

    one_device = run(tf.distribute.OneDeviceStrategy("/cpu:0"), dense)
    features, any_size, short_epochs = {}, {}, None
    for workers in (1, 2):
        with LocalCluster(num_workers=workers, num_ps=1, threads=1) as cluster:
            strategy = ParameterServerStrategy(cluster.resolver())
            for name, (build, compile_kwargs, fit) in _feature_cases().items():
                try:
                    result = _compare(strategy, build, compile_kwargs, fit)
                except Exception as error:  # noqa: BLE001 - a failing case is a result here
                    result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                features.setdefault(name, {})[workers] = result
            any_size[workers] = _any_size_compare(one_device, run(strategy, dense))
            if workers == 2:
                short_epochs = _short_epochs(strategy)
    return {"feature_matrix": features, "any_dataset_size": any_size, "short_epochs": short_epochs}


def _compare(strategy, build, compile_kwargs, fit):
    models = []
    for scope in (strategy.scope(), contextlib.nullcontext()):
        keras.utils.set_random_seed(0)
        with scope:
            model = build()
            model.compile(**{k: copy.deepcopy(v) for k, v in compile_kwargs.items()})
        models.append(model)
    ps, reference = models
    reference.set_weights(ps.get_weights())
    histories = [fit(m).history for m in models]
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    ps.save(path)
    x, y = _data(64, seed=1)
    inputs = {"a": x[:, :8], "b": x[:, 8:]} if len(ps.inputs) == 2 else x
    predictions = [keras.saving.load_model(path).predict(inputs, verbose=0), reference.predict(inputs, verbose=0)]
    targets = {"cls": y, "reg": x[:, :1]} if len(ps.inputs) == 2 else y
    evaluations = [np.array(m.evaluate(inputs, targets, verbose=0)) for m in models]  # on the chief, from the ps
    return {
        "weights_diff": max(float(np.abs(a - b).max()) for a, b in zip(ps.get_weights(), reference.get_weights())),
        "history_keys": sorted(histories[0]) == sorted(histories[1]),
        "history_diff": max((abs(a - b) for key in histories[1] for a, b in
                             zip(histories[0].get(key, [np.inf]), histories[1][key])), default=0.0),
        "evaluate_diff": float(np.abs(evaluations[0] - evaluations[1]).max()),
        "epochs": [len(v) for v in histories[0].values()],
        "iterations": int(ps.optimizer.iterations.numpy()),
        "reference_iterations": int(reference.optimizer.iterations.numpy()),
        "reloaded_predict_diff": max(float(np.abs(a - b).max()) for a, b in
                                     zip(tf.nest.flatten(predictions[0]), tf.nest.flatten(predictions[1]))),
    }


def _any_size_compare(one_device, parameter_server):
    """The any-dataset-size job's results (any_size_job.py: 61 training, 3 validation and 5 evaluation
    examples in batches of 8) under parameter servers, against one device's. One worker runs the steps
    in order, so everything must match; two run them asynchronously, so only the shapes count."""
    history, weights, evaluation, predictions = one_device
    ps_history, ps_weights, ps_evaluation, ps_predictions = parameter_server
    return {
        "history_keys": sorted(ps_history), "epochs": sorted({len(v) for v in ps_history.values()}),
        "history_diff": max(abs(a - b) for key in history for a, b in zip(history[key], ps_history[key])),
        "weights_diff": max(float(np.abs(a - b).max()) for a, b in zip(weights, ps_weights)),
        "evaluate_diff": float(np.abs(np.array(evaluation) - np.array(ps_evaluation)).max()),
        "predictions_shape": list(ps_predictions.shape),
        "predictions_diff": float(np.abs(predictions - ps_predictions).max()),
    }


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()), flush=True)
