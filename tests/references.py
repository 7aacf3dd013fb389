"""What Keras alone does, for tests that compare tfdist with it: run by `oracle.keras_alone` in a process that never
imported tfdist. Nothing here imports tfdist (tests/scenarios/keras_alone.py fails if anything did)."""


def fit(model_file: str, x, y, under: str = "", seed: int = 0, evaluate=None, predict=None, **fit_kwargs) -> dict:
    """The compiled model saved in `model_file` trained by Keras's `fit(x, y, **fit_kwargs)`: its weights, History,
    updates and the shapes of its optimizer's variables; then, where given, `evaluate(*evaluate)` and `predict(predict)`
    at the fit's batch size.

    `under="one_device"` loads and trains it under TensorFlow's OneDeviceStrategy (Keras then builds the optimizer
    eagerly, as under any strategy); `under="mirrored"` under TensorFlow's MirroredStrategy on 2 logical CPUs.
    """
    import keras
    import tensorflow as tf

    strategy = {"": tf.distribute.get_strategy(), "one_device": tf.distribute.OneDeviceStrategy("/cpu:0"),
                "mirrored": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])}[under]
    with strategy.scope():
        model = keras.models.load_model(model_file)
    keras.utils.set_random_seed(seed)
    history = model.fit(x, y, verbose=0, **fit_kwargs)
    batch = fit_kwargs.get("batch_size")
    return {"weights": model.get_weights(), "history": history.history,
            "iterations": int(model.optimizer.iterations.numpy()),
            "optimizer_shapes": [tuple(variable.shape) for variable in model.optimizer.variables],
            "evaluation": None if evaluate is None else model.evaluate(*evaluate, batch_size=batch, verbose=0),
            "predictions": None if predict is None else model.predict(predict, batch_size=batch, verbose=0)}

