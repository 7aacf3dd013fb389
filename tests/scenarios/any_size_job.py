"""The any-dataset-size job: 61 training, 3 validation and 5 evaluation examples in batches of 8.

`run(strategy, hidden)` fits (2 epochs, with validation), evaluates and
predicts. test_any_dataset_size.py runs it in process; as a script it is one
process of a multi-worker job (`python any_size_job.py multi_worker TF_CONFIG OUT`)
or a Horovod rank (`horovodrun ... python any_size_job.py horovod OUT`), and
the first process saves its results to OUT (.npz).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

BATCH = 8
_rng = np.random.default_rng(0)
X = _rng.standard_normal((69, 20)).astype("float32")
Y = _rng.integers(0, 3, 69)
TRAIN, VALIDATION, EVALUATE = slice(0, 61), slice(61, 64), slice(64, 69)


def dense():
    return [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="relu")]


def tensor_parallel():
    from tfdist.layers import ColumnParallelDense, RowParallelDense

    return [ColumnParallelDense(16, activation="relu"), RowParallelDense(16)]


FIT = {"batch_size": BATCH, "epochs": 2, "shuffle": False, "validation_data": (X[VALIDATION], Y[VALIDATION])}


def build(hidden):
    """The seeded, compiled model, in the strategy scope the caller opened."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((20,)), *hidden(), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def run(strategy, hidden):
    """fit (2 epochs, with validation), evaluate and predict; (history, weights, evaluation, predictions)."""
    with strategy.scope():
        model = build(hidden)
    history = model.fit(X[TRAIN], Y[TRAIN], verbose=0, **FIT).history
    evaluation = model.evaluate(X[EVALUATE], Y[EVALUATE], batch_size=BATCH, verbose=0)
    predictions = model.predict(X[EVALUATE], batch_size=BATCH, verbose=0)
    weights = model.get_weights()
    return history, weights, evaluation, predictions


def save(path, results):
    history, weights, evaluation, predictions = results
    np.savez(path, *weights, evaluation=np.array(evaluation), predictions=predictions,
             **{f"history_{key}": np.array(values) for key, values in history.items()})


def load(path):
    saved = np.load(path)
    weights = [saved[f"arr_{i}"] for i in range(sum(name.startswith("arr_") for name in saved.files))]
    history = {name[len("history_"):]: list(saved[name]) for name in saved.files if name.startswith("history_")}
    return history, weights, list(saved["evaluation"]), saved["predictions"]


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "multi_worker":
        os.environ["TF_CONFIG"] = sys.argv[2]
        from tfdist import MultiWorkerMirroredStrategy

        strategy, first = MultiWorkerMirroredStrategy(), json.loads(sys.argv[2])["task"]["index"] == 0
    else:
        from tfdist import HorovodStrategy

        strategy = HorovodStrategy()
        first = int(os.environ.get("HOROVOD_RANK", "0")) == 0
    results = run(strategy, dense)
    if first:
        save(sys.argv[-1], results)
