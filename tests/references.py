"""What Keras alone does, for tests that compare tfdist with it: run by `oracle.keras_alone` in a process that never
imported tfdist. Nothing here imports tfdist (tests/scenarios/keras_alone.py fails if anything did)."""


# keras-hub's causal LMs of the tests: backbone class, task class and what the backbone needs besides the sizes.
CAUSAL_LMS = {"gemma": ("GemmaBackbone", "GemmaCausalLM", {"head_dim": 8}),
              "llama": ("LlamaBackbone", "LlamaCausalLM", {})}
# Those the fine-tuning tests train with LoRA (tests/scenarios/fine_tune_*.py).
FINE_TUNED_LMS = {"gemma": CAUSAL_LMS["gemma"],
                  "llama3": ("Llama3Backbone", "Llama3CausalLM", {}),
                  "mistral": ("MistralBackbone", "MistralCausalLM", {"num_key_value_heads": 2})}


def causal_lm(name: str, vocabulary: int, layers: int, lora_rank=None, learning_rate: float = 1e-3):
    """A tiny keras-hub causal LM of `CAUSAL_LMS` or `FINE_TUNED_LMS` (random weights, seeded; nothing downloaded),
    compiled with Adam at `learning_rate`, with keras-hub's LoRA (the query and value projections; every other weight
    frozen) at `lora_rank`. Built in the strategy scope the caller opened."""
    import keras
    import keras_hub

    backbone, task, extra = {**CAUSAL_LMS, **FINE_TUNED_LMS}[name]
    keras.utils.set_random_seed(1)
    sizes = {"num_query_heads": 4, "num_key_value_heads": 4, "hidden_dim": 32, "intermediate_dim": 64, **extra}
    model = getattr(keras_hub.models, task)(backbone=getattr(keras_hub.models, backbone)(
        vocabulary_size=vocabulary, num_layers=layers, dropout=0.0, **sizes), preprocessor=None)
    if lora_rank:
        model.backbone.enable_lora(rank=lora_rank)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), weighted_metrics=[],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, x, y, under: str = "", evaluate=None, predict=None, **fit_kwargs) -> dict:
    """The compiled model, saved in the file `model` or built by `references.<name>(**kwargs)` for
    `model=(name, kwargs)` (what a file does not hold whole: keras-hub's LoRA freezes weights it does not save),
    trained by Keras's `fit(x, y, **fit_kwargs)`: its weights, History, updates and the shapes of its optimizer's
    variables; then, where given, `evaluate(*evaluate)` and `predict(predict)` at the fit's batch size.

    `under="one_device"` loads and trains it under TensorFlow's OneDeviceStrategy (Keras then builds the optimizer
    eagerly, as under any strategy), else without a strategy. The seed is 0 before `fit`, as tfdist's runs set it.
    """
    import keras
    import tensorflow as tf

    strategy = {"": tf.distribute.get_strategy(), "one_device": tf.distribute.OneDeviceStrategy("/cpu:0")}[under]
    with strategy.scope():
        model = keras.models.load_model(model) if isinstance(model, str) else globals()[model[0]](**model[1])
    keras.utils.set_random_seed(0)
    history = model.fit(x, y, verbose=0, **fit_kwargs)
    batch = fit_kwargs.get("batch_size")
    return {"weights": model.get_weights(), "history": history.history,
            "iterations": int(model.optimizer.iterations.numpy()),
            "optimizer_shapes": [tuple(variable.shape) for variable in model.optimizer.variables],
            "evaluation": None if evaluate is None else model.evaluate(*evaluate, batch_size=batch, verbose=0),
            "predictions": None if predict is None else model.predict(predict, batch_size=batch, verbose=0)}
