"""Every optimizer cell of tests/optimizer_cells.py trained in this process, and what each left, as a JSON file.

    python tests/scenarios/optimizer_matrix.py OUT.json                      # Keras alone: the reference
    python tests/scenarios/optimizer_matrix.py OUT.json --kind mirrored --kind "shard_optimizer 2"
    TF_CONFIG=... python tests/scenarios/optimizer_matrix.py OUT.json --kind "multi_worker, 2 processes"

Without `--kind` the process never imports tfdist and trains each cell on one device without a strategy, as a
user's script does (under TensorFlow's OneDeviceStrategy where optimizer_cells.py says why); with it, the cells
train under each kind's tfdist strategy on 2 replicas (2 logical devices, or 2 processes of one). OUT.json maps the
kind ("keras" for the reference) to "optimizer|options" to the weights and History's losses, or to the one line
tfdist refused the cell with before training, or to the error it failed with, and the CPU-seconds it took.
"""

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optimizer_cells as cells  # noqa: E402

GLOBAL_BATCH, EPOCHS = 16, 2  # 64 examples: 8 steps, 4 updates with accumulation


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype("float32")
    return x, x[:, :3].argmax(axis=1).astype("int32")


def build(name: str, options: dict) -> keras.optimizers.Optimizer:
    """Keras's optimizer `name` with `options` (tests/optimizer_cells.py's OPTIONS)."""
    rate = cells.OPTIMIZERS[name]
    if options.get("schedule"):
        rate = keras.optimizers.schedules.ExponentialDecay(rate, decay_steps=2, decay_rate=0.7)
    kwargs = {k: v for k, v in options.items()
              if k in ("use_ema", "ema_overwrite_frequency", "gradient_accumulation_steps", "clipnorm", "clipvalue",
                       "global_clipnorm", "weight_decay", "loss_scale_factor")}
    optimizer = getattr(keras.optimizers, name)(learning_rate=rate, **kwargs)
    if options.get("exclude_biases"):
        optimizer.exclude_from_weight_decay(var_names=["bias"])
    return keras.optimizers.LossScaleOptimizer(optimizer) if options.get("loss_scale_optimizer") else optimizer


def train(strategy, name: str, options: dict) -> dict:
    """The weights and losses of the cell, or the one line tfdist refused it with before training (at compile), or
    the error it failed with."""
    x, y = data()
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3, activation="softmax")])
        try:
            model.compile(optimizer=build(name, options), loss="sparse_categorical_crossentropy")
        except ValueError as error:
            return {"refused": one_line(error)}
    try:
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    except Exception as error:  # noqa: BLE001  (the cell says how it ended)
        return {"error": one_line(error)}
    return {"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"]}


def one_line(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0]}" + (f" (and {len(lines) - 1} lines)" if lines[1:] else "")


def strategy_of(kind: str):
    import tfdist

    settings = cells.KINDS[kind]
    if settings.get("processes"):
        return tfdist.MultiWorkerMirroredStrategy(shard_optimizer=settings["shard_optimizer"])
    return tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"], shard_optimizer=settings["shard_optimizer"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--kind", action="append", choices=list(cells.KINDS))
    args = parser.parse_args()
    results = {}
    for kind in args.kind or ["keras"]:
        strategy = strategy_of(kind) if args.kind else None
        results[kind] = {}
        for name in cells.OPTIMIZERS:
            under = strategy
            if not args.kind and name in cells.REFERENCE_UNDER_ONE_DEVICE_STRATEGY:
                under = tf.distribute.OneDeviceStrategy("/cpu:0")
            for options in cells.OPTIONS:
                started = time.process_time()
                results[kind][f"{name}|{options}"] = {**train(under, name, cells.OPTIONS[options]),
                                                      "cpu_seconds": time.process_time() - started}
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
