"""Train a Keras model with the strategy and precision a tfdist config picks.

Copy this script and replace the model and data with yours: everything else is
plain Keras under `strategy.scope()`.

    python examples/train_digits.py --config configs/default.yaml --set train.epochs=5
"""

from absl import app, flags

import tfdist

_CONFIG = flags.DEFINE_string("config", "configs/default.yaml", "tfdist YAML config.")
_SET = flags.DEFINE_multi_string("set", [], "Config override: section.key=value (repeatable).")


def main(argv):
    del argv  # unused
    try:
        config = tfdist.load_config(_CONFIG.value, _SET.value)
        strategy = tfdist.make_strategy(config)  # before any other TensorFlow call
    except tfdist.ConfigError as e:
        raise app.UsageError(str(e)) from None

    import keras
    import numpy as np

    keras.utils.set_random_seed(config.train.seed)  # the same data order on every process
    chief = tfdist.is_chief(strategy)  # rank 0 / the chief reports; the others stay quiet
    images, labels = tfdist.data.load_digits()
    x = (images / 16.0).astype("float32")[..., None]
    order = np.random.default_rng(config.train.seed).permutation(len(x))  # a fifth held out
    train, val = order[: len(x) * 4 // 5], order[len(x) * 4 // 5 :]
    x_train, x_val, y_train, y_val = x[train], x[val], labels[train], labels[val]

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(config.train.learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )

    model.fit(
        x_train,
        y_train,
        batch_size=config.train.global_batch_size,
        epochs=config.train.epochs,
        validation_data=(x_val, y_val),
        callbacks=[tfdist.Throughput(config.train.global_batch_size)],
        verbose=config.train.verbose if chief else 0,
    )
    loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
    if chief:
        print(f"strategy={config.strategy.kind} replicas={strategy.num_replicas_in_sync} "
              f"val_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)
