"""PipelineStrategy: same weights as one device, schedules, errors, save/load, config."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import attention_and_mlp, megatron_layout_map, ops_per_device, train_with_metrics
from oracle import keras_alone
from tfdist import ConfigError, PipelineStrategy, load_config, make_strategy
from tfdist.layers import ColumnParallelDense, ParallelMLP, RowParallelDense
from tfdist.parallel.layout import Layout

FOUR = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
STEPS = 5
BATCH = 32

rng = np.random.default_rng(0)
X = rng.standard_normal((STEPS * BATCH, 12)).astype("float32")
Y = rng.integers(0, 5, STEPS * BATCH).astype("int32")


def _sequential():
    layers = [keras.layers.Dense(24, activation="tanh", name=f"hidden{i}") for i in range(4)]
    return keras.Sequential([keras.Input((12,)), *layers, keras.layers.Dense(5, name="logits")])


def _functional():
    """Branches inside a stage, and a skip connection that crosses a stage."""
    inp = keras.Input((12,))
    a = keras.layers.Dense(24, activation="tanh", name="a")(inp)
    b1 = keras.layers.Dense(24, activation="tanh", name="b1")(a)
    b2 = keras.layers.Dense(24, activation="relu", name="b2")(a)
    c = keras.layers.Add(name="c")([b1, b2])
    d = keras.layers.Dense(24, activation="tanh", name="d")(c)
    e = keras.layers.Concatenate(name="e")([d, a])
    return keras.Model(inp, keras.layers.Dense(5, name="logits")(e))


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _train(build, strategy, initial=None, batch_size=BATCH, x=X, y=Y):
    with strategy.scope():
        model = _compile(build())
    if initial is not None:
        model.set_weights(initial)
    start = model.get_weights()
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return start, model, history.history


def _keras_alone(build, batch_size=BATCH, x=X, y=Y):
    """(the model's first weights, one epoch of it trained by Keras in a process that never imported tfdist: its
    "weights", "history" and, on X and Y, "evaluation" and "predictions")."""
    model = _compile(build())
    return model.get_weights(), keras_alone("fit", model, x, y, batch_size=batch_size, epochs=1, shuffle=False,
                                            evaluate=(X, Y), predict=X)


def _assert_same(expected_weights, model):
    for a, b in zip(expected_weights, model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", [False, True])
def test_sequential_matches_one_device(schedule, recompute):
    start, reference = _keras_alone(_sequential)
    strategy = PipelineStrategy(
        2, 4, schedule=schedule, devices=FOUR, recompute=recompute, verbose=False
    )
    _, model, logs = _train(_sequential, strategy, start)
    moved = max(np.abs(a - b).max() for a, b in zip(start, reference["weights"]))
    assert moved > 1e-3
    _assert_same(reference["weights"], model)
    assert logs["loss"][0] == pytest.approx(reference["history"]["loss"][0], abs=1e-5)
    assert logs["accuracy"][0] == pytest.approx(reference["history"]["accuracy"][0])
    partition = strategy.partition_of(model)
    assert [len(s.layer_names) for s in partition.stages] and len(partition.stages) == 2


def test_functional_with_branches_and_a_skip_over_three_stages():
    start, reference = _keras_alone(_functional)
    strategy = PipelineStrategy(
        3, 4, devices=["/cpu:0", "/cpu:1", "/cpu:2"], boundaries=["b2", "e"], verbose=False
    )
    _, model, _ = _train(_functional, strategy, start)
    _assert_same(reference["weights"], model)
    assert [s.layer_names for s in strategy.partition_of(model).stages] == [
        ["a", "b1"], ["b2", "c", "d"], ["e", "logits"]
    ]


def test_uneven_last_batch_still_matches():
    # 150 examples in batches of 48: the last batch has 6, 3 per replica, which
    # split 4 ways as 1, 1, 1, 0 (an empty micro-batch must add nothing).
    x, y = X[:150], Y[:150]
    start, reference = _keras_alone(_sequential, batch_size=48, x=x, y=y)
    strategy = PipelineStrategy(2, 4, devices=FOUR, verbose=False)
    _, model, _ = _train(_sequential, strategy, start, batch_size=48, x=x, y=y)
    _assert_same(reference["weights"], model)


def test_evaluate_and_predict_match_the_reference():
    start, reference = _keras_alone(_sequential)
    strategy = PipelineStrategy(2, 4, devices=FOUR, verbose=False)
    _, model, _ = _train(_sequential, strategy, start)
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=BATCH, verbose=0), reference["evaluation"], atol=1e-5)
    np.testing.assert_allclose(model.predict(X, batch_size=BATCH, verbose=0), reference["predictions"], atol=1e-5)


def test_fit_evaluate_and_predict_inside_the_scope_match_one_device():
    """Keras's distributed-training guide calls fit inside `strategy.scope()`: the stages are timed (balance_by
    time) while the scope is open, on variables the strategy distributes."""
    start, reference = _keras_alone(_sequential)
    strategy = PipelineStrategy(2, 4, devices=FOUR, balance_by="time", verbose=False)
    with strategy.scope():
        _, model, logs = _train(_sequential, strategy, start)
        evaluated = model.evaluate(X, Y, batch_size=BATCH, verbose=0)
        predicted = model.predict(X, batch_size=BATCH, verbose=0)
    _assert_same(reference["weights"], model)
    assert logs["loss"][0] == pytest.approx(reference["history"]["loss"][0], abs=1e-5)
    np.testing.assert_allclose(evaluated, reference["evaluation"], atol=1e-5)
    np.testing.assert_allclose(predicted, reference["predictions"], atol=1e-5)


def test_save_and_load_on_one_device(tmp_path):
    strategy = PipelineStrategy(2, 4, devices=FOUR, verbose=False)
    _, model, _ = _train(_sequential, strategy)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0), atol=1e-6)


def _tensor_parallel():
    keras.utils.set_random_seed(0)  # sharded and whole kernels start from the same whole values
    return keras.Sequential([
        keras.Input((12,)), keras.layers.Dense(24, activation="tanh", name="embed"),
        ColumnParallelDense(24, activation="tanh", name="column"), RowParallelDense(24, name="row"),
        ParallelMLP(32, name="mlp"), keras.layers.Dense(5, name="logits"),
    ])


@pytest.mark.parametrize("recompute", [False, True])
def test_tensor_parallel_stages_match_one_device(recompute):
    from tfdist.parallel.split_variables import is_split, shards

    strategy = PipelineStrategy(2, 4, devices=FOUR, tensor_parallel_size=2, boundaries=["row"],
                                recompute=recompute, verbose=False)
    assert strategy.stage_devices == [[FOUR[0], FOUR[2]], [FOUR[1], FOUR[3]]]  # the model axis's two pipelines
    # tfdist's own parallel layers have no plain Keras twin: their one-device run is the reference.
    start, reference, _ = _train(_tensor_parallel, tf.distribute.get_strategy())
    _, model, _ = _train(_tensor_parallel, strategy)
    column = model.get_layer("column").kernel
    assert is_split(column) and [s.device[-5:] for s in shards(column)] == ["CPU:0", "CPU:1"]
    assert [s.device[-5:] for s in shards(model.get_layer("mlp").hidden.kernel)] == ["CPU:2", "CPU:3"]
    _assert_same(reference.get_weights(), model)
    assert max(np.abs(a - b).max() for a, b in zip(start, reference.get_weights())) > 1e-3

    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH))

    @tf.function(autograph=False)  # the step as Keras builds it
    def step(iterator):
        return strategy.run(model.train_step, args=(next(iterator),))

    counts = ops_per_device(step.get_concrete_function(iter(data)).graph, ["MatMul"])
    # Stage 0 (embed, column) runs on /cpu:0 and /cpu:1, stage 1 (row, mlp, logits) on /cpu:2 and /cpu:3, each
    # device its shards and the whole layers alike.
    assert counts["CPU:0"] == counts["CPU:1"] > 0 and counts["CPU:2"] == counts["CPU:3"] > 0, counts


@pytest.mark.parametrize("recompute", [False, True])
def test_a_layout_splits_each_stage_over_its_devices_and_trains_as_one_device(recompute):
    from tfdist.parallel.split_variables import is_split, shards

    x = rng.standard_normal((64, 6, 12)).astype("float32")
    y = rng.integers(0, 5, 64).astype("int32")
    strategy = PipelineStrategy(2, 2, devices=FOUR, layout=megatron_layout_map(2), boundaries=["norm"],
                                recompute=recompute, verbose=False)
    assert strategy.stage_devices == [[FOUR[0], FOUR[2]], [FOUR[1], FOUR[3]]]  # the model axis's two pipelines
    def compiled():
        return attention_and_mlp(12, keras.optimizers.SGD(0.05, momentum=0.9))

    reference = keras_alone("fit", compiled(), x, y, batch_size=16, epochs=2, shuffle=False, evaluate=(x, y),
                            predict=x[:23])
    with strategy.scope():
        model = compiled()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert history["loss"] == pytest.approx(reference["history"]["loss"], abs=1e-6)
    _assert_same(reference["weights"], model)
    held = {v.path: sorted(s.device[-5:] for s in shards(v)) for v in model.weights if is_split(v)}
    # Stage 0 (the attention) splits over /cpu:0 and /cpu:1, stage 1 (the MLP) over /cpu:2 and /cpu:3.
    assert held == {**{f"attention/{p}/{w}": ["CPU:0", "CPU:1"] for p in ("query", "key", "value")
                       for w in ("kernel", "bias")}, "attention/attention_output/kernel": ["CPU:0", "CPU:1"],
                    "mlp_up/kernel": ["CPU:2", "CPU:3"], "mlp_up/bias": ["CPU:2", "CPU:3"],
                    "mlp_down/kernel": ["CPU:2", "CPU:3"]}
    assert [s.shape for s in shards(model.get_layer("mlp_up").kernel)] == [(16, 16)] * 2
    assert sum(is_split(v) for v in model.optimizer.variables) == len(held)  # each momentum beside its variable
    np.testing.assert_allclose(model.predict(x[:23], batch_size=8, verbose=0), reference["predictions"], atol=1e-5)
    assert model.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(reference["evaluation"], abs=1e-5)
    assert strategy.job_report(model)["layout"]["text"] == \
        "1 process(es) x 1 replica(s) x 2 stage(s) x 2 split by the layout"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_and_dropout_train(policy):
    keras.mixed_precision.set_dtype_policy(policy)

    def build():
        return keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(5),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )

    strategy = PipelineStrategy(2, 2, devices=FOUR, verbose=False)
    with strategy.scope():
        model = _compile(build())
    history = model.fit(X, Y, batch_size=BATCH, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_recompute_refuses_dropout():
    strategy = PipelineStrategy(2, 2, devices=FOUR, recompute=True, verbose=False)
    with strategy.scope():
        model = _compile(
            keras.Sequential([keras.Input((12,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(5)])
        )
    with pytest.raises(ValueError, match="`recompute` cannot be used with layer 'dropout"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)


def test_a_custom_train_step_is_refused_before_training():
    class Custom(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    strategy = PipelineStrategy(2, 2, devices=FOUR, verbose=False)
    with strategy.scope():
        model = _compile(Custom([keras.Input((12,)), keras.layers.Dense(8), keras.layers.Dense(5)]))
    before = model.get_weights()
    with pytest.raises(ValueError, match="overrides `train_step`"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # exact: refused before the first step, nothing computed


def test_a_batch_that_does_not_split_into_micro_batches():
    strategy = PipelineStrategy(2, 4, devices=FOUR, verbose=False)
    with strategy.scope():
        model = _compile(_sequential())
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(20, drop_remainder=True)
    with pytest.raises(ValueError, match="a batch of 10 examples per replica does not split into 4 micro-batches"):
        model.fit(data, epochs=1, verbose=0)


@pytest.mark.parametrize("built", [True, False])
def test_more_stages_than_layers_is_refused_in_one_line_before_the_first_step(built):
    """At compile for a built model; for one `fit` builds from its first batch, once built, before its step is
    traced (inside the trace TensorFlow's error would wrap the line in its own)."""
    strategy = PipelineStrategy(4, 2, devices=FOUR, verbose=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,))] * built + [keras.layers.Dense(5)])
        with pytest.raises(ValueError, match="must not exceed the model's 1 layers") as refused:
            _compile(model)
            model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_stages=3, devices=FOUR), "multiple of `num_stages` \\(3\\)"),
        (dict(num_stages=2, devices=["/cpu:0"]), "multiple of `num_stages`"),
        (dict(num_stages=2, devices=FOUR[:3], tensor_parallel_size=2),
         r"multiple of `num_stages` \(2\) x `tensor_parallel_size` \(2\): each pipeline replica takes 4"),
        (dict(tensor_parallel_size=0), "`tensor_parallel_size` must be >= 1"),
        (dict(num_stages=2, devices=FOUR[:3], layout=Layout(model=2)),
         r"multiple of `num_stages` \(2\) x the layout's model axis \(2\): each pipeline replica takes 4"),
        (dict(devices=FOUR, layout=Layout(model=2), shard_optimizer=1),
         "`shard_optimizer` cannot split the optimizer of a pipeline whose stages are split over several devices"),
        (dict(schedule="interleaved"), "must be one of gpipe, 1f1b"),
        (dict(num_micro_batches=0), "must be whole numbers >= 1"),
        (dict(balance_by="flops"), "must be one of"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**{"devices": FOUR, **kwargs})


def test_stash_counts_follow_the_schedule():
    assert PipelineStrategy(2, 8, schedule="gpipe", devices=FOUR).peak_stashed_micro_batches == [8, 8]
    assert PipelineStrategy(2, 8, schedule="1f1b", devices=FOUR).peak_stashed_micro_batches == [2, 1]


def test_from_config():
    strategy = make_strategy(
        load_config("configs/pipeline.yaml", ["pipeline.schedule=gpipe", "pipeline.boundaries=[dense]"])
    )
    assert isinstance(strategy, PipelineStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert strategy.stage_devices == [["/cpu:0", "/cpu:1"], ["/cpu:2", "/cpu:3"]]
    assert strategy.schedule == "gpipe"


def test_from_config_with_tensor_parallel_stages():
    strategy = make_strategy(load_config(
        "configs/pipeline.yaml",
        ["strategy.tensor_parallel_size=2", "model.name=transformer", "model.width=32", "model.heads=2"],
    ))
    assert strategy.num_replicas_in_sync == 2  # a replica per device of a stage: one copy of the model
    assert strategy.stage_devices == [[FOUR[0], FOUR[2]], [FOUR[1], FOUR[3]]]
    assert strategy.tensor_parallel_groups == [FOUR[:2], FOUR[2:]]


@pytest.mark.parametrize(
    "overrides,key,rule",
    [
        (["strategy.logical_devices=3"], "strategy.logical_devices", "multiple of pipeline.num_stages \\(2\\)"),
        (["strategy.devices=[/cpu:0, /cpu:1, /cpu:2]"], "strategy.devices", "multiple of pipeline.num_stages"),
        (["train.global_batch_size=36"], "train.global_batch_size", "replicas x pipeline.num_micro_batches \\(2 x 4\\)"),
    ],
)
def test_config_errors_that_need_the_devices(overrides, key, rule):
    with pytest.raises(ConfigError, match=f"^`{key}` .*{rule}"):
        make_strategy(load_config("configs/pipeline.yaml", overrides))


@pytest.mark.slow
def test_pipeline_of_tensor_parallel_stages_trains_from_its_config(tmp_path):
    proc, result = train_with_metrics(tmp_path, "configs/pipeline_tensor_parallel.yaml", "train.epochs=8")
    assert result["tensor_parallel_groups"] == [FOUR[:2], FOUR[2:]]
    assert result["devices"] == FOUR
    assert result["final"]["val_accuracy"] >= 0.9
    assert "stage 1 on /cpu:2, /cpu:3 (split by the layout; bytes of the first)" in proc.stdout


def _batch_norm_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((12,)), keras.layers.Dense(24, activation="tanh", name="dense_in"),
        keras.layers.Dense(24, name="dense_mid"), keras.layers.BatchNormalization(name="bn"),
        keras.layers.Activation("tanh"), keras.layers.Dense(5, name="logits"),
    ])


@pytest.mark.parametrize("recompute", [False, True])
def test_batch_norm_statistics_move_once_per_step_by_the_whole_batch(recompute):
    """One step from the same weights: each micro-batch normalises by its own moments (as in GPipe), but the
    moving statistics move once, by the whole batch's mean and variance, exactly as on one device. (A
    BatchNormalization behind another sees inputs normalised per micro-batch, so only the first matches exactly.)"""
    x, y = X[:BATCH], Y[:BATCH]
    _, reference = _keras_alone(_batch_norm_model, x=x, y=y)
    strategy = PipelineStrategy(2, 4, devices=FOUR[:2], boundaries=["dense_mid"], recompute=recompute, verbose=False)
    _, model, _ = _train(_batch_norm_model, strategy, x=x, y=y)
    assert strategy.partition_of(model).stages[1].layer_names[:2] == ["dense_mid", "bn"]
    bn = model.get_layer("bn")
    for stat in ("moving_mean", "moving_variance"):
        index = next(i for i, weight in enumerate(model.weights) if weight is getattr(bn, stat))
        np.testing.assert_allclose(getattr(bn, stat).numpy(), reference["weights"][index], atol=1e-6, rtol=1e-5,
                                   err_msg=stat)


def test_steps_per_execution_over_two_pipeline_replicas_matches_one_device():
    start, reference = _keras_alone(_sequential)
    strategy = PipelineStrategy(2, 4, devices=FOUR, verbose=False)
    with strategy.scope():
        model = _compile(_sequential())
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=2)
    model.set_weights(start)
    model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    _assert_same(reference["weights"], model)
