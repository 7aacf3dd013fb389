"""The cells of docs/optimizers.md's table: every Keras optimizer class with groups of its options, under every kind
of tfdist that trains a whole model on each replica, against the same model trained by Keras without tfdist.

Plain data, without pytest or TensorFlow, so tools/optimizer_table.py can read it; the optimizers themselves are
built from it by tests/scenarios/optimizer_matrix.py.
"""

# Keras 3.15's optimizer classes (keras.optimizers), each with the learning rate its cells use: one that moves the
# weights visibly in 4 updates, so a difference in an update shows against the movement.
OPTIMIZERS = {
    "SGD": 0.1, "Adam": 0.01, "AdamW": 0.01, "Adafactor": 0.1, "Lion": 0.003, "Lamb": 0.01, "Nadam": 0.01,
    "RMSprop": 0.01, "Adagrad": 0.1, "Adadelta": 1.0, "Adamax": 0.01, "Ftrl": 0.1, "Muon": 0.01,
    "ScheduleFreeAdamW": 0.01,
}

# Optimizers whose reference trains under TensorFlow's OneDeviceStrategy, not without a strategy, and why.
REFERENCE_UNDER_ONE_DEVICE_STRATEGY = {
    # Without a strategy Keras builds the optimizer inside the traced step, where ScheduleFreeAdamW's copy of the
    # weights into its momentum is lost: the momentum starts at 0 and the first update moves every weight to about
    # 0. Under any strategy Keras builds it eagerly, as the algorithm has it.
    "ScheduleFreeAdamW": "Keras without a strategy starts its momentum at 0, not at the weights",
}

# Keras lets an optimizer clip one way only (clipnorm, clipvalue or global_clipnorm): four groups cover every option,
# the moving average in one of its own (the kinds that split the state refuse it). Each is a dict of what
# tests/scenarios/optimizer_matrix.py's `build` understands.
OPTIONS = {
    # 2 batches accumulated per update, a clip per element, weight decay but for the biases, a decaying rate.
    "accumulation, clipvalue, weight decay, schedule": {
        "gradient_accumulation_steps": 2, "clipvalue": 0.05, "weight_decay": 0.05, "exclude_biases": True,
        "schedule": True,
    },
    # Keras's dynamic loss scaling around an optimizer clipping the global norm.
    "LossScaleOptimizer, global_clipnorm": {"loss_scale_optimizer": True, "global_clipnorm": 0.5},
    # A fixed loss scale and a clip of each variable's norm.
    "loss_scale_factor, clipnorm": {"loss_scale_factor": 64.0, "clipnorm": 0.5},
    # Keras's moving average of the weights, written into them every 3 iterations, with accumulation (the script of
    # an issue: every weight ended at 0.0 under tfdist's mirrored).
    "use_ema, ema_overwrite_frequency, accumulation": {
        "use_ema": True, "ema_overwrite_frequency": 3, "gradient_accumulation_steps": 2,
    },
}

# The kinds: column -> how tests/scenarios/optimizer_matrix.py makes the strategy; every kind trains on 2 replicas.
KINDS = {
    "mirrored": {"shard_optimizer": 0},
    "shard_optimizer 1": {"shard_optimizer": 1},
    "shard_optimizer 2": {"shard_optimizer": 2},
    "shard_optimizer 3": {"shard_optimizer": 3},
    "multi_worker, 2 processes": {"shard_optimizer": 0, "processes": 2},
}

# The optimizers whose state tfdist splits (tfdist.parallel.optimizer_shards.ELEMENTWISE_OPTIMIZERS): their
# update of an element reads that element alone.
SPLIT = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")
NOT_ELEMENTWISE = ("must update each element on its own", "refused: not split element-wise")
EMA_NOT_SPLIT = ("with use_ema cannot be split", "`use_ema` refused")

# A trained cell's weights and losses are within this of the reference's: float32's epsilon (1.19e-7) for each of
# the 8 steps on weights of magnitude up to 2 is 1.9e-6; the replicas' all-reduced gradient differs from one
# device's by the order of its sum's terms alone. Measured on an AMD EPYC (AVX-512, oneDNN off): 3.0e-7 at most.
TOLERANCE = 2e-6


def refusal(optimizer: str, options: str, kind: str):
    """(what the refusal says, what the table says) for a cell tfdist refuses before training, else None."""
    if not KINDS[kind]["shard_optimizer"]:
        return None
    if optimizer not in SPLIT:
        return NOT_ELEMENTWISE
    return EMA_NOT_SPLIT if OPTIONS[options].get("use_ema") else None


TEST = ("tests/strategies/test_optimizer_matrix.py::"
        "test_every_option_trains_the_weights_of_keras_alone_or_is_refused_before_training")


def says(optimizer: str, kind: str) -> str:
    """What the table's cell says once its test (`test_of`) has passed."""
    refusals = {refusal(optimizer, options, kind) for options in OPTIONS}
    if refusals == {NOT_ELEMENTWISE}:
        return NOT_ELEMENTWISE[1]
    return "equal" + (f"; {EMA_NOT_SPLIT[1]}" if EMA_NOT_SPLIT in refusals else "")


def test_of(optimizer: str, kind: str) -> str:
    return f"{TEST}[{kind}-{optimizer}]"
