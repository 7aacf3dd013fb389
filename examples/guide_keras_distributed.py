"""Keras's "Multi-GPU distributed training with TensorFlow", with tfdist choosing the strategy.

The guide's two parts, in its order:

1. a model built and compiled under `strategy.scope()`, `fit` with validation
   data (inside the scope, as the guide recommends; the validation set's last
   batch is partial), then `evaluate` on the test set;
2. fault tolerance: `ModelCheckpoint` saves a `.keras` file every epoch, and
   each `run_training` first makes a new strategy and, under its scope,
   restores the latest checkpoint with `keras.models.load_model` (or builds
   a fresh model), so the second run trains on from where the first stopped.

Every checkpoint is loaded back at the end and must predict as the model did
when it was saved. The one change from the guide is the line that makes the
strategy (in `make_strategy`); the guide's MNIST is scikit-learn's digits.

    python examples/guide_keras_distributed.py --set strategy.kind=mirrored --set strategy.logical_devices=2
"""

import os

from absl import app, flags

import tfdist

_CONFIG = flags.DEFINE_string("config", None, "tfdist YAML config (the built-in defaults when omitted).")
_SET = flags.DEFINE_multi_string("set", [], "Config override: section.key=value (repeatable).")
_BATCH = flags.DEFINE_integer("batch_size", 64, "The global batch, split over the replicas.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", "/tmp/ckpt", "Where ModelCheckpoint saves.")
_WEIGHTS_OUT = flags.DEFINE_string("weights_out", None, "Also write the final weights here (.npz), from the chief.")


def make_strategy():
    try:
        return tfdist.make_strategy(tfdist.load_config(_CONFIG.value, _SET.value))  # the guide's one change
    except tfdist.ConfigError as e:
        raise app.UsageError(str(e)) from None


def get_compiled_model():
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input(shape=(64,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.005),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def get_dataset():
    """Train, validation (its last batch partial) and test sets, batched to the global batch."""
    import tensorflow as tf

    images, labels = tfdist.data.load_digits()
    x = (images.reshape(len(images), -1) / 16.0).astype("float32")
    batch = _BATCH.value
    return (tf.data.Dataset.from_tensor_slices((x[:1200], labels[:1200])).batch(batch),
            tf.data.Dataset.from_tensor_slices((x[1200:1500], labels[1200:1500])).batch(batch),
            tf.data.Dataset.from_tensor_slices((x[1500:], labels[1500:])).batch(batch))


def make_or_restore_model():
    """The latest checkpoint of `--checkpoint_dir`, or a fresh model if there is none."""
    import keras

    checkpoints = [os.path.join(_CHECKPOINT_DIR.value, name) for name in os.listdir(_CHECKPOINT_DIR.value)]
    if checkpoints:
        latest = max(checkpoints, key=os.path.getmtime)
        print("Restoring from", latest)
        return keras.models.load_model(latest)
    print("Creating a new model")
    return get_compiled_model()


def run_training(train, val, epochs=1):
    import keras

    strategy = make_strategy()
    with strategy.scope():
        model = make_or_restore_model()
    callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(_CHECKPOINT_DIR.value, "ckpt-{epoch}.keras"),
                                                 save_freq="epoch")]
    done = len(os.listdir(_CHECKPOINT_DIR.value))
    with strategy.scope():
        model.fit(train, epochs=done + epochs, initial_epoch=done, callbacks=callbacks, validation_data=val,
                  verbose=2)
    return model


def main(argv):
    del argv  # unused
    import keras
    import numpy as np

    strategy = make_strategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    train, val, test = get_dataset()
    with strategy.scope():
        model = get_compiled_model()
        model.fit(train, epochs=2, validation_data=val, verbose=2)
    print("evaluate:", model.evaluate(test, verbose=0))

    os.makedirs(_CHECKPOINT_DIR.value, exist_ok=True)
    run_training(train, val)  # a fresh model (or the last run's), then its checkpoint
    model = run_training(train, val)  # restored from that checkpoint, trained on one more epoch
    probe = next(iter(test))[0]
    for name in sorted(os.listdir(_CHECKPOINT_DIR.value)):  # every save loads back
        restored = keras.models.load_model(os.path.join(_CHECKPOINT_DIR.value, name))
        print(f"{name} loads: predictions {restored.predict(probe, verbose=0).shape}")
    last = keras.models.load_model(max((os.path.join(_CHECKPOINT_DIR.value, n) for n in
                                        os.listdir(_CHECKPOINT_DIR.value)), key=os.path.getmtime))
    difference = np.abs(last.predict(probe, verbose=0) - model.predict(probe, verbose=0)).max()
    print(f"the last checkpoint predicts as the trained model: max difference {difference:.2e}")
    if _WEIGHTS_OUT.value and tfdist.is_chief(strategy):  # launched as several processes, one writes
        np.savez(_WEIGHTS_OUT.value, *model.get_weights())


if __name__ == "__main__":
    app.run(main)
