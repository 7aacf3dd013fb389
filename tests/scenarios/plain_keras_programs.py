"""Plain Keras programs, none of which asks for tfdist, and what each left behind, as one JSON line on stdout.

    python tests/scenarios/plain_keras_programs.py OUT_DIR TARGETS_JSON [--after-a-tfdist-strategy]

With `--after-a-tfdist-strategy` the process first makes a tfdist strategy, which installs tfdist's patches to
Keras; without it the process never imports tfdist. `tests/_compat/test_plain_keras.py` runs both and compares:
a guest changes nothing it was not given. Each program reports its weights (their bytes' digest), the op types its
train function traced, the files it wrote, or the error Keras raised (some are Keras bugs that tfdist fixes only
for its own strategies, or after `tfdist.fix_tensorflow_strategies()`). TARGETS_JSON lists the Keras functions
tfdist patches: their signatures and docstrings are reported as Keras has them.
"""

import collections
import hashlib
import importlib
import inspect
import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402

DEVICES = ["/cpu:0", "/cpu:1"]
_KEY_BASES = iter(range(1_000, 1_000_000, 1_000))


def _tensorflow_mirrored():
    """TensorFlow's own MirroredStrategy, its collective keys apart from the other programs': TensorFlow numbers
    every instance's from one start, so a second instance reuses the first's with other shapes ("Shape mismatch
    in the collective instance 100"), with or without tfdist."""
    return type("MirroredStrategy", (tf.distribute.MirroredStrategy,), {"_collective_key_base": next(_KEY_BASES)})(
        DEVICES)


def _digest(arrays) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype("float32")
    return x, (x[:, :3].argmax(axis=1)).astype("int32")


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3, dtype="float32")])


def _traced_ops(function) -> dict:
    """Op type -> count in every graph `function` traced, the functions it calls included."""
    # Keras's train_function is a Python function around the tf.function it traces (in its closure).
    traced = next(f for f in [function, *(c.cell_contents for c in function.__closure__ or ())]
                  if hasattr(f, "_list_all_concrete_functions"))
    counts = collections.Counter()
    for concrete in traced._list_all_concrete_functions():
        graph = concrete.graph.as_graph_def()
        counts.update(node.op for node in graph.node)
        counts.update(node.op for library in graph.library.function for node in library.node_def)
    return dict(sorted(counts.items()))


def _fitted(strategy, optimizer, **fit):
    x, y = _data()
    scope = strategy.scope() if strategy else _nothing()
    with scope:
        model = _model()
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, **fit)
    return model, history


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _outcome(program):
    try:
        return program()
    except Exception as error:  # a Keras bug in plain Keras is plain Keras's behaviour: it is compared too
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}


def _weights_and_history(model, history, ops=False):
    result = {"weights": _digest(model.get_weights()),
              "history": {k: [round(float(v), 7) for v in vs] for k, vs in history.history.items()},
              "optimizer_variables": _digest([v.numpy() for v in model.optimizer.variables])}
    if ops:
        result["traced_ops"] = _traced_ops(model.train_function)
    return result


def _ema_and_accumulation():
    return keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=3, gradient_accumulation_steps=2,
                                 clipnorm=0.5, weight_decay=0.01)


def one_device_ema_and_accumulation():
    return _weights_and_history(*_fitted(None, _ema_and_accumulation))


def tensorflow_one_device_ema_and_accumulation():
    return _weights_and_history(*_fitted(tf.distribute.OneDeviceStrategy("/cpu:0"), _ema_and_accumulation))


def tensorflow_mirrored_mixed_precision():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model, history = _fitted(_tensorflow_mirrored(),
                                 lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, clipvalue=1.0)))
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return _weights_and_history(model, history, ops=True)


def tensorflow_mirrored_accumulation():
    model, history = _fitted(_tensorflow_mirrored(),
                             lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    return _weights_and_history(model, history)


def tensorflow_mirrored_ema_overwrite():
    model, history = _fitted(_tensorflow_mirrored(),
                             lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=2))
    return _weights_and_history(model, history)


def checkpoints_and_backup(out_dir):
    def program():
        path = os.path.join(out_dir, "checkpoints")
        callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(path, "e{epoch}.keras")),
                     keras.callbacks.BackupAndRestore(os.path.join(path, "backup"), delete_checkpoint=False)]
        model, history = _fitted(_tensorflow_mirrored(), lambda: keras.optimizers.Adam(0.01),
                                 callbacks=callbacks)
        files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
        reloaded = keras.models.load_model(os.path.join(path, "e3.keras"))
        x, _ = _data()
        return {**_weights_and_history(model, history), "files": files,
                "reloaded_predictions": _digest([reloaded.predict(x, verbose=0)])}

    return program


def tensorflow_mirrored_custom_loop():
    strategy = _tensorflow_mirrored()
    x, y = _data()
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.Adam(0.01)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(batch):
        def replica_step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)),
                                                  global_batch_size=16)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    losses = [float(step(batch)) for batch in dataset]
    return {"weights": _digest(model.get_weights()), "losses": [round(v, 7) for v in losses]}


def signatures(targets):
    """Target -> its signature, name and docstring's digest, as the process sees them."""
    found = {}
    for target in targets:
        module, *names = target.split(".")
        function = importlib.import_module(module)
        for name in names:
            function = getattr(function, name) if hasattr(function, name) else importlib.import_module(
                f"{function.__name__}.{name}")
        found[target] = {"signature": str(inspect.signature(function)), "name": function.__name__,
                         "doc": hashlib.sha256((function.__doc__ or "").encode()).hexdigest()[:16]}
    return found


def main():
    out_dir, targets = sys.argv[1], json.loads(sys.argv[2])
    tf.config.experimental.enable_op_determinism()
    if "--after-a-tfdist-strategy" in sys.argv:
        import tfdist

        tfdist.MirroredStrategy(DEVICES)
    elif any(name == "tfdist" or name.startswith("tfdist.") for name in sys.modules):
        raise SystemExit("the reference imported tfdist")
    results = {
        "one_device_ema_and_accumulation": _outcome(one_device_ema_and_accumulation),
        "tensorflow_one_device_ema_and_accumulation": _outcome(tensorflow_one_device_ema_and_accumulation),
        "tensorflow_mirrored_mixed_precision": _outcome(tensorflow_mirrored_mixed_precision),
        "tensorflow_mirrored_accumulation": _outcome(tensorflow_mirrored_accumulation),
        "tensorflow_mirrored_ema_overwrite": _outcome(tensorflow_mirrored_ema_overwrite),
        "checkpoints_and_backup": _outcome(checkpoints_and_backup(out_dir)),
        "tensorflow_mirrored_custom_loop": _outcome(tensorflow_mirrored_custom_loop),
        "signatures": signatures(targets),
        "tfdist_imported": any(name == "tfdist" for name in sys.modules),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
