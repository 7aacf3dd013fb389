"""Horovod scenarios, each run on every rank by test_horovod.py under horovodrun.

`horovodrun -np 2 ... python horovod_scenarios.py NAME OUT_DIR [KEY=VALUE ...]`;
each rank writes OUT_DIR/rank-N.json. `... horovod_scenarios.py cases OUT_DIR CASE ...`
runs several in one job (its processes are the slow part to start), each CASE
`NAME[:KEY=VALUE,...]`; each rank writes {CASE: result} to OUT_DIR/rank-N.json.
"""

import contextlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist import HorovodStrategy, remat  # noqa: E402

BATCH = 32
STEPS = 5


def _data(n=BATCH * STEPS, features=12, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int32")
    return x, y


def _model(embedding=False):
    hidden = ([keras.layers.Embedding(VOCABULARY, 4), keras.layers.Flatten()] if embedding
              else [keras.layers.Dense(16, activation="tanh")])
    return keras.Sequential([keras.Input((12,)), *hidden, keras.layers.Dense(3, activation="softmax")])


VOCABULARY = 50


def _ids(x):
    """The features as ids of an embedding's rows: the gradient is IndexedSlices."""
    return (np.abs(x) * 10).astype("int32") % VOCABULARY


def _compile(model, learning_rate, accumulation=1, clipnorm=None):
    options = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    if clipnorm:
        options["clipnorm"] = clipnorm
    model.compile(optimizer=keras.optimizers.SGD(learning_rate, **options),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])


def matches_single_process(op="average", fp16_compression="0", accumulation="1", examples=str(BATCH * STEPS),
                           clipnorm="0", embedding="0"):
    """One epoch of global batch BATCH; every rank also trains the same model
    in one plain process (equivalent settings) and compares."""
    accumulation, clipnorm, embedding = int(accumulation), float(clipnorm), embedding == "1"
    x, y = _data(int(examples))
    if embedding:
        x = _ids(x)
    strategy = HorovodStrategy(op=op, fp16_compression=fp16_compression == "1")
    all_reduce, gathered = strategy.extended._cross_device_ops, []
    all_gather = all_reduce._all_gather
    all_reduce._all_gather = lambda *args: gathered.append(args) or all_gather(*args)  # counted as traced
    keras.utils.set_random_seed(strategy.rank)  # different per rank: the broadcast must even them out
    with strategy.scope():
        model = _model(embedding)
        _compile(model, 0.1, accumulation, clipnorm)
    initial = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    resolver = strategy.cluster_resolver  # as TensorFlow's multi-worker guides find their chief
    result = {"rank": strategy.rank, "size": strategy.size, "iterations": int(model.optimizer.iterations.numpy()),
              "task": [resolver.task_type, resolver.task_id, len(resolver.cluster_spec().as_dict()["worker"])],
              "weights_checksum": float(sum(np.abs(w).sum() for w in model.get_weights()))}
    evaluate = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)

    reference = _model(embedding)
    reference.set_weights(initial)
    # `sum` adds the ranks' mean gradients: the single-process update with size x the rate.
    _compile(reference, 0.1 * (strategy.size if op == "sum" else 1), accumulation, clipnorm)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    # Built on every rank: the ranks must create the same layers, or the names Keras gives the
    # next case's layers, and so Horovod's names for their gradients, differ between ranks.
    seeded = _seeded_weights(strategy.rank, embedding)
    result.update(
        initial_differs_from_seeded=bool(strategy.rank and any(not np.allclose(a, b) for a, b in zip(initial, seeded))),
        max_abs_diff=max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights())),
        evaluate=evaluate, reference_evaluate=reference.evaluate(x, y, batch_size=BATCH, verbose=0),
        predict_shape=list(predictions.shape),
        predict_diff=float(np.abs(predictions - reference.predict(x, batch_size=BATCH, verbose=0)).max()),
        sparse_all_gathers=len(gathered),
    )
    return result


@contextlib.contextmanager
def _dtype_policy(name):
    keras.mixed_precision.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def loss_scaling_matches_single_process(overflow_on_rank_1="0"):
    """mixed_float16 (compile wraps the optimizer in Keras's LossScaleOptimizer) on two ranks against one
    process with the global batch, 2 epochs. With `overflow_on_rank_1`, the last example of the first global
    batch, in rank 1's part, overflows float16: one process skips that step (the batch's gradient is not
    finite) and halves its loss scale, so both ranks must, though rank 0's part is finite."""
    x, y = _data()
    if overflow_on_rank_1 == "1":
        x[BATCH - 1] = 1e5  # float16 holds at most 65504
    with _dtype_policy("mixed_float16"):
        strategy = HorovodStrategy()
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = _model()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        reference = _model()
        reference.set_weights(model.get_weights())
        reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        for trained in (model, reference):
            trained.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return {"rank": strategy.rank, "loss_scaled": type(model.optimizer).__name__ == "LossScaleOptimizer",
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights())),
            "steps": [int(m.optimizer.iterations.numpy()) for m in (model, reference)],
            "scales": [float(m.optimizer.dynamic_scale.numpy()) for m in (model, reference)]}


def _seeded_weights(seed, embedding=False):
    keras.utils.set_random_seed(seed)
    return _model(embedding).get_weights()


def keras_api_matches_single_process(accumulation="1"):
    """The Horovod Keras API (`tfdist.horovod.tensorflow.keras`): each rank fits its half of
    every batch with a DistributedOptimizer; compared with one plain process."""
    import tfdist.horovod.tensorflow.keras as hvd

    accumulation = int(accumulation)
    hvd.init()
    x, y = _data()
    keras.utils.set_random_seed(hvd.rank())
    model = _model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                         backward_passes_per_step=accumulation,
                                         average_aggregated_gradients=True)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    half = BATCH // hvd.size()
    mine = np.concatenate([np.arange(b * BATCH + hvd.rank() * half, b * BATCH + (hvd.rank() + 1) * half)
                           for b in range(STEPS)])
    history = model.fit(x[mine], y[mine], batch_size=half, epochs=1, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
    reference = _model()
    reference.set_weights(_seeded_weights(0))  # rank 0's initial weights, which the callback gave every rank
    options = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5, **options),
                      loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    averaged_loss = hvd.allreduce(np.float64(history.history["loss"][-1]), name="check_loss")
    return {"rank": hvd.rank(), "updates": int(model.optimizer.iterations.numpy()),
            "max_abs_diff": max(float(np.abs(a - b).max())
                                for a, b in zip(model.get_weights(), reference.get_weights())),
            "loss_is_rank_average": abs(float(averaged_loss) - history.history["loss"][-1]) < 1e-6}


def _split_optimizer(name):
    if name in ("adamw_excluding_biases", "adamw_accumulating_4"):
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1,
                                           gradient_accumulation_steps=4 if "accumulating" in name else None)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer
    return {"sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01),
            "adam_accumulating_4": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=4),
            "mixed_float16_adam": lambda: keras.optimizers.Adam(0.01),  # compile adds loss scaling
            "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1)}[name]()


def split_optimizer_matches_unsplit(stage="1", optimizer="adam", resume="0", recompute="0"):
    """The optimizer's state split over the ranks (`shard_optimizer`) against the same Horovod job
    unsplit: 20 steps of global batch BATCH, and each rank's slot bytes. With `resume`, a checkpoint
    every rank joins, resumed by a split job and by one plain process, and a Keras file saved by one
    process refused. With `recompute`, the split job's layers also recompute their forward pass
    (`tfdist.remat(model, "full")`)."""
    from tfdist import Checkpoint
    from tfdist.parallel.optimizer_shards import shards_of

    x, y = _data()
    directory = os.path.join(os.environ["SCENARIO_DIR"], f"checkpoint-{stage}-{optimizer}")

    def train(shard_optimizer, epochs, callbacks=()):
        keras.utils.set_random_seed(0)
        strategy = (HorovodStrategy(shard_optimizer=shard_optimizer, keep_whole_below=8)  # stage 3: the kernels
                    if shard_optimizer is not None else None)
        with _dtype_policy(optimizer.partition("_adam")[0] if "float16" in optimizer else "float32"):
            with strategy.scope() if strategy else contextlib.nullcontext():
                # 12*7 + 7 + 7*3 + 3 weights: lengths 2 ranks do not all divide, so slices are padded.
                model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(7, activation="tanh"),
                                          keras.layers.Dense(3, activation="softmax")])
                if recompute == "1" and shard_optimizer:
                    remat(model, "full")
                model.compile(optimizer=_split_optimizer(optimizer), loss="sparse_categorical_crossentropy")
            model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
        return model

    def diff(a, b):
        return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))

    import horovod.tensorflow as hvd

    hvd.init()  # as HorovodStrategy does; the rank is needed before its first job here
    rank = hvd.rank()
    saving = [Checkpoint(directory, write=rank == 0)] if resume == "1" else []
    split = train(int(stage), epochs=4, callbacks=saving)  # 4 epochs of STEPS steps
    whole = train(0, epochs=5 if resume == "1" else 4)
    shards = shards_of(split.optimizer)
    result = {"rank": rank, "iterations": int(split.optimizer.iterations.numpy()), "report": shards.report(),
              "slot_devices": sorted({v.value.device for copy in shards.copies for v in copy.variables})}
    if resume == "1":
        path = os.path.join(os.environ["SCENARIO_DIR"], f"model-{rank}.keras")
        try:
            split.save(path)
        except ValueError as error:
            result["keras_file_refused"] = str(error)
        result["keras_file_written"] = os.path.exists(path)  # refused before Keras opened it
        together = os.path.join(os.environ["SCENARIO_DIR"], "model-together.keras")
        split.distribute_strategy.save_model(split, together)  # every rank at once; rank 0 writes
        split.distribute_strategy.any_process(False)  # a barrier: rank 0's file is whole
        from_file = keras.models.load_model(together)  # one plain process's model: a 5th epoch alone
        from_file.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        result["keras_file_resumed_diff"] = diff(from_file, whole)
        # The checkpoint of step 20 taken up by a split job (every rank) and by one plain process: a 5th epoch.
        resumed = train(int(stage), epochs=5, callbacks=[Checkpoint(directory, write=False)])
        plain = Checkpoint(directory, write=False)
        alone = train(None, epochs=5, callbacks=[plain])
        result.update(resumed_split_diff=diff(resumed, whole), resumed_alone_diff=diff(alone, whole),
                      resumed_from=plain.resumed_from_step)
    else:
        result["max_abs_diff"] = diff(split, whole)
    return result


def adasum_is_refused():
    try:
        HorovodStrategy(op="adasum")
    except ValueError as error:
        import horovod.tensorflow as hvd

        return {"rank": hvd.rank(), "error": str(error)}
    raise AssertionError("adasum was accepted without MPI")


def adasum_matches_its_formula():
    """op=adasum (under horovodrun --mpi): each step applies, per weight tensor,
    Adasum(g0, g1) = (1 - g0.g1 / 2|g0|^2) g0 + (1 - g0.g1 / 2|g1|^2) g1 of the
    ranks' gradients on their halves of the batch (Maleki et al. 2021)."""
    import tensorflow as tf

    x, y = _data()
    strategy = HorovodStrategy(op="adasum")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _model()
        _compile(model, 0.1)
    initial = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    def adasum(g0, g1):
        dot = tf.reduce_sum(g0 * g1)
        return (1 - dot / (2 * tf.reduce_sum(g0 * g0))) * g0 + (1 - dot / (2 * tf.reduce_sum(g1 * g1))) * g1

    def trained_with(combine):
        reference = _model()
        reference.set_weights(initial)
        loss = keras.losses.SparseCategoricalCrossentropy()
        half = BATCH // 2
        for step in range(STEPS):
            grads = []
            for part in (0, 1):
                rows = slice(step * BATCH + part * half, step * BATCH + (part + 1) * half)
                with tf.GradientTape() as tape:
                    value = loss(y[rows], reference(x[rows]))
                grads.append(tape.gradient(value, reference.trainable_variables))
            for variable, g0, g1 in zip(reference.trainable_variables, *grads):
                variable.assign_sub(0.1 * combine(g0, g1))
        return reference.get_weights()

    def max_diff(weights):
        return max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), weights))

    return {"rank": strategy.rank, "max_abs_diff": max_diff(trained_with(adasum)),
            "diff_from_average": max_diff(trained_with(lambda g0, g1: (g0 + g1) / 2))}


def agreement_with_a_stuck_rank():
    """Rank 1 stops answering between steps while rank 0 waits in the ranks' agreement (`any_process`,
    the all-reduce a SIGTERM stop or a checkpoint calls after a step): rank 0 ends with one line."""
    import tensorflow as tf

    strategy = HorovodStrategy(stall_shutdown_seconds=3)
    if strategy.rank == 1:
        time.sleep(120)  # alive but stuck; horovodrun stops it when rank 0 exits
    try:
        strategy.any_process(False)
    except tf.errors.OpError as error:
        raise SystemExit(f"tfdist: error: {strategy.job_error(error)}")
    raise AssertionError("the agreement finished without rank 1")


def _run(name, options):
    """Scenario `name`'s result, given its KEY=VALUE options."""
    return globals()[name](**dict(option.split("=", 1) for option in options))


def _run_case(case):
    """`NAME[:KEY=VALUE,...]`'s result."""
    name, _, options = case.partition(":")
    return _run(name, options.split(",") if options else [])


if __name__ == "__main__":
    name, out_dir, *options = sys.argv[1:]
    os.environ["SCENARIO_DIR"] = out_dir  # shared by the ranks
    if name == "cases":
        result = {case: _run_case(case) for case in options}
        rank = next(iter(result.values()))["rank"]
    else:
        result = _run(name, options)
        rank = result["rank"]
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
